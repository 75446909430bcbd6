"""The worker side of a decode: loads. A load writes its pulls (one per
prefill rank it reads from: ``_plan.pull_routes``) into the prefill's
mailbox, then takes each layer as it lands in the staging pool, checks it
(checksums, when asked), and copies it into the engine's tensor (whole
blocks, or head slices when the prefill's ranks hold fewer heads). A layer
that does not come (the prefill died: membership says so; the push's or
the load's deadline passed) or does not check makes the load's blocks
load errors. A load pushed as computed writes its pulls into the
prefill's slots for the transfer, as soon as they are there, and its
layers land as the prefill computes them. What must not live here:
set-up (``_worker``), serving pulls (``_prefill``, ``_push``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.errors import (
    ConnectionLost,
    LimitExceeded,
    P2PXferError,
    PeerLost,
    RegionWithdrawn,
    TransferAborted,
    TransferError,
    UnknownRegion,
    WaitTimeout,
)
from p2pxfer.integrations._tensors import checksum_blocks, copy_blocks
from p2pxfer.log import get_logger
from p2pxfer.scatter import ScatterList

from ._plan import (
    Load,
    Pull,
    Route,
    encode_pull,
    pull_region,
    pull_routes,
    region_names,
    split,
)
from ._state import SUM_BYTES, WorkerState

__all__ = ["DecodeSide", "LoadCorrupted"]

log = get_logger("p2pxfer.vllm")

GONE = ("dead", "left")
#: a pull pushed as computed whose slots are not there yet is written
#: again after the first pause, then twice as long, up to the second
PULL_RETRY_S = (0.01, 0.25)
I64 = npt.NDArray[np.int64]


class LoadCorrupted(TransferError):
    """A layer's bytes landed but their checksum is not the sender's."""


@dataclass(frozen=True)
class _Part:
    """One pull of a load: its route, decode request number, message slot,
    and the staging blocks it lands in."""

    route: Route
    slot: int
    msg: int
    staging: I64
    #: what its slots are taken under: this load's own, so that no later
    #: load of the same vLLM request id shares them
    key: str


class DecodeSide(WorkerState):
    def load(self, loads: Iterable[Load]) -> None:
        """Start each load (pulls, then per-layer waits) and return: all of
        them in one hop to the bridge. A load of no blocks only releases the
        prefill's hold (its pulls ask for nothing), and is not reported
        back."""
        o = self.opts
        routes = pull_routes(o.tp_size, o.rank, o.peer_tp, replicated=self.replicated)
        starting: list[tuple[Load, list[_Part], trio.CancelScope]] = []
        for job in loads:
            blocks = np.asarray(job.blocks, np.int64)
            parts: list[_Part] = []
            load = next(self._load_ids)
            with self._lock:
                try:
                    for i, route in enumerate(routes):
                        key = f"{job.request}#{i}@{load}"
                        staging = blocks[:0] if route.release else blocks * self.k + route.part
                        slot = self._slots.take(key)
                        try:
                            msg = self._msg_slots.take(key)
                        except LimitExceeded:
                            self._slots.release(key)
                            raise
                        parts.append(_Part(route, slot, msg, staging, key))
                except LimitExceeded as exc:
                    # Too many loads at once: this one fails (vLLM recomputes).
                    self._fail_unstarted(job, parts, exc)
                    continue
                # Its scope is known before it starts: a cancel behind it finds it.
                scope = trio.CancelScope()
                self._running[job.request] = scope
            starting.append((job, parts, scope))
        try:
            self.bridge.spawn_each(self._start_load, starting)
        except ConnectionLost as exc:
            # The daemon is gone: load errors, not an exception out of vLLM's
            # step (it recomputes the blocks and goes on).
            with self._lock:
                for job, parts, scope in starting:
                    if self._running.get(job.request) is scope:
                        del self._running[job.request]
                    self._fail_unstarted(job, parts, exc)

    async def _start_load(self, start: tuple[Load, list[_Part], trio.CancelScope]) -> None:
        await self._load(*start)

    def _fail_unstarted(self, job: Load, parts: list[_Part], exc: P2PXferError) -> None:
        """End a load that never started: its slots back, its blocks load
        errors. Under ``_lock``."""
        for p in parts:
            self._slots.release(p.key)
            self._msg_slots.release(p.key)
        log.warning("vllm.load_failed", request=job.request, error=str(exc))
        if job.blocks:
            self._errors.update(job.blocks)
            self._received.add(job.request)

    def cancel(self, requests: Iterable[str]) -> None:
        """Stop these loads (vLLM aborted their requests): each ends as a
        load error, and is reported back as usual."""
        for rid in requests:
            try:
                self.bridge.soon(self._cancel, rid)
            except ConnectionLost:
                return  # the bridge ended: so did its loads

    def _cancel(self, rid: str) -> None:
        with self._lock:
            scope = self._running.get(rid)
        if scope is not None:  # else over already
            scope.cancel()  # (before the load enters it: it starts cancelled)

    async def _load(self, job: Load, parts: list[_Part], scope: trio.CancelScope) -> None:
        c, o = self.bridge.client, self.opts
        assert self.pool is not None and self._msgs is not None
        kp = split(o.peer_tp, o.tp_size)  # the prefill's head slices per block
        failed = False
        deadline = trio.current_time() + o.load_timeout_s
        try:
            with scope:
                # The prefill's life now: a restarted prefill holds nothing of ours.
                peer = await c.lookup(job.node)
                life = None if peer is None else peer.get("incarnation")
                for p in parts:
                    if job.transfer_id:
                        await self._pull_early(job, p, deadline)
                        continue
                    nbytes = self._put_pull(job, p, deadline)
                    mailbox = job.key * kp + p.route.sub
                    await c.write(job.node, region_names(job.engine, p.route.rank)[1],
                                  ScatterList.contiguous(nbytes, p.msg * self.slot_bytes,
                                                         mailbox * self.slot_bytes),
                                  src=self._msgs, imm=mailbox, notify=True,
                                  timeout=o.load_timeout_s)
                t0 = time.perf_counter()
                if job.blocks:
                    await self._receive(job, [p for p in parts if not p.route.release],
                                        deadline, life)
                log.debug("vllm.loaded", request=job.request, peer=job.node,
                          blocks=len(job.blocks), seconds=time.perf_counter() - t0)
            if scope.cancelled_caught:
                raise TransferAborted(f"the load of {job.request!r} was stopped: vLLM aborted "
                                      "the request")
        except P2PXferError as exc:
            failed = True
            with self._lock:
                self._errors.update(job.blocks)
            log.warning("vllm.load_failed", request=job.request, peer=job.node,
                        blocks=len(job.blocks), error=str(exc))
        finally:
            with self._lock:
                if self._running.get(job.request) is scope:  # not a later load's
                    del self._running[job.request]
            with trio.CancelScope(shield=True):
                if self.gpu is not None:
                    # Every copy into the engine's blocks is over before vLLM
                    # reads them, or (a load error) computes them again.
                    try:
                        await trio.to_thread.run_sync(self.gpu.loads_done)
                    except P2PXferError as exc:
                        log.error("vllm.device_copy_failed", request=job.request,
                                  error=str(exc))
                        with self._lock:
                            self._errors.update(job.blocks)
            if failed:
                # A push already begun may still be landing, in blocks vLLM
                # computes again once it hears of the failure (in shared
                # memory, its very tensors): the daemon refuses more of the
                # request's pushes and answers once those have landed (or
                # their deadline passed, or their sender is gone). Then
                # vLLM hears of it. (Cancelled only when the bridge closes.)
                await self._forget(job, parts, refuse=True)
                self._ended(job, parts, requests=False)
                if job.transfer_id:
                    # A prefill pushing as computed asks for the request
                    # number anew with each layer it pushes (none after our
                    # deadline, each ending within a lease): refused while
                    # the number stays taken, as it does until then.
                    await trio.sleep_until(deadline + o.lease_s)
            with trio.CancelScope(shield=True):
                await self._forget(job, parts)
            self._ended(job, parts, requests=True, report=not failed)

    def _put_pull(self, job: Load, p: _Part, deadline: float) -> int:
        """Write the pull of part ``p`` into its message slot; its bytes.
        Pushed as computed, it says how long we still wait: the prefill
        starts no push after that."""
        o = self.opts
        assert self._msgs is not None
        skip = job.skip + len(job.blocks) if p.route.release else job.skip
        within = max(1, round((deadline - trio.current_time()) * 1000)) \
            if job.transfer_id else 0
        data = encode_pull(Pull(job.remote_request, self.node, self.pool_name,
                                self.sums_name if o.checksum else "", p.slot, skip,
                                p.staging, within), self.slot_bytes)
        off = p.msg * self.slot_bytes
        self._msgs.array[off:off + len(data)] = np.frombuffer(data, np.uint8)
        return len(data)

    async def _forget(self, job: Load, parts: list[_Part], refuse: bool = False) -> None:
        """The daemon's bookkeeping of the load's requests dropped (``refuse``:
        ended, and later pushes of them refused)."""
        assert self.pool is not None
        for p in parts:
            try:
                await self.pool.forget(p.slot, refuse=refuse)
            except P2PXferError as exc:
                log.debug("vllm.forget_failed", request=job.request, error=str(exc))

    def _ended(self, job: Load, parts: list[_Part], *, requests: bool,
               report: bool = True) -> None:
        """A load's slots back: its message slots (and ``requests``: its
        request numbers); ``report``: vLLM hears it ended."""
        with self._lock:
            for p in parts:
                if requests:
                    self._slots.release(p.key)
                if report:
                    self._msg_slots.release(p.key)
            if report and job.blocks:
                self._received.add(job.request)

    async def _pull_early(self, job: Load, p: _Part, deadline: float) -> None:
        """Write a pull pushed as computed into the prefill rank's slots for
        the transfer: they may not be there yet (the prefill has not
        scheduled the request), so asked again, less and less often, until
        the load's deadline; ``PeerLost`` once the prefill node is gone,
        ``TransferAborted`` once its slots went (``RegionWithdrawn``)."""
        c = self.bridge.client
        assert self._msgs is not None
        region = pull_region(job.engine, p.route.rank, job.transfer_id)
        pause = PULL_RETRY_S[0]
        while True:
            nbytes = self._put_pull(job, p, deadline)  # what we wait for now
            where = ScatterList.contiguous(nbytes, p.msg * self.slot_bytes,
                                           p.route.sub * self.slot_bytes)
            try:
                await c.write(job.node, region, where, src=self._msgs, imm=p.route.sub,
                              notify=True, timeout=max(deadline - trio.current_time(), 0.001))
                return
            except RegionWithdrawn as exc:
                # Its slots were there and went (aborted, lease passed):
                # they will not come back.
                raise TransferAborted(f"prefill node {job.node} took no pull for transfer "
                                      f"{job.transfer_id!r}: {exc}") from None
            except UnknownRegion:
                if trio.current_time() + pause >= deadline:
                    raise WaitTimeout(f"prefill node {job.node} took no pull for transfer "
                                      f"{job.transfer_id!r} within {self.opts.load_timeout_s:g} "
                                      "s") from None
                peer = await c.lookup(job.node)
                if peer is None or peer.get("state") in GONE:
                    raise PeerLost(f"prefill node {job.node} is "
                                   f"{'unknown' if peer is None else peer.get('state')} "
                                   f"(transfer {job.transfer_id!r} was never opened)") from None
                await trio.sleep(pause)
                pause = min(pause * 2, PULL_RETRY_S[1])

    async def _receive(self, job: Load, parts: list[_Part], deadline: float,
                       life: int | None) -> None:
        """Each layer as it lands, checked and copied into the engine's
        tensor, in layer order. One pull: every layer that landed comes in
        one round trip (``KVPool.layers``); several: layer by layer, each
        pull's in turn."""
        assert self.pool is not None and self.layout is not None
        n = self.layout.num_layers
        if len(parts) > 1:
            for layer in range(n):
                for p in parts:
                    await self._wait_layer(job, p.slot, layer, deadline, life)
                self._landed(job, parts, layer)
            return
        nxt = 0
        while nxt < n:
            since, poll = trio.current_time(), self._poll(job, nxt, deadline)
            try:
                async for layer in self.pool.layers(parts[0].slot, first=nxt, timeout=poll):
                    self._landed(job, parts, layer)
                    nxt = layer + 1
                    since = trio.current_time()
                return
            except WaitTimeout:
                await self._still_there(job, nxt, since, deadline, life)

    async def _wait_layer(self, job: Load, slot: int, layer: int, deadline: float,
                          life: int | None) -> None:
        assert self.pool is not None
        while True:
            since, poll = trio.current_time(), self._poll(job, layer, deadline)
            try:
                await self.pool.wait_layers(slot, layer, first=layer, timeout=poll)
                return
            except WaitTimeout:
                await self._still_there(job, layer, since, deadline, life)

    def _poll(self, job: Load, layer: int, deadline: float) -> float:
        """How long the next wait may last: ``poll_s``, less near the deadline."""
        left = deadline - trio.current_time()
        if left <= 0:
            raise WaitTimeout(f"layer {layer} of {job.request!r} from {job.node} did not land "
                              f"within {self.opts.load_timeout_s:g} s")
        return min(self.opts.poll_s, left)

    async def _still_there(self, job: Load, layer: int, since: float, deadline: float,
                           life: int | None) -> None:
        """A wait ended without the layer: ``WaitTimeout`` if the daemon
        ended it (well before ``poll_s``: the push's own deadline passed),
        ``PeerLost`` if membership says the prefill node is dead, left,
        unknown or restarted since the load began (its held requests died
        with it; the daemon fails the wait itself too once a push began)."""
        if trio.current_time() - since < self.opts.poll_s / 2 < deadline - trio.current_time():
            raise WaitTimeout(f"the push of {job.request!r} from {job.node} passed its deadline "
                              f"before layer {layer} landed")
        peer = await self.bridge.client.lookup(job.node)
        state = None if peer is None else peer.get("state")
        if peer is None or state in GONE:
            raise PeerLost(f"prefill node {job.node} is {state or 'unknown'} (layer {layer} of "
                           f"{job.request!r} never came)")
        if life is not None and peer.get("incarnation") not in (None, life):
            raise PeerLost(f"prefill node {job.node} restarted (incarnation {life} -> "
                           f"{peer.get('incarnation')}): layer {layer} of {job.request!r} "
                           "will not come")

    def _landed(self, job: Load, parts: list[_Part], layer: int) -> None:
        """A layer landed in the staging pool (every pull's part of it):
        check it, then copy it into the engine's tensor (a bad layer never
        reaches the engine)."""
        assert self.pool is not None and self.layout is not None
        for p in parts:
            if self.on_landed is not None:
                self.on_landed(self.pool.array, self.layout, layer, p.staging)
            if self.opts.checksum:
                self._check(job, p, layer)
        if not self.shared:
            copy_blocks(self.layers[layer], self.pool.array, self.layout, layer, job.blocks,
                        to_staging=False, slices=self.slices,
                        on=None if self.gpu is None else self.gpu.loads)

    def _check(self, job: Load, p: _Part, layer: int) -> None:
        assert self.pool is not None and self.layout is not None and self._sums is not None
        n = self.layout.num_layers
        off = (p.slot * n + layer) * SUM_BYTES
        want = int(self._sums.array[off:off + SUM_BYTES].view("<u8")[0])
        got = checksum_blocks(self.pool.array, self.layout, layer, p.staging)
        if got != want:
            blocks = p.staging.tolist()
            raise LoadCorrupted(f"layer {layer} of {job.request!r} from {job.node} (rank "
                                f"{p.route.rank}): checksum {got:#010x} over the bytes landed, "
                                f"{want:#010x} sent, staging blocks {blocks[:16]}"
                                f"{'...' if len(blocks) > 16 else ''}")
