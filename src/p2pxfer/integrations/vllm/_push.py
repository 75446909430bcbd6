"""The worker side of a prefill pushed as computed (``_plan``, "Push as
computed"): a request's mailbox slots exported under its transfer id once
it is scheduled (``open``), and each layer pushed to the decode that
pulled it as soon as the step completing the request's prompt computed
that layer (``computed``, from ``save_kv_layer``), in batches: whatever
layers are ready when the previous push ended go in the next one.

The request's blocks stay held until its pushes ended *and* the scheduler
finished it (``ended``): only then is it reported finished sending, so
vLLM never frees blocks a push may still read. An aborted request pushes
nothing more (a push under way is waited for) and tells the decode that
pulled it (``kv_abandon``, also after a failed push), whose load then fails
at once; a pull that comes within ``abort_grace_s`` of the abort is still
taken to be told so, and one that comes later finds the slots withdrawn
with the reason (``unexport`` with one), as does a pull for a transfer
that is never opened (``withdraw``). What must not live here: pulls of finished
requests (``_prefill``), loads (``_decode``).

Threads: vLLM's thread makes each ``_Early`` (``open``) and finds it in
``_early`` under ``_lock``; every field of an ``_Early`` is the bridge's
trio thread's, changed there only (``Bridge.soon``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.errors import ConnectionLost, InvalidArgument, P2PXferError
from p2pxfer.integrations._tensors import DeviceCopies
from p2pxfer.log import get_logger

from ._plan import Open, Pull, Save, Send, Withdraw, decode_pull, pull_region
from ._prefill import PrefillSide
from ._state import WorkerOptions

__all__ = ["PushSide"]

log = get_logger("p2pxfer.vllm")


@dataclass(eq=False)
class _Early:
    """One request pushed as computed (see the module docstring)."""

    open: Open
    layers: int
    #: layers complete in the pool (their copies over, on a GPU)
    ready: npt.NDArray[np.bool_] = field(init=False)
    #: a GPU's events behind layers' copies, not waited for yet
    events: dict[int, int] = field(default_factory=dict)
    table: npt.NDArray[np.int64] | None = None  # the prompt's blocks, from the last step
    ended: Send | None = None  # the scheduler finished it
    failed: bool = False  # a slice's push failed: the others stop too
    pushed: int = 0  # head slices pushed whole
    closed: bool = False  # the worker shut down under it
    served: bool = False  # the pushes are over
    lease_s: float = 0.0
    _changed: trio.Event = field(default_factory=trio.Event)
    #: scopes waited in, and how long each still waits once nothing more
    #: is pushed
    _waits: dict[trio.CancelScope, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ready = np.zeros(self.layers, bool)

    @property
    def aborted(self) -> bool:
        return self.ended is not None and not self.ended.blocks

    @property
    def stop(self) -> bool:
        """Nothing more is pushed (a push under way ends first)."""
        return self.aborted or self.failed

    def fail(self) -> None:
        """A slice failed: the others stop waiting too (the request is let
        go once it ended)."""
        self.failed = True
        for scope, grace in self._waits.items():
            self._deadline(scope, grace)
        self.changed()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            await self._changed.wait()

    def layer(self, layer: int, table: Sequence[int], event: int | None) -> bool:
        """``layer`` is computed (staged behind ``event`` on a GPU); False if
        ``event`` was not taken (the pushes are over, or the layer was
        ready already): its caller destroys it."""
        if self.served or self.ready[layer] or layer in self.events:
            return False
        if self.table is None:
            self.table = np.asarray(table, np.int64)
        if event is None:
            self.ready[layer] = True
        else:
            self.events[layer] = event
        self.changed()
        return True

    @contextlib.contextmanager
    def waiting(self, limit: float = math.inf, grace: float = 0.0
                ) -> Iterator[trio.CancelScope]:
        """A scope to wait in (for the pull, for layers): no deadline until
        the request ended, then its lease; once nothing more is pushed
        (aborted, failed), ``grace``; never past ``limit`` (the decode's
        own)."""
        with trio.CancelScope() as scope:
            self._waits[scope] = grace
            self._deadline(scope, grace)
            scope.deadline = min(scope.deadline, limit)
            try:
                yield scope
            finally:
                del self._waits[scope]

    def end(self, send: Send) -> None:
        self.ended = send
        for scope, grace in self._waits.items():
            self._deadline(scope, grace)
        self.changed()

    def _deadline(self, scope: trio.CancelScope, grace: float) -> None:
        if self.stop:
            scope.deadline = min(scope.deadline, trio.current_time() + grace)
        elif self.ended is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + self.lease_s)


class PushSide(PrefillSide):
    """A prefill's pulls of finished requests (``PrefillSide``) and its
    requests pushed as computed."""

    def __init__(self, opts: WorkerOptions) -> None:
        super().__init__(opts)
        self._early: dict[str, _Early] = {}  # under ``_lock``

    def open(self, opens: Iterable[Open]) -> None:
        """Take pulls for these requests as they are computed (in the
        bridge); a key out of range refuses them all."""
        assert self.layout is not None
        opens = list(opens)
        for o in opens:
            if not 1 <= o.key <= self.opts.max_held:
                raise InvalidArgument(f"key {o.key} is outside 1..{self.opts.max_held}")
        early = [_Early(o, self.layout.num_layers, lease_s=self.opts.lease_s) for o in opens]
        with self._lock:
            for e in early:
                self._early[e.open.request] = e
        try:
            self.bridge.spawn_each(self._serve_early, early)
        except ConnectionLost as exc:
            with self._lock:
                for e in early:
                    log.warning("vllm.open_failed", request=e.open.request, error=str(exc))
                    if self._early.get(e.open.request) is e:
                        del self._early[e.open.request]

    def withdraw(self, items: Iterable[Withdraw]) -> None:
        """These transfers will never be opened: a decode's pull for one
        hears why (in the bridge)."""
        with contextlib.suppress(ConnectionLost):  # ended: decodes fail at their deadline
            self.bridge.spawn_each(self._withdraw, list(items))

    async def _withdraw(self, w: Withdraw) -> None:
        name = pull_region(self.opts.engine, self.opts.rank, w.transfer_id)
        try:
            await self.bridge.client.withdraw(name, w.reason)
        except P2PXferError as exc:
            log.warning("vllm.withdraw_failed", transfer_id=w.transfer_id, error=str(exc))
        else:
            log.info("vllm.withdrawn", transfer_id=w.transfer_id, why=w.reason)

    def computed(self, layer: int, saves: Iterable[Save], on: DeviceCopies | None) -> None:
        """``layer`` of this step's requests is in the pool (queued behind
        ``on``'s copies on a GPU): those whose prompt ends this step may
        push it."""
        for s in saves:
            if not s.last:
                continue
            with self._lock:
                e = self._early.get(s.request)
            if e is None:
                continue
            event = None if on is None or self.gpu is None else self.gpu.layer_event(on)
            try:
                self.bridge.soon(self._layer, e, layer, s.table, event)
            except ConnectionLost:
                if event is not None and self.gpu is not None:
                    self.gpu.drop([event])
                return  # the bridge ended: nothing is pushed any more

    def _layer(self, e: _Early, layer: int, table: Sequence[int], event: int | None) -> None:
        if not e.layer(layer, table, event) and event is not None and self.gpu is not None:
            self.gpu.drop([event])

    def ended(self, s: Send) -> None:
        """The scheduler finished ``s``, a request pushed as computed."""
        with self._lock:
            e = self._early.get(s.request)
            if e is None:  # never opened, or its server could not start
                self._sent.add(s.request)
                return
        try:
            self.bridge.soon(self._end, e, s)
        except ConnectionLost:
            with self._lock:
                self._sent.add(s.request)

    def _end(self, e: _Early, s: Send) -> None:
        e.end(s)
        if e.served:
            with self._lock:
                self._sent.add(s.request)

    async def _serve_early(self, e: _Early) -> None:
        c, o = self.bridge.client, self.opts
        assert self._mailbox is not None
        name = pull_region(o.engine, o.rank, e.open.transfer_id)
        span = self.fanout * self.slot_bytes
        try:
            await c.export(name, self._mailbox, e.open.key * span, span)
            try:
                async with trio.open_nursery() as nursery:
                    for j in range(self.fanout):
                        nursery.start_soon(self._push_one, e, j, name)
            except trio.Cancelled:
                e.closed = True  # the bridge closes
                raise
            finally:
                with trio.CancelScope(shield=True):
                    try:
                        # A pull that comes after (the decode was slow to
                        # ask) hears why and fails at once, not at its
                        # deadline.
                        await c.unexport(name, reason=self._withdrawn(e))
                    except P2PXferError as exc:
                        log.debug("vllm.unexport_failed", region=name, error=str(exc))
        except P2PXferError as exc:
            log.warning("vllm.open_failed", request=e.open.request, error=str(exc))
        finally:
            e.served = True
            if e.events and self.gpu is not None:
                self.gpu.drop(list(e.events.values()))
                e.events.clear()
            with self._lock:
                if self._early.get(e.open.request) is e:  # not a later one of that id
                    del self._early[e.open.request]
                if e.ended is not None:
                    self._sent.add(e.open.request)

    async def _push_one(self, e: _Early, j: int, region: str) -> None:
        """Take the pull of head slice ``j``, then push each layer as it is
        ready. Stopped short (aborted, failed, out of time), the decode
        that pulled is told (``_abandon``): its load fails now, not at its
        deadline."""
        c, rid = self.bridge.client, e.open.request
        assert self._mailbox is not None and self.pool is not None
        slot = e.open.key * self.fanout + j
        # A pull that comes soon after the request was aborted is still
        # taken, so that its decode hears of the abort.
        with e.waiting(grace=self.opts.abort_grace_s) as scope:
            await c.wait_imm(j, 1, region=region)
        if self._gave_up(e, scope, j, "pull"):
            return
        pull: Pull | None = None
        try:
            sb = self.slot_bytes
            got = decode_pull(self._mailbox.array[slot * sb:(slot + 1) * sb])
            if got.prefill_request != e.open.transfer_id:
                raise InvalidArgument(f"a pull for {got.prefill_request!r} came in the slots of "
                                      f"transfer {e.open.transfer_id!r}")
            pull = got
            # The decode gives up then: what we pushed after could land in
            # blocks it has since given to another load.
            limit = trio.current_time() + pull.within_ms / 1000 if pull.within_ms else math.inf
            with e.waiting(limit) as scope:
                await e.until(lambda: e.table is not None or e.stop)
            if self._gave_up(e, scope, j, "last step") or e.table is None:
                await self._abandon(rid, pull, self._why(e, "its last step", limit))
                return
            blocks = e.table[pull.skip:]
            if not 0 <= pull.skip <= len(e.table) or len(blocks) != len(pull.blocks):
                raise InvalidArgument(f"a pull of {len(pull.blocks)} blocks after {pull.skip} "
                                      f"for a request of {len(e.table)}")
            src = blocks * self.k + (j if self.k > 1 else 0)
            if len(src) and (short := await self._push_layers(e, pull, slot, src, limit)):
                await self._abandon(rid, pull, short)
            else:
                e.pushed += 1
        except P2PXferError as exc:
            log.warning("vllm.push_failed", request=rid, part=j, error=str(exc))
            e.fail()
            if pull is not None:
                await self._abandon(rid, pull, f"its push failed: {exc}")

    @staticmethod
    def _gave_up(e: _Early, scope: trio.CancelScope, j: int, what: str) -> bool:
        if scope.cancelled_caught and not e.stop:
            log.warning("vllm.lease_expired", request=e.open.request, part=j, waiting_for=what,
                        lease_s=e.lease_s)
        return scope.cancelled_caught

    def _withdrawn(self, e: _Early) -> str | None:
        """Why ``e``'s slots go, for a decode whose pull comes too late; None
        once every slice was pushed (no tombstone: a router may use the
        transfer id again)."""
        if e.pushed == self.fanout:
            return None
        what = f"prefill request {e.open.request!r} (transfer {e.open.transfer_id!r})"
        if e.closed:
            return f"{what}: its prefill worker shut down"
        if e.aborted:
            return f"{what} was aborted"
        if e.failed:
            return f"{what}: a push of it failed"
        return f"{what} was given up (its lease of {e.lease_s:g} s, or its decode's deadline, " \
               "passed)"

    @staticmethod
    def _why(e: _Early, waiting_for: str, limit: float) -> str:
        """Why nothing more of ``e`` is pushed, for the decode's error."""
        if trio.current_time() >= limit:
            return "the decode's deadline passed"
        if e.aborted:
            return "it was aborted"
        if e.failed:
            return "a push of another of its head slices failed"
        return f"its lease ({e.lease_s:g} s) passed waiting for {waiting_for}"

    async def _push_layers(self, e: _Early, pull: Pull, slot: int,
                           src: npt.NDArray[np.int64], limit: float) -> str | None:
        """Each layer pushed as it is ready; why it stopped short, if it did."""
        c, o = self.bridge.client, self.opts
        assert self.pool is not None
        pushed = np.zeros(e.layers, bool)
        while not pushed.all():
            with e.waiting(limit) as scope:
                await e.until(lambda: bool((e.ready & ~pushed).any() or e.events) or e.stop)
            if self._gave_up(e, scope, slot % self.fanout, "layers") or e.stop:
                log.info("vllm.push_stopped", request=e.open.request, aborted=e.aborted,
                         layers_left=int((~pushed).sum()))
                return self._why(e, "layers", limit)
            await self._in_pool(e)
            batch = np.flatnonzero(e.ready & ~pushed)
            if not len(batch):
                continue
            if trio.current_time() >= limit:
                log.warning("vllm.push_stopped", request=e.open.request, reason="decode gave up",
                            layers_left=int((~pushed).sum()))
                return "the decode's deadline passed"
            if pull.sums:
                await self._send_sums(slot, pull, src, batch)
            push = await c.kv_push(pull.node, pull.pool, self.pool, src, pull.blocks,
                                   request=pull.request, layers=batch.tolist(),
                                   deadline=o.lease_s)
            result = await push.wait()
            pushed[batch] = True
            log.debug("vllm.pushed", request=e.open.request, peer=pull.node,
                      nbytes=result.nbytes, layers=len(batch), first=int(batch[0]))
        return None

    async def _in_pool(self, e: _Early) -> None:
        """A GPU's layers whose copies were queued: once they are over, ready."""
        if not e.events:
            return
        assert self.gpu is not None
        layers, events = list(e.events), list(e.events.values())
        e.events.clear()  # one waiter per event: the other slices see them ready
        await trio.to_thread.run_sync(self.gpu.synced, events)
        e.ready[layers] = True
        e.changed()
