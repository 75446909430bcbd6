"""KV pages through the daemon: named pools in clients' shared memory, pushes
from a prefill node's pool into a decode node's, and the decode side's
per-layer waits.

A client names a pool (``kv_pool``: its shared memory and a ``KVLayout``);
a receiving pool is exported under its name, and ``resolve`` hands its
layout out with its descriptor. A push (``kv_push``, the sending side in
``_kv_push``) is planned with ``p2pxfer.kv_plan.plan_push`` and run by
``p2pxfer._kv_core.push_layers``, as in-process pushes are, then:

1. ``kv_begin`` asks the receiver's daemon for a *request slot* (an
   immediate slot, ``_imms``) for these layers of this request, with a
   deadline; the receiver notes who sends (membership's verdict on that node
   fails the request's waits with ``PeerLost``);
2. one notify-mode send per layer, in layer order: the layer's immediate
   (``kv_plan.layer_imm`` over the slot's base) arrives once, after every
   piece of the layer landed (32 bits whatever the layer's size; and a
   layer whose rail breaks fails over to another rail, where per-piece
   immediates could no longer be counted exactly). Into a pool of this same
   daemon the send is the same-daemon copy (``_local``), whose immediates
   reach the slot exactly as the engine's do;
3. the receiver hears how many immediates each layer brings (1 in notify
   mode; the receiver does not assume how the sender sends), so it knows
   when a layer is complete: with ``kv_begin`` where the sender knows them
   before it posts (its engine's sends), else by ``kv_expect``; arrivals
   before that are counted, not lost.

The receiving side's per-layer counts are ``_kv_core.LayerArrivals`` (the
in-process receiver's too); what this module adds is the daemon's: request
slots, senders, deadlines, the table of requests. All of it is the daemon's
trio thread's. What must not live here: the block expansion
(``p2pxfer.kv_plan``), posting (``p2pxfer.engine``), counting a layer
(``_kv_core``), or the region directory (``_regions``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer._kv_core import LayerArrivals
from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    LimitExceeded,
    P2PXferError,
    PeerLost,
    TransferAborted,
    UnknownRegion,
)
from p2pxfer.kv_plan import KVLayout
from p2pxfer.log import get_logger
from p2pxfer.protocol import MAX_REASON

from ._device import is_device
from ._kv_push import MAX_DEADLINE_MS, Pushes, pack_i64, unpack_i64

if TYPE_CHECKING:
    from ._exports import Export, Exports
    from ._imms import ImmTable
    from ._sessions import ClientSession

__all__ = ["KV", "MAX_REQUESTS", "Pool", "pack_i64", "unpack_i64"]

log = get_logger("p2pxfer.daemon")

I64 = npt.NDArray[np.int64]
#: what a client keeps a KV pool in (``kv_pool``'s ``kind``)
MEMORY_KINDS = ("host", "cuda")
MAX_REQUESTS = 16384  # requests remembered per daemon; the oldest finished go first
#: requests given up and not yet forgotten, per pool (a receiver forgets
#: each within its deadline and a lease)
MAX_REFUSED = 1 << 16
REAP_EVERY_S = 0.25  # how often deadlines are checked
#: how long a request abandoned before anyone waited for it or pushed it is
#: kept for its first wait: a word that came late (its receiver had
#: forgotten the request) must not fail a later request of that number
ABANDONED_KEEP_S = 60.0


@dataclass
class Pool:
    """A client's named KV pool: its memory and its layout."""

    name: str
    session: ClientSession
    mem_id: int
    layout: KVLayout
    view: Any  # a memoryview of shared memory, or device memory (``_device``)
    receive: bool
    #: the memory the client keeps the pool in: "host", or "cuda" (a device
    #: pool: staged through this shared memory by the client, or ``direct``)
    kind: str = "host"
    #: the pool is the client's device memory itself (``share_device``)
    direct: bool = False


@dataclass(eq=False, kw_only=True)
class _Recv(LayerArrivals):
    """One request's arrivals into one of our pools, and who sends them."""

    pool: str
    request: int
    claimed: npt.NDArray[np.bool_]
    senders: set[str] = field(default_factory=set)
    slots: set[int] = field(default_factory=set)
    deadline: float = math.inf
    waiters: int = 0
    #: made by a sender's ``kv_abandoned`` before anyone waited or pushed:
    #: dropped then unless a wait heard it first (``ABANDONED_KEEP_S``)
    abandoned_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or self.expired or bool(
            self.complete()[self.claimed].all() and self.claimed.any())


class KV:
    """The daemon's KV pools and requests (both sides)."""

    def __init__(self, node: str, exports: Exports, imm_slots: Callable[[], ImmTable]) -> None:
        self.node = node
        self._imm_slots = imm_slots  # made on first use (``Daemon.imm_slots``)
        self.pools: dict[str, Pool] = {}  # receiving pools, by region name
        self._recv: dict[tuple[str, int], _Recv] = {}
        # request slot -> (request, its layers, [how many are not complete yet])
        self._slots: dict[int, tuple[_Recv, I64, list[int]]] = {}
        #: requests their receiver gave up (``kv_forget`` with ``refuse``):
        #: pushes of them are refused until they are forgotten for good;
        #: per pool, at most ``MAX_REFUSED``
        self._refused: dict[str, set[int]] = {}
        #: the sending side (``_kv_push``), wired by the daemon
        self.pushes: Pushes | None = None
        exports.on_remove.append(self.drop_pool)

    # -- pools (client side) ---------------------------------------------------------

    def add_pool(self, s: ClientSession, name: str, mem_id: int, layout_wire: Any,
                 receive: bool, writers: Any = None, kind: str = "host") -> dict[str, Any]:
        try:
            layout = KVLayout.from_wire(layout_wire)
        except DescriptorError as exc:
            raise InvalidArgument(f"kv_pool {name!r}: {exc}") from exc
        if not name:
            raise InvalidArgument("a KV pool needs a name")
        if kind not in MEMORY_KINDS:
            raise InvalidArgument(f"kv_pool {name!r}: memory must be one of {MEMORY_KINDS}, got "
                                  f"{kind!r}")
        if name in s.kv_pools:
            raise InvalidArgument(f"this client has a KV pool named {name!r} already")
        mem = s.mem(mem_id)
        direct = is_device(mem.map)
        if direct and kind != "cuda":
            raise InvalidArgument(f"kv_pool {name!r}: memory {mem_id} is device memory, so "
                                  f"the pool's memory is 'cuda', not {kind!r}")
        view = mem.view(0, layout.nbytes)  # out_of_range if the memory is too small
        result: dict[str, Any] = {}
        if receive:
            result["descriptor"] = s.export(name, mem_id, 0, layout.nbytes, writers)
        pool = Pool(name, s, mem_id, layout, view, receive, kind, direct)
        s.kv_pools[name] = pool
        if receive:
            self.pools[name] = pool
        log.info("kv.pool", client=s.label, pool=name, receive=receive, kind=kind,
                 direct=direct, nbytes=layout.nbytes)
        return result

    def listing(self, sessions: Any) -> list[dict[str, Any]]:
        """Every client's KV pools, for ``status``."""
        return [{"name": p.name, "client": p.session.label, "kind": p.kind,
                 "path": "direct" if p.direct else "host" if p.kind == "host" else "staged",
                 "receive": p.receive, "nbytes": p.layout.nbytes}
                for s in sessions for p in s.kv_pools.values()]

    def layout_of(self, region: str) -> dict[str, Any] | None:
        """The layout ``resolve`` hands out with a receiving pool's descriptor."""
        pool = self.pools.get(region)
        return None if pool is None else pool.layout.to_wire()

    def drop_pool(self, export: Export) -> None:
        """The export under a receiving pool went (unexported, its client
        gone; an ``Exports.on_remove`` hook): the pool and its requests end."""
        name = export.name
        pool = self.pools.pop(name, None)
        if pool is None:
            return
        pool.session.kv_pools.pop(name, None)
        for key in [k for k in self._recv if k[0] == name]:
            recv = self._recv.pop(key)
            self._end(recv, UnknownRegion(f"KV pool {name!r} was closed"))
        self._refused.pop(name, None)

    # -- receiving (peer requests, and the owner's waits) -------------------------------

    def begin(self, sender: str, pool: str, request: int, layers: bytes,
              deadline_ms: int, pieces: bytes | None = None) -> dict[str, Any]:
        """A request slot for these ``layers`` of ``request``. ``pieces``:
        each layer's count of immediates, known before the sender posts
        (one per layer in notify mode), as ``expect`` takes them later
        otherwise: the answer's ``expected`` says they were taken, and the
        sender sends no ``kv_expect`` (a control round trip less between its
        first layer and the next)."""
        p = self.pools.get(pool)
        if p is None:
            raise UnknownRegion(f"no KV pool named {pool!r} on {self.node}")
        n = p.layout.num_layers
        lays = unpack_i64(layers, "kv_begin layers")
        if len(lays) == 0 or int(lays.min()) < 0 or int(lays.max()) >= n \
                or len(np.unique(lays)) != len(lays):
            raise InvalidArgument(f"kv_begin: layers must be distinct, within 0..{n - 1}")
        counts = None
        if pieces is not None:
            counts = unpack_i64(pieces, "kv_begin pieces")
            if len(counts) != len(lays) or int(counts.min()) <= 0:
                raise InvalidArgument(f"kv_begin: want a piece count > 0 for each of the "
                                      f"push's {len(lays)} layers, got {len(counts)}")
        if not 0 < deadline_ms <= MAX_DEADLINE_MS:
            raise InvalidArgument(f"kv_begin: deadline_ms must be within 1..{MAX_DEADLINE_MS}, "
                                  f"got {deadline_ms}")
        if request in self._refused.get(pool, ()):
            raise InvalidArgument(f"request {request} into {pool!r} is over: its receiver gave "
                                  "it up")
        recv = self._request(pool, request, n)
        if recv.error is not None or recv.expired:
            raise InvalidArgument(f"request {request} into {pool!r} is over (forget it before "
                                  "using its id again)")
        if recv.claimed[lays].any():
            raise InvalidArgument(f"request {request}: layers "
                                  f"{lays[recv.claimed[lays]].tolist()[:8]} are pushed already")
        first = not recv.claimed.any()
        holder: list[int] = []
        slot = self._imm_slots().allocate(
            lambda layer, count: self._arrival(recv, holder[0], layer, count))
        holder.append(slot)
        recv.claimed[lays] = True
        recv.senders.add(sender)
        recv.slots.add(slot)
        recv.deadline = max(recv.deadline if recv.deadline < math.inf else 0.0,
                            trio.current_time() + deadline_ms / 1000)
        self._slots[slot] = (recv, lays, [len(lays)])
        log.debug("kv.begin", pool=pool, request=request, sender=sender, slot=slot,
                  layers=len(lays), counted=counts is not None)
        if counts is None:
            return {"slot": slot, "first": first}
        # Nothing can have arrived for a slot given out just now.
        self._completed(slot, self._slots[slot][2], recv.announce(lays, counts))
        return {"slot": slot, "first": first, "expected": True}

    def expect(self, sender: str, slot: int, pieces: bytes, first: int = 0
               ) -> dict[str, Any]:
        entry = self._slots.get(slot)
        if entry is None or sender not in entry[0].senders:
            raise InvalidArgument(f"kv_expect: slot {slot} is not a request of {sender!r}")
        recv, lays, left = entry
        counts = unpack_i64(pieces, "kv_expect pieces")
        if not 0 <= first <= len(lays) - len(counts) or len(counts) == 0 \
                or int(counts.min()) <= 0:
            raise InvalidArgument(f"kv_expect: want piece counts > 0 for layers {first}.. of "
                                  f"the push's {len(lays)}, got {len(counts)}")
        told = lays[first:first + len(counts)]
        if (recv.expected[told] >= 0).any():
            raise InvalidArgument("kv_expect: piece counts of these layers were sent already")
        # Layers whose pieces had all landed before their count was known.
        self._completed(slot, left, recv.announce(told, counts))
        return {}

    def arrived(self, sender: str, pool: str, request: int, layer: int) -> dict[str, Any]:
        """How many notifications of ``layer`` of ``request`` have landed
        here: a sender whose notification's outcome is unknown (its rail
        broke under it) asks before it sends it again. Only a sender of the
        request may ask."""
        recv = self._recv.get((pool, request))
        if recv is None or sender not in recv.senders:
            raise InvalidArgument(f"kv_arrived: {sender!r} pushes no request {request} into "
                                  f"{pool!r} here")
        if not 0 <= layer < len(recv.arrived):
            raise InvalidArgument(f"kv_arrived: layer {layer} is not within 0..."
                                  f"{len(recv.arrived) - 1}")
        return {"arrived": int(recv.arrived[layer]), "expected": int(recv.expected[layer])}

    def abandon(self, sender: str, pool: str, request: int, reason: str,
                landed: bytes = b"") -> dict[str, Any]:
        """``sender`` pushes no more of ``request`` into ``pool``: unless it
        is over already (every layer landed, given up, ended), it ends, its
        waits raising ``TransferAborted`` instead of waiting for the push's
        deadline, and ``begin`` refuses it while it is remembered (until it
        is forgotten; nothing of it pushed: until a wait heard it). Only a
        sender of the request may say so once a push of it began; a request
        nobody pushed or waited for yet is remembered ended for its first
        wait, at most ``ABANDONED_KEEP_S``.

        ``landed`` (int64 pairs: layer, notifications) is what the sender
        knows landed here. Its abandon can overtake those notifications (it
        comes on the control connection, they through the fabric, and the
        sender's completion says they landed, not that this daemon counted
        them yet): a request they complete is over, not ended."""
        p = self.pools.get(pool)
        if p is None:
            raise UnknownRegion(f"no KV pool named {pool!r} on {self.node}")
        if request < 0:
            raise InvalidArgument(f"kv_abandoned: request must be >= 0, got {request}")
        owed = self._owed(landed, p.layout.num_layers)
        if request in self._refused.get(pool, ()):
            return {"ended": False}
        known = self._recv.get((pool, request))
        if known is not None and (known.error is not None or known.expired
                                  or known.complete().all()):
            return {"ended": False}
        if known is not None and known.senders and sender not in known.senders:
            raise InvalidArgument(f"kv_abandoned: {sender!r} pushes no request {request} into "
                                  f"{pool!r} here")
        recv = known or self._request(pool, request, p.layout.num_layers)
        if known is None:
            recv.abandoned_at = trio.current_time()
        elif len(layers := owed[0]):
            arrived = recv.arrived.copy()
            np.maximum.at(arrived, layers, owed[1])
            if recv.complete(arrived).all():
                return {"ended": False}  # what is still on its way completes it
        log.warning("kv.abandoned", pool=pool, request=request, sender=sender,
                    reason=reason[:MAX_REASON])
        self._end(recv, TransferAborted(f"request {request} into {pool!r}: its sender {sender} "
                                        f"gave it up: {reason[:MAX_REASON] or 'no reason given'}"))
        return {"ended": True}

    @staticmethod
    def _owed(landed: bytes, num_layers: int) -> tuple[I64, I64]:
        """``kv_abandoned``'s ``landed``: (layers, notifications), checked."""
        pairs = unpack_i64(landed, "kv_abandoned landed")
        if len(pairs) % 2:
            raise InvalidArgument("kv_abandoned: landed must be (layer, count) pairs, got "
                                  f"{len(pairs)} numbers")
        layers, counts = pairs[0::2], pairs[1::2]
        if len(layers) and (int(layers.min()) < 0 or int(layers.max()) >= num_layers
                            or int(counts.min()) <= 0):
            raise InvalidArgument(f"kv_abandoned: landed wants layers within "
                                  f"0..{num_layers - 1} and counts > 0")
        return layers, counts

    def _arrival(self, recv: _Recv, slot: int, layer: int, count: int) -> None:
        """Notifications of ``layer`` landed (the slot's sink, in trio)."""
        if recv.arrive(layer, count) and (entry := self._slots.get(slot)) is not None:
            self._completed(slot, entry[2], 1)

    def _completed(self, slot: int, left: list[int], layers: int) -> None:
        """``layers`` more layers of the push that holds ``slot`` are
        complete (their waiters are woken); once all are, the slot goes back."""
        left[0] -= layers
        if layers and left[0] <= 0:
            self._free(self._slots[slot][0], slot)

    def _free(self, recv: _Recv, slot: int) -> None:
        self._slots.pop(slot, None)
        recv.slots.discard(slot)
        self._imm_slots().free(slot)

    def _end(self, recv: _Recv, error: P2PXferError | None) -> None:
        for slot in list(recv.slots):
            self._free(recv, slot)
        recv.end(error)

    def _request(self, pool: str, request: int, layers: int) -> _Recv:
        key = (pool, request)
        recv = self._recv.get(key)
        if recv is None:
            if len(self._recv) >= MAX_REQUESTS:
                self._trim()
            recv = self._recv[key] = _Recv(
                np.zeros(layers, np.int64), np.full(layers, -1, np.int64), pool=pool,
                request=request, claimed=np.zeros(layers, bool))
        return recv

    def _trim(self) -> None:
        for key, recv in list(self._recv.items()):
            if recv.finished:
                del self._recv[key]
                if len(self._recv) < MAX_REQUESTS // 2:
                    return

    def _owned(self, s: ClientSession, pool: str) -> Pool:
        p = self.pools.get(pool)
        if p is None or p.session is not s:
            raise UnknownRegion(f"this client has no receiving KV pool {pool!r}: only a "
                                "pool's owner waits for its layers")
        return p

    async def wait(self, s: ClientSession, pool: str, request: int, first: int, upto: int,
                   timeout_s: float) -> dict[str, Any]:
        """Until layers ``first..upto`` of ``request`` have all landed: then
        ``{done: k}`` (layers ``first..k-1`` are complete). ``expired`` too
        when the request's deadline or ``timeout_s`` passed first."""
        n = self._owned(s, pool).layout.num_layers
        if not 0 <= first <= upto < n:
            raise InvalidArgument(f"kv_wait: want 0 <= first <= upto < {n}, got {first}, {upto}")
        if request in self._refused.get(pool, ()):
            raise UnknownRegion(f"request {request} into {pool!r} was given up by its receiver")
        recv = self._request(pool, request, n)
        recv.waiters += 1
        try:
            if await recv.wait(np.arange(first, upto + 1), timeout_s):
                return {"done": recv.prefix(first)}
            return {"done": recv.prefix(first), "expired": True}
        finally:
            recv.waiters -= 1
            # A request nobody pushed and nobody waits for leaves nothing behind.
            if not recv.waiters and not recv.claimed.any() \
                    and self._recv.get((pool, request)) is recv:
                del self._recv[(pool, request)]

    def refuse(self, s: ClientSession, pool: str, request: int) -> None:
        """``request`` given up by its receiver: a sender's next
        ``kv_begin`` for it is refused until it is forgotten for good (at
        once, in the session's turn: nothing may slip in before the drain)."""
        self._owned(s, pool)
        given_up = self._refused.setdefault(pool, set())
        if request not in given_up and len(given_up) >= MAX_REFUSED:
            raise LimitExceeded(f"KV pool {pool!r} holds {MAX_REFUSED} requests given up and "
                                "not forgotten: forget some")
        given_up.add(request)

    async def forget(self, s: ClientSession, pool: str, request: int,
                     refuse: bool = False) -> None:
        """Drop ``request``. ``refuse``: give it up instead (``refuse``),
        and return once the pushes of it already begun have landed, or
        their deadline passed, or their sender was lost (nothing of them
        lands in the pool after), then end it."""
        self._owned(s, pool)
        if refuse:
            self.refuse(s, pool, request)
            over = self._recv.get((pool, request))
            if over is None:
                return
            begun = [self._slots[slot][1] for slot in over.slots if slot in self._slots]
            if begun and over.error is None and not over.expired:
                with contextlib.suppress(P2PXferError):
                    await over.wait(np.unique(np.concatenate(begun)),
                                    max(0.0, over.deadline - trio.current_time()))
            if over.error is None:
                self._end(over, UnknownRegion(f"request {request} into {pool!r} was given up "
                                              "by its receiver"))
            return
        self._refused.get(pool, set()).discard(request)
        recv = self._recv.pop((pool, request), None)
        if recv is not None:
            self._end(recv, UnknownRegion(f"request {request} into {pool!r} was forgotten"))

    def peer_lost(self, name: str, reason: str) -> None:
        """Membership says ``name`` died, left or restarted: what it was
        sending us will not come."""
        for recv in self._recv.values():
            if name in recv.senders and not recv.finished:
                log.warning("kv.sender_lost", pool=recv.pool, request=recv.request, peer=name)
                self._end(recv, PeerLost(f"request {recv.request} into {recv.pool!r}: its "
                                         f"sender {reason}"))

    async def reap(self) -> None:
        """Expire requests past their deadline (their slots go back)."""
        while True:
            await trio.sleep(REAP_EVERY_S)
            now = trio.current_time()
            for key, recv in list(self._recv.items()):
                if not recv.finished and recv.deadline < now:
                    log.warning("kv.deadline", pool=recv.pool, request=recv.request)
                    self._end(recv, None)
                elif recv.abandoned_at is not None and not recv.waiters \
                        and not recv.claimed.any() and recv.abandoned_at + ABANDONED_KEEP_S < now:
                    del self._recv[key]

    async def push(self, s: ClientSession, msg: Any) -> dict[str, Any]:
        """A ``kv_push`` (``_kv_push``)."""
        assert self.pushes is not None, "the daemon wires KV.pushes"
        return await self.pushes.push(s, msg)

    async def abandon_push(self, s: ClientSession, msg: Any) -> dict[str, Any]:
        """A ``kv_abandon`` (``_kv_push``)."""
        assert self.pushes is not None, "the daemon wires KV.pushes"
        return await self.pushes.abandon(s, msg)
