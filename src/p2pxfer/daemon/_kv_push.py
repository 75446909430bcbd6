"""The sending side of a KV push (``kv_push``): a client's source pool into a
pool on a peer (or on this node), layer by layer.

See ``_kv`` for the steps (``kv_begin``, with the layers' counts where they
go through the engine, one notify-mode send per layer, else ``kv_expect``);
the push itself runs in ``p2pxfer._kv_core.push_layers``
(the in-process push's too), and the receiver's bookkeeping is
``_kv.KV``'s. Each layer goes through the engine, or, into a pool of this
same daemon, through the same-daemon copy (``_local``: ``LocalCopies.write``
with the request's slot), as a plain write does; either way inside
``Writes.accounted`` (in flight, metrics). Owns no state of its own: each
push lives in its request's task. What must not live here: the block
expansion (``p2pxfer.kv_plan``), posting (the engine), the copy (``_local``),
settling an unknown notification (``_kv_settle``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer._kv_core import LayerSend, push_layers
from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    NotificationUnknown,
    P2PXferError,
    TransferAborted,
    UnknownRegion,
)
from p2pxfer.kv_plan import KVLayout, PushPlan, layer_imm, plan_push
from p2pxfer.log import get_logger
from p2pxfer.protocol import check_reason
from p2pxfer.scatter import ScatterList

from ._kv_settle import Unsettled, settle_notification
from ._peers import deadline_after, seconds_left

if TYPE_CHECKING:
    from p2pxfer.engine import Engine
    from p2pxfer.memory import RegionDescriptor

    from ._follow import Follower
    from ._imms import ImmTable
    from ._kv import KV, Pool
    from ._peers import PeerTable
    from ._regions import Regions
    from ._sessions import ClientSession
    from ._writes import Writes


__all__ = ["DEFAULT_DEADLINE_MS", "MAX_DEADLINE_MS", "Pushes", "pack_i64", "unpack_i64"]

log = get_logger("p2pxfer.daemon")

I64 = npt.NDArray[np.int64]
DEFAULT_DEADLINE_MS = 30_000
#: the longest a receiving pool holds a request's immediate slot for layers
#: that do not come (a sender that went away): the node's slots are few (4095)
#: and shared, so a push may not ask to hold one for ever
MAX_DEADLINE_MS = 600_000
#: requests whose landed layers a daemon remembers for a later abandon (the
#: oldest go first; each is kept at most until its receiver's deadline)
MAX_LANDED = 4096


def pack_i64(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def unpack_i64(data: bytes, what: str) -> I64:
    if len(data) % 8:
        raise InvalidArgument(f"{what}: {len(data)} bytes is not a whole number of int64")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


@dataclass(eq=False)
class _Counted:
    """A layer on its way whose notifications, once they are known to have
    landed, are counted into the request's ``landed`` (what a later
    ``kv_abandon`` tells the receiver to wait for)."""

    send: LayerSend
    layer: int
    landed: dict[int, int]

    @property
    def pieces(self) -> int:
        return self.send.pieces

    @property
    def imms(self) -> int:
        return self.send.imms

    def cancel(self, *, drain: bool = False) -> None:
        self.send.cancel(drain=drain)

    async def wait(self, *, drain: bool = False) -> int:
        pieces = await self.send.wait(drain=drain)
        self.landed[self.layer] = self.send.imms
        return pieces


@dataclass(eq=False)
class _LayerCopy:
    """A layer for the same-daemon copy: copied when ``push_layers`` awaits
    it (in layer order, so layer 0 is there before later layers are copied),
    never once cancelled before that."""

    copy: Callable[[], Awaitable[int]]
    pieces: int
    imms: int = 1
    state: str = "queued"  # then "copying", "copied" or "cancelled"

    def cancel(self, *, drain: bool = False) -> None:
        # A copy lands while it is awaited: drained or not, the same.
        if self.state == "queued":
            self.state = "cancelled"

    async def wait(self, *, drain: bool = False) -> int:
        if self.state == "queued":
            self.state = "copying"
            await self.copy()
            self.state = "copied"
        return self.pieces


class Pushes:
    """This daemon's clients' pushes."""

    def __init__(self, kv: KV, *, node: str, engine: Engine, peers: PeerTable,
                 regions: Regions, writes: Writes, follower: Follower,
                 imm_slots: Callable[[], ImmTable], write_timeout_s: float) -> None:
        self.kv = kv
        self.node = node
        self.engine = engine
        self.peers = peers
        self.regions = regions
        self.writes = writes
        self.follower = follower
        self._imm_slots = imm_slots  # made on first use (``Daemon.imm_slots``)
        self.write_timeout_s = write_timeout_s
        #: pushes under way, by (peer, pool, request): what ``abandon`` stops
        self._live: dict[tuple[str, str, int], dict[trio.CancelScope, trio.Event]] = {}
        #: per (peer, pool, request), the layers whose notifications this
        #: daemon knows landed (layer -> how many), and until when that is
        #: worth keeping (the receiver's deadline for the request). A push's
        #: completion here does not mean its receiver has counted them yet:
        #: an abandon, on the control connection, can overtake them, so it
        #: says what the receiver must count before it ends anything.
        self._landed: collections.OrderedDict[tuple[str, str, int],
                                              tuple[float, dict[int, int]]] = \
            collections.OrderedDict()

    async def _ask(self, peer: str, kind: str, until: float,
                   **fields: Any) -> dict[str, Any]:
        if peer == self.node:  # into a pool of this node: no control link needed
            if kind == "kv_begin":
                return self.kv.begin(peer, fields["pool"], fields["request"], fields["layers"],
                                     fields["deadline_ms"], fields.get("pieces"))
            if kind == "kv_arrived":
                return self.kv.arrived(peer, fields["pool"], fields["request"], fields["layer"])
            return self.kv.expect(peer, fields["slot"], fields["pieces"], fields["first"])
        return await self.peers.request(peer, kind, until=until, **fields)

    async def push(self, s: ClientSession, msg: Any) -> dict[str, Any]:
        key = (msg["peer"], msg["pool"], msg["request"])
        live = self._live.setdefault(key, {})
        scope, done = trio.CancelScope(), trio.Event()
        live[scope] = done
        try:
            with scope:
                return await self._push(s, msg)
            raise TransferAborted(f"the push of request {key[2]} into {key[1]!r} on {key[0]} "
                                  "was stopped: its sender abandoned the request")
        finally:
            done.set()
            del live[scope]
            if not live:
                del self._live[key]

    async def _push(self, s: ClientSession, msg: Any) -> dict[str, Any]:
        src = s.kv_pools.get(msg["src"])
        if src is None:
            raise UnknownRegion(f"this client has no KV pool {msg['src']!r}")
        peer, pool, request = msg["peer"], msg["pool"], msg["request"]
        if request < 0:
            raise InvalidArgument(f"request must be >= 0, got {request}")
        deadline_ms = msg.get("deadline_ms", DEFAULT_DEADLINE_MS)
        if not 0 < deadline_ms <= MAX_DEADLINE_MS:
            raise InvalidArgument(f"deadline_ms must be within 1..{MAX_DEADLINE_MS}, "
                                  f"got {deadline_ms}")
        self.follower.check_peer(peer)
        # One deadline for the whole push, as for a write: asking the peer
        # (resolve, kv_begin, kv_expect) spends the same time as the layers.
        until = deadline_after(self.write_timeout_s)
        with self._tracked(peer):
            # A pool of this node (by any name): the same uid rules as a local write.
            desc = await self.writes.destination(s, peer, pool, until)
            layout_wire = self.regions.kv_layout(peer, pool) if peer != self.node \
                else self.kv.layout_of(pool)
            if layout_wire is None:
                raise InvalidArgument(f"{pool!r} on {peer} is a region, not a KV pool")
            self.follower.check_descriptor(desc)
            try:
                dst_layout = KVLayout.from_wire(layout_wire)
            except DescriptorError as exc:
                raise InvalidArgument(f"{peer} sent a bad KV layout: {exc}") from exc
            layers = msg.get("layers")
            plan = plan_push(
                src.layout, dst_layout, unpack_i64(msg["src_blocks"], "src_blocks"),
                unpack_i64(msg["dst_blocks"], "dst_blocks"),
                None if layers is None else unpack_i64(layers, "layers").tolist(),
                src_size=len(src.view), dst_size=desc.length)
            t0 = time.perf_counter()
            copied = self.writes.copies(desc)
            # Through the engine each layer is one notify-mode send: one
            # notification, known now; the receiver takes the counts with
            # the slot, and no kv_expect has to wait between layers.
            counts = {} if copied else {"pieces": pack_i64(np.ones(len(plan.layers)))}
            begun = await self._ask(peer, "kv_begin", until, pool=pool, request=request,
                                    layers=pack_i64(plan.layers),
                                    deadline_ms=deadline_ms, **counts)
            slot = begun.get("slot")
            if type(slot) is not int or slot <= 0:
                raise InvalidArgument(f"{peer} answered kv_begin without a slot")
            told = bool(counts) and begun.get("expected") is True
            # Into this daemon's own pool nothing can overtake anything (the
            # copy counts its notifications as it goes): nothing to record.
            landed = {} if copied else self._landing(
                (peer, pool, request), deadline_ms, fresh=begun.get("first") is True)
            try:
                with self.writes.accounted():
                    pieces, first = await self._post(s, src, desc, peer, slot, plan, until,
                                                     pool, request, copied, landed, told)
            except (trio.Cancelled, P2PXferError):
                # As for a failed write: the pool (or its owner's life) may be
                # what went; the next push resolves it afresh.
                self.regions.forget(peer, pool)
                raise
        seconds = time.perf_counter() - t0
        log.debug("kv.push_complete", client=s.label, peer=peer, pool=pool, request=request,
                  layers=len(plan.layers), nbytes=plan.nbytes, seconds=seconds,
                  path="local-copy" if copied else "engine")
        return {"layers": pack_i64(plan.layers), "pieces": pack_i64(pieces),
                "nbytes": plan.nbytes, "seconds": seconds, "first_layer_s": first - t0}

    async def _post(self, s: ClientSession, src: Pool, desc: RegionDescriptor, peer: str,
                    slot: int, plan: PushPlan, until: float, pool: str, request: int,
                    copied: bool, landed: dict[int, int], told: bool) -> tuple[list[int], float]:
        """The layers, by ``push_layers``: through the engine, or ``copied``
        (the pool is this daemon's: ``Writes.copies``). Unless ``told``
        (``kv_begin`` carried the counts), the receiver hears each layer's
        count (``kv_expect``) as ``push_layers`` announces it; a layer whose
        notification is unknown is settled (``_kv_settle``). Each layer
        known landed is counted into ``landed``."""
        local = self.writes.local
        base = self._imm_slots().compose(slot, 0)

        async def copy(layer: int, sl: ScatterList) -> LayerSend:
            return _LayerCopy(functools.partial(local.write, s, src.view, sl, desc.name, layer,
                                                notify=True, slot=slot), len(sl))

        async def send(layer: int, sl: ScatterList) -> LayerSend:
            # A layer is pushed once per request (kv_begin claims it), and a
            # failed push tells the receiver what it knows landed: the
            # notification may go right behind the layer's data.
            return _Counted(await self.engine.submit(
                src.view, desc, sl, imm=layer_imm(base, layer), notify=True,
                notify_early=True, timeout=seconds_left(until)), layer, landed)

        async def announce(first: int, sends: list[LayerSend]) -> None:
            await self._ask(peer, "kv_expect", until, slot=slot, first=first,
                            pieces=pack_i64([t.imms for t in sends]))

        async def settle(k: int, unknown: NotificationUnknown) -> None:
            layer, part = list(plan.per_layer())[k]
            one = slice(part.start, part.start + 1)
            await settle_notification(
                self.engine, self._ask, Unsettled(peer, pool, request, layer,
                                               layer_imm(base, layer)),
                src.view, desc, (plan.src[one], plan.dst[one], plan.length[one]), until,
                unknown)
            landed.setdefault(layer, 1)  # the one the receiver answered for

        return await push_layers(plan, copy if copied else send,
                                 announce=None if told else announce, settle=settle)

    async def abandon(self, s: ClientSession, msg: Any) -> dict[str, Any]:
        """A ``kv_abandon``: this node's pushes of the request under way are
        stopped (each drops the layers it had not begun and finishes the one
        under way: ``push_layers``), then its
        receiver is told that no more comes (``KV.abandon`` there), so its
        waits end now and nothing of it lands after. The client must be one
        that may push into the pool."""
        peer, pool, request = msg["peer"], msg["pool"], msg["request"]
        reason = msg.get("reason", "")
        if request < 0:
            raise InvalidArgument(f"request must be >= 0, got {request}")
        check_reason(reason)
        self.follower.check_peer(peer)
        await self.writes.destination(s, peer, pool, deadline_after(self.write_timeout_s))
        pushes = list(self._live.get((peer, pool, request), {}).items())
        for scope, _ in pushes:
            scope.cancel()
        for _, done in pushes:
            await done.wait()
        until = deadline_after(self.write_timeout_s)  # after the pushes' drain
        if peer == self.node:
            return self.kv.abandon(peer, pool, request, reason)
        known = self._landed.get((peer, pool, request), (0.0, {}))[1]
        landed = pack_i64([x for item in sorted(known.items()) for x in item])
        r = await self.peers.request(peer, "kv_abandoned", until=until, pool=pool,
                                     request=request, reason=reason, landed=landed)
        self._landed.pop((peer, pool, request), None)  # kept for a retry until it is heard
        log.info("kv.push_abandoned", client=s.label, peer=peer, pool=pool, request=request,
                 ended=bool(r.get("ended")))
        return {"ended": bool(r.get("ended"))}

    def _landing(self, key: tuple[str, str, int], deadline_ms: int, *,
                 fresh: bool) -> dict[int, int]:
        """The request's record of landed layers, kept until its receiver's
        deadline (at most ``MAX_LANDED`` requests: the oldest go first).
        ``fresh``: the receiver had no layer of it pushed yet (``kv_begin``'s
        ``first``): a request number used again starts a new record."""
        now = trio.current_time()
        while self._landed and (len(self._landed) >= MAX_LANDED
                                or next(iter(self._landed.values()))[0] < now):
            self._landed.popitem(last=False)
        _, landed = self._landed.pop(key, (0.0, {}))
        if fresh:
            landed = {}
        self._landed[key] = (now + deadline_ms / 1000, landed)
        return landed

    @contextlib.contextmanager
    def _tracked(self, peer: str) -> Iterator[None]:
        """With membership, a push dies with its peer (``PeerLost``)."""
        if not self.follower.enabled or peer == self.node:
            yield
            return
        with self.follower.track_write(peer):
            yield
