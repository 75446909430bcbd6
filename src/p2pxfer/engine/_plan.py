"""A shard's rails and memory, and turning a write request into a postable plan.

``RailGroup`` owns the rails of one provider that one shard drives and their
registration cache: it registers and exports memory, and ``prepare`` validates
a write (immediate, destination, source, bounds) and lays it out on the rails
(``plan_stripes``) as a ``WriteBatch``, posting nothing. It runs in the trio
thread, before anything is queued.

What must not live here: posting, polling or counting completions (the
shard's, ``_shard.py``), trio, and any Python loop over pieces.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, Self

from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    PeerUnreachable,
    ReadOnlyBuffer,
    UnregisteredMemory,
)
from p2pxfer.fabric import IMM_TAIL_ABOVE, Rail, WriteBatch
from p2pxfer.memory import (
    ExportedRegion,
    LocalRegion,
    RegionDescriptor,
    RegistrationCache,
    buffer_span,
)
from p2pxfer.pages import INT64_MAX
from p2pxfer.scatter import ScatterList

from ._pairing import pair_rails

__all__ = ["PairKey", "PreparedWrite", "RailGroup", "Source", "Stripe", "Target",
           "imm_tails", "plan_stripes"]

#: a (rail, peer rail) pair: our rail's index and the peer endpoint's address
PairKey = tuple[int, bytes]

# Destinations (sets of peer rail addresses) whose rail pairing is remembered.
MAX_PAIRINGS = 4096
# (destination, source registration) routes remembered (``RailGroup.route``).
MAX_ROUTES = 1024


@dataclass(frozen=True)
class Source:
    """A write's source already looked up: the registration covering it and
    the span the scatter list's source offsets count from."""

    region: LocalRegion
    address: int
    nbytes: int


class Target(NamedTuple):
    """One (our rail, peer rail) pair a write to a destination may use, with
    what a cursor on it needs. (A tuple: one is made per pair per write.)"""

    ours: int
    rail: Rail
    address: bytes
    dst_base: int
    dst_key: int
    src_base: int
    src_desc: Any

    @property
    def key(self) -> PairKey:
        return (self.ours, self.address)

    def add_to(self, batch: WriteBatch, start: int, end: int, *, landed: bool = False,
               imm: int | None = None, arrays: Any = None, posting: bool = False) -> int:
        """A cursor over pieces ``[start, end)`` on this pair; its index.
        ``landed``: its last completion must mean every piece of it is in the
        target's memory: the last piece goes delivery-complete where the
        provider places one peer's writes in order (tcp: the tail then covers
        the pieces before it) or where a completion means landed or queued in
        order (shm: ``FabricInfo.completions_order_writes``; the notification
        is posted only after every completion was read), every piece where
        neither holds. ``posting``: the write is under way (a notification,
        a failover), so a peer that cannot be reached fails the new cursor
        (``WriteBatch.fail``) rather than raising in the thread adding it."""
        dc = None if not landed else end - 1 if self.rail.completions_ordered else start
        # The AV's epoch before the lookup: if the poller thread removes the
        # address after it, the cursor sees a newer epoch and looks it up
        # again before posting (``WriteBatch.refresh``), never posting to a
        # removed ``fi_addr_t``.
        epoch = self.rail.av.epoch
        try:
            dest, gone = self.rail.peer(self.address), False
        except PeerUnreachable:
            if not posting:
                raise
            dest, gone = 0, True
        i = batch.add(self.ours, self.rail, dest, start, end,
                      self.src_base, self.src_desc, self.dst_base, self.dst_key,
                      self.address, dc_from=dc, imm=imm, arrays=arrays, epoch=epoch)
        if gone:
            batch.fail(i)
        return i


class Route(NamedTuple):
    """What every write from one source registration to one destination
    shares, worked out once (``RailGroup.route``): the rail pairs with what
    a cursor on each needs, and the destination's rail addresses. Holds the
    registration weakly: a route must never keep a buffer alive."""

    dst: RegionDescriptor
    region: weakref.ref[LocalRegion]
    targets: tuple[Target, ...]
    dest: tuple[bytes, ...]


@dataclass(slots=True)
class PreparedWrite:
    """A validated write laid out on rails, ready for ``Poller.post``; not
    changed afterwards (not frozen only because one is made per write, and
    a frozen dataclass's ``__init__`` costs a microsecond more here)."""

    tid: int
    region: LocalRegion
    batch: WriteBatch
    pieces: int
    nbytes: int
    dst_name: str
    #: the destination's rail addresses: writes to one dest are posted in order
    dest: tuple[bytes, ...] = ()
    #: the node that owns the destination (for error messages)
    dst_node: str = ""
    #: every pair that reaches the destination (a failover picks among them)
    targets: tuple[Target, ...] = ()
    #: notify mode: the one immediate sent once every piece landed (the
    #: pieces carry none); None: per-piece immediates (``batch.imm``) or none
    notify_imm: int | None = None
    #: the pieces' (src, dst, length) arrays (a failover re-plans over them)
    arrays: tuple[Any, Any, Any] = ((), (), ())
    #: each of the caller's pieces goes as two, its tail carrying the
    #: immediate (``imm_tails``): ``pieces`` and the cursors count both
    tails: bool = False

    @property
    def per_piece(self) -> bool:
        """Every piece carries the immediate: the receiver counts pieces."""
        return self.batch.imm is not None

    @property
    def imms(self) -> int:
        """How many immediates the receiver counts for this write."""
        if self.notify_imm is not None:
            return 1
        return self.written if self.per_piece else 0

    @property
    def written(self) -> int:
        """The caller's pieces (after splitting and striping): a piece sent
        as head and tail counts once."""
        return self.pieces >> self.tails


@dataclass(frozen=True)
class Stripe:
    """Pieces ``[start, end)`` of a scatter list go out on ``rail`` (an index
    into the caller's rails, or into its rail pairs)."""

    rail: int
    start: int
    end: int


def plan_stripes(scatter: ScatterList, nrails: int, max_msg: int) -> tuple[ScatterList,
                                                                        list[Stripe]]:
    """Split pieces the provider cannot take in one message, and, with several
    rails, pieces too large to balance; then give each rail a contiguous range
    of about equal bytes. Deterministic: the target can compute the count."""
    sl, ranges = scatter.stripe(nrails, max_msg)
    if nrails == 1:
        return sl, [Stripe(0, 0, len(sl))]
    return sl, [Stripe(r, s, e) for r, (s, e) in enumerate(ranges) if e > s]


def imm_tails(tail: int, sl: ScatterList) -> bool:
    """Whether each piece of ``sl`` goes as two, its immediate riding its
    last ``tail`` bytes (``Rail.imm_tail``; cut in C as it posts,
    ``P2P_IMM_TAILS``). Not where the rail sends pieces whole, nor where
    some piece is too short to gain (within shm's inject size a write
    completes at its post whole): all pieces or none, as the cursor tells a
    head from a tail by its index."""
    return bool(tail) and sl.min_length > IMM_TAIL_ABOVE


class RailGroup:
    """The rails of one provider (one shard's NICs) and their registrations.

    Two kinds of registration live here, never sharing an MR: the cache's,
    for local access only (sources of writes), and one per export, for remote
    writes over exactly the exported range with keys of its own.

    Takes ownership of ``rails``: ``close`` deregisters everything, then
    closes them."""

    def __init__(self, rails: list[Rail], *, cache_entries: int = 1024,
                 numa_node: int = -1) -> None:
        if not rails:
            raise InvalidArgument("a rail group needs at least one rail")
        providers = {r.provider for r in rails}
        if len(providers) != 1:
            raise InvalidArgument(f"rails of one group must share a provider: {providers}")
        self.rails = rails
        self.provider = rails[0].provider
        self.cache = RegistrationCache(rails, max_entries=cache_entries)
        #: the NUMA node of these rails' NICs (-1: unknown), told to peers
        self.numa_node = numa_node
        self._exports: dict[str, tuple[ExportedRegion, LocalRegion | None]] = {}
        self._pairs: dict[tuple[bytes, ...], list[tuple[int, int]]] = {}
        self._routes: dict[tuple[int, int], Route] = {}
        self.max_msg = min(INT64_MAX, *(r.info.max_msg_size for r in rails))
        #: the widest immediate every rail carries (EFA and verbs: 32 bits)
        self.imm_bits = 8 * min(r.imm_bytes for r in rails)

    # -- memory ---------------------------------------------------------------

    def register(self, obj: Any, *, writable: bool = False, pin: bool = False) -> LocalRegion:
        """Register ``obj`` as a source of writes: local access only, whatever
        ``writable`` says (it only checks that the buffer could back an export;
        exports register for remote writes on their own)."""
        if writable and buffer_span(obj).readonly:
            raise ReadOnlyBuffer(
                f"cannot register a read-only {type(obj).__name__} as a write target")
        return self.cache.register(obj, pin=pin)

    def export(self, obj: Any, name: str, *, node: str = "", incarnation: int = 0,
               local: bool = True) -> RegionDescriptor:
        """Register exactly ``obj``'s span for remote writes on every rail, with
        fresh keys, and describe it for peers. With ``local``, also pin a
        local-access registration of it in the cache, so the exported memory
        can be a source of writes too (a KV pool sends from its own pages)."""
        if name in self._exports:
            raise InvalidArgument(f"a region named {name!r} is already exported")
        exp = ExportedRegion(name, buffer_span(obj), self.rails,
                             [self.numa_node] * len(self.rails))
        try:
            region = self.cache.register(obj, pin=True) if local else None
        except BaseException:
            exp.close()
            raise
        if region is not None:
            region.name = name
        self._exports[name] = (exp, region)
        return exp.descriptor(node, incarnation)

    def unexport(self, name: str) -> None:
        """Close the export's registrations now (a write through its descriptor
        fails from here on) and drop the pin it held on the cache's."""
        self.unexport_later(name)()

    def unexport_later(self, name: str) -> Callable[[], None]:
        """Free ``name`` and drop the pin the export held on the cache's
        registration now (only remote writes go through the export's keys);
        what closes those keys, for the caller to call (see
        ``Engine.unexport_later``)."""
        exp, region = self._exports.pop(name)
        if region is not None and not region.closed:
            self.cache.unpin(region)
        return exp.close

    def deregister(self, obj: Any) -> None:
        """Deregister whatever covers ``obj`` now. Refused (``InvalidArgument``)
        while it is pinned: the source of a write in flight, whose pieces the
        provider may still be reading from it, or exported."""
        span = buffer_span(obj)
        region = self.cache.lookup(span.address, span.nbytes)
        if region is not None:
            if region.pins:
                raise InvalidArgument(
                    f"cannot deregister {span.nbytes} bytes at {span.address:#x}: they are "
                    f"the source of writes in flight or exported ({region.pins} "
                    "in use); wait for the writes, or unexport, first")
            self.cache.release(region)

    def source(self, src: Any) -> tuple[LocalRegion, int, int]:
        """(registration, base address, size) of a write's source."""
        if isinstance(src, Source):
            if src.region.closed:
                raise UnregisteredMemory(f"{src.region!r} was deregistered")
            return src.region, src.address, src.nbytes
        if isinstance(src, LocalRegion):
            if src.closed:
                raise UnregisteredMemory(f"{src!r} was deregistered")
            return src, src.address, src.length
        span = buffer_span(src)
        return self.cache.require_span(span), span.address, span.nbytes

    # -- validation and layout --------------------------------------------------

    def check_imm(self, imm: object) -> None:
        if (not isinstance(imm, int) or isinstance(imm, bool)
                or not 0 <= imm < 1 << self.imm_bits):
            raise InvalidArgument(f"immediate {imm!r} does not fit in {self.imm_bits} bits")

    def check_destination(self, dst: RegionDescriptor) -> None:
        if not isinstance(dst, RegionDescriptor):
            raise DescriptorError(f"destination must be a RegionDescriptor, got {type(dst)}")
        for r in dst.rails:
            if r.provider != self.provider:
                raise DescriptorError(
                    f"region {dst.name!r} is on provider {r.provider!r}, this engine "
                    f"speaks {self.provider!r}"
                )

    def pairs(self, dst: RegionDescriptor) -> list[tuple[int, int]]:
        """``(our rail, dst rail)`` pairs a write to ``dst`` is striped over
        (:func:`pair_rails`: by reachability; every reachable rail of the peer
        takes traffic), worked out once per set of peer addresses."""
        key = tuple(r.address for r in dst.rails)
        pairs = self._pairs.get(key)
        if pairs is None:
            pairs = pair_rails([(r.address, r.name) for r in self.rails], list(key))
            if not pairs:
                raise DescriptorError(
                    f"no rail of this engine ({', '.join(r.name for r in self.rails)}) "
                    f"reaches a rail of region {dst.name!r} on {dst.node or 'its node'!r}")
            if len(self._pairs) >= MAX_PAIRINGS:
                self._pairs.clear()  # many peers came and went: start over
            self._pairs[key] = pairs
        return pairs

    def route(self, dst: RegionDescriptor, region: LocalRegion) -> Route:
        """The route from ``region`` to ``dst`` (checked and paired on first
        use, then one dict lookup: a small write's cost is mostly such setup).
        Keyed by identity, so a descriptor received anew is checked anew."""
        key = (id(dst), id(region))
        r = self._routes.get(key)
        if r is not None and r.dst is dst and r.region() is region:
            return r
        self.check_destination(dst)
        targets = tuple(
            Target(ours, self.rails[ours], rd.address, rd.base, rd.key, region.address,
                   region.mrs[ours].desc)
            for ours, rd in ((ours, dst.rails[theirs]) for ours, theirs in self.pairs(dst)))
        r = Route(dst, weakref.ref(region), targets, tuple(rd.address for rd in dst.rails))
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()  # many regions or peers came and went: start over
        self._routes[key] = r
        return r

    def prepare(self, src: Any, dst: RegionDescriptor, scatter: ScatterList,
                imm: int | Callable[[int], int] | None, tid: int, *, notify: bool = False,
                usable: Callable[[PairKey, bool], bool] | None = None) -> PreparedWrite:
        """Validate a write and lay it out on the rails, posting nothing.

        Raises ``ScatterError``/``InvalidArgument``/``DescriptorError``/
        ``UnregisteredMemory`` naming what is wrong. ``imm`` may be a function
        of the final piece count (for protocols that put the count in the
        immediate). The write is striped over :meth:`pairs`: one of our rails
        may write to several of the peer's, and the reverse; only over those
        ``usable(pair, per_piece)`` accepts (rail health), unless it accepts
        none. With ``notify`` the pieces carry no immediate and the last of
        each rail's share is posted delivery-complete; ``imm`` is sent once,
        after every piece (the shard's)."""
        if not isinstance(scatter, ScatterList):
            raise InvalidArgument(f"scatter must be a ScatterList, got {type(scatter).__name__}")
        if notify and imm is None:
            raise InvalidArgument("notify=True needs an immediate (imm=) to notify with")
        if imm is not None and not callable(imm):
            self.check_imm(imm)
        region, base, size = self.source(src)
        route = self.route(dst, region)
        scatter.check_bounds(size, dst.length)
        targets = route.targets
        if base != region.address:  # a source inside a larger registration
            targets = tuple(t._replace(src_base=base) for t in targets)
        live = targets if usable is None or len(targets) == 1 else [
            t for t in targets if usable(t.key, imm is not None and not notify)] or targets
        sl, stripes = plan_stripes(scatter, len(live), self.max_msg)
        if callable(imm):
            imm = imm(len(sl))
            self.check_imm(imm)
        tails = imm is not None and not notify and imm_tails(live[0].rail.imm_tail, sl)
        if tails:  # the cursors count heads and tails
            stripes = [Stripe(st.rail, 2 * st.start, 2 * st.end) for st in stripes]
        batch = WriteBatch(sl.src, sl.dst, sl.length, tid, None if notify else imm,
                           len(stripes) + (1 if notify else 0), imm_tails=tails)
        for st in stripes:
            live[st.rail].add_to(batch, st.start, st.end, landed=notify)
        return PreparedWrite(tid, region, batch, len(sl) << tails, sl.nbytes, dst.name,
                             route.dest, dst.node, targets,
                             imm if notify else None, (sl.src, sl.dst, sl.length), tails)

    def close(self, *, process_exits: bool = False) -> None:
        for exp, _ in self._exports.values():
            exp.close()
        self._exports.clear()
        self.cache.close()
        for rail in self.rails:
            rail.close(process_exits=process_exits)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
