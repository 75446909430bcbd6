"""The sending side of a KV push (``kv_push``): a client's source pool into a
pool on a peer (or on this node), layer by layer.

See ``_kv`` for the steps (``kv_begin``, one notify-mode transfer per
layer, ``kv_expect``); the receiver's bookkeeping is ``_kv.KV``'s. Owns no
state of its own: each push lives in its request's task. What must not live
here: the block expansion (``p2pxfer.kv``), posting (the engine), settling
an unknown notification (``_kv_settle``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.engine import Transfer
from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    NotificationUnknown,
    P2PXferError,
    UnknownRegion,
)
from p2pxfer.kv_plan import KVLayout, plan_push
from p2pxfer.log import get_logger
from p2pxfer.scatter import ScatterList

from ._kv_settle import Unsettled, settle_notification
from ._peers import deadline_after, seconds_left

if TYPE_CHECKING:
    from ._daemon import Daemon
    from ._kv import KV, Pool
    from ._sessions import ClientSession

__all__ = ["DEFAULT_DEADLINE_MS", "Pushes", "pack_i64", "unpack_i64"]

log = get_logger("p2pxfer.daemon")

I64 = npt.NDArray[np.int64]
DEFAULT_DEADLINE_MS = 30_000


def pack_i64(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def unpack_i64(data: bytes, what: str) -> I64:
    if len(data) % 8:
        raise InvalidArgument(f"{what}: {len(data)} bytes is not a whole number of int64")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


class Pushes:
    """This daemon's clients' pushes."""

    def __init__(self, daemon: Daemon, kv: KV) -> None:
        self.d = daemon
        self.kv = kv

    async def _ask(self, peer: str, kind: str, until: float,
                   **fields: Any) -> dict[str, Any]:
        if peer == self.d.node:  # into a pool of this node: no control link needed
            if kind == "kv_begin":
                return self.kv.begin(peer, fields["pool"], fields["request"], fields["layers"],
                                  fields["deadline_ms"])
            if kind == "kv_arrived":
                return self.kv.arrived(peer, fields["pool"], fields["request"], fields["layer"])
            return self.kv.expect(peer, fields["slot"], fields["pieces"], fields["first"])
        return await self.d.peers.request(peer, kind, until=until, **fields)

    async def push(self, s: ClientSession, msg: Any) -> dict[str, Any]:
        d = self.d
        src = s.kv_pools.get(msg["src"])
        if src is None:
            raise UnknownRegion(f"this client has no KV pool {msg['src']!r}")
        peer, pool, request = msg["peer"], msg["pool"], msg["request"]
        if request < 0:
            raise InvalidArgument(f"request must be >= 0, got {request}")
        d.follower.check_peer(peer)
        # One deadline for the whole push, as for a write: asking the peer
        # (resolve, kv_begin, kv_expect) spends the same time as the layers.
        until = deadline_after(d.config.write_timeout_s)
        with self._tracked(peer):
            # A pool of this node (by any name): the same uid rules as a local write.
            desc = await d.writes.destination(s, peer, pool, until)
            layout_wire = d.regions.kv_layout(peer, pool) if peer != d.node \
                else self.kv.layout_of(pool)
            if layout_wire is None:
                raise InvalidArgument(f"{pool!r} on {peer} is a region, not a KV pool")
            d.follower.check_descriptor(desc)
            try:
                dst_layout = KVLayout.from_wire(layout_wire)
            except DescriptorError as exc:
                raise InvalidArgument(f"{peer} sent a bad KV layout: {exc}") from exc
            layers = msg.get("layers")
            lays, so, do, ln, counts = plan_push(
                src.layout, dst_layout, unpack_i64(msg["src_blocks"], "src_blocks"),
                unpack_i64(msg["dst_blocks"], "dst_blocks"),
                None if layers is None else unpack_i64(layers, "layers").tolist(),
                src_size=len(src.view), dst_size=desc.length)
            t0 = time.perf_counter()
            begun = await self._ask(peer, "kv_begin", until, pool=pool, request=request,
                                    layers=pack_i64(lays),
                                    deadline_ms=msg.get("deadline_ms", DEFAULT_DEADLINE_MS))
            slot = begun.get("slot")
            if type(slot) is not int or slot <= 0:
                raise InvalidArgument(f"{peer} answered kv_begin without a slot")
            try:
                with d.writes.accounted():
                    pieces, first = await self._post(src, desc, peer, slot, lays, so, do, ln,
                                                     counts, until, pool, request)
            except (trio.Cancelled, P2PXferError):
                # As for a failed write: the pool (or its owner's life) may be
                # what went; the next push resolves it afresh.
                d.regions.forget(peer, pool)
                raise
        seconds = time.perf_counter() - t0
        nbytes = int(ln.sum())
        log.debug("kv.push_complete", client=s.label, peer=peer, pool=pool, request=request,
                  layers=len(lays), nbytes=nbytes, seconds=seconds)
        return {"layers": pack_i64(lays), "pieces": pack_i64(pieces), "nbytes": nbytes,
                "seconds": seconds, "first_layer_s": first - t0}

    async def _post(self, src: Pool, desc: Any, peer: str, slot: int, lays: list[int],
                    so: I64, do: I64, ln: I64, counts: I64,
                    until: float, pool: str, request: int) -> tuple[list[int], float]:
        """One transfer per layer, in layer order, submitted before any is
        awaited; the receiver hears the first layer's piece count as soon as
        it is known (so layer 0 can complete there while later layers are
        still being submitted), the others' once all are submitted; then the
        waits."""
        d = self.d
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        transfers: list[Transfer] = []
        first = 0.0
        try:
            for k, layer in enumerate(lays):
                a, b = bounds[k], bounds[k + 1]
                transfers.append(await d.engine.submit(
                    src.view, desc, ScatterList(so[a:b], do[a:b], ln[a:b]),
                    imm=d.imm_slots.compose(slot, layer), notify=True, timeout=seconds_left(until)))
                if k == 0:
                    await self._ask(peer, "kv_expect", until, slot=slot, first=0,
                                    pieces=pack_i64([transfers[0].imms]))
            if len(transfers) > 1:
                await self._ask(peer, "kv_expect", until, slot=slot, first=1,
                                pieces=pack_i64([t.imms for t in transfers[1:]]))
            for k, t in enumerate(transfers):
                try:
                    await t.wait()
                except NotificationUnknown as exc:
                    a = bounds[k]
                    await settle_notification(
                        d.engine, self._ask, Unsettled(peer, pool, request, lays[k],
                                                       d.imm_slots.compose(slot, lays[k])),
                        src.view, desc, (so[a:a + 1], do[a:a + 1], ln[a:a + 1]), until, exc)
                if k == 0:
                    first = time.perf_counter()
        except BaseException:
            # Stop what has not gone out; what was posted must finish before
            # the source pool is the client's again.
            for t in transfers:
                t.cancel()
            with trio.CancelScope(shield=True):
                for t in transfers:
                    with contextlib.suppress(P2PXferError):
                        await t.wait()
            raise
        return [t.pieces for t in transfers], first

    @contextlib.contextmanager
    def _tracked(self, peer: str) -> Iterator[None]:
        """With membership, a push dies with its peer (``PeerLost``)."""
        if not self.d.follower.enabled or peer == self.d.node:
            yield
            return
        with self.d.follower.track_write(peer):
            yield
