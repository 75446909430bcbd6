"""The region directory: what this node exports, and what it resolved.

``Regions`` answers for this node's exports (held by ``_exports``), holds
the descriptors resolved from peers (cached per ``(peer, region)``), and
which peers resolved each of ours, to tell them with ``invalidate`` when it goes:
until they hear it, and however long that takes (a cut link), since a write
through an unexported region's key lands nowhere without a word to the
writer (into private pages while the key lingers, ``Exports.remove``; once
it is closed, tcp drops the connection and what was queued behind it), also
when a new export takes the name meanwhile. ``locate`` asks
every reachable peer at once who exports a name. Owned by the daemon's
trio thread. What must not live here: the exports themselves (``_exports``),
client memory (``_sessions``) or membership verdicts (``_follow``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pxfer._pump import bounded
from p2pxfer.errors import InvalidArgument, P2PXferError, PeerUnreachable, UnknownRegion
from p2pxfer.log import get_logger
from p2pxfer.memory import RegionDescriptor

from . import _peers
from ._exports import Export, Exports
from ._imms import ImmTable
from ._peers import PeerTable

__all__ = ["INVALIDATE_GIVE_UP_S", "INVALIDATE_RETRY_S", "LOCATE_CONCURRENCY",
           "LOCATE_TIMEOUT_S", "TICKET_BATCH", "Regions", "check_tickets"]

log = get_logger("p2pxfer.daemon")

LOCATE_TIMEOUT_S = 2.0  # per peer asked by ``locate``
LOCATE_CONCURRENCY = 32  # peers asked at once by ``locate``
#: an ``invalidate`` the peer did not get is sent again after 0.1 s, doubling
#: up to the second of these; given up after the third (then the peer has
#: surely written, failed and re-resolved, or gone: as long as ``_retire``
#: holds a released range)
INVALIDATE_RETRY_S = (0.1, 1.0)
INVALIDATE_GIVE_UP_S = 600.0
#: how long an unexport waits for the peers that resolved the region to
#: hear of it (``told``); a peer cut off is told later, in the background
TELL_WAIT_S = 1.0
#: notification tickets asked for at once (``_imms``: with ``resolve``, then
#: ``imm_tickets`` in the background once half of them are spent)
TICKET_BATCH = 64
#: the pause after a refill of notification tickets that failed before the
#: next is asked for (the control link may be cut a while); a write with no
#: ticket waits for a refill on its way within its own deadline
TICKET_WAIT_S = 2.0


@dataclass(eq=False)
class _Refill:
    """An ``imm_tickets`` under way for the export whose slot is ``slot``:
    ``done`` once answered, ``ok`` if it brought tickets."""

    slot: int
    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False


class _Telling:
    """The peers still to hear that a region went (``Regions.told``)."""

    def __init__(self, peers: int) -> None:
        self.left = peers
        self.done = trio.Event()

    def one_done(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.done.set()


class Regions:
    """Exports, resolved descriptors, and who resolved ours."""

    def __init__(self, node: str, peers: PeerTable, exports: Exports,
                 imm_slots: Callable[[], ImmTable]) -> None:
        self.node = node
        self.peers = peers
        self.exports = exports
        self._imm_slots = imm_slots
        exports.on_remove.append(self.export_gone)
        exports.settle_remove.append(self.told)
        self._resolved: dict[tuple[str, str], RegionDescriptor] = {}
        # The immediate slot of each region resolved (ours: its export's): a
        # write's immediate names it, so the owner counts it for that region only.
        self._slots: dict[tuple[str, str], int] = {}
        self._kv: dict[tuple[str, str], dict[str, Any]] = {}  # KV pools' layouts
        #: unspent notification tickets of each region resolved (``_imms``),
        #: with the slot they are of. Kept when the descriptor is forgotten
        #: (they stay valid while the export does; a new export has another
        #: slot): the peer holds them for us until its region or our life goes
        self._tickets: dict[tuple[str, str], tuple[int, list[int]]] = {}
        #: asked for more, not answered yet: set once answered
        self._refilling: dict[tuple[str, str], _Refill] = {}
        #: a resolve on its way, per (peer, region): set once answered
        self._resolving: dict[tuple[str, str], trio.Event] = {}
        #: the peer's last answer brought no tickets (none to give: no room
        #: for tags, or it holds too many for us): none asked for, none
        #: waited for, until the region is resolved afresh
        self._barren: set[tuple[str, str]] = set()
        self._refill_failed: dict[tuple[str, str], float] = {}  # when, for the pause
        self._resolved_by: dict[str, set[str]] = {}
        #: invalidations not delivered yet, per (peer, region) (``status``)
        self.pending_invalidations: Counter[tuple[str, str]] = Counter()
        #: regions that went, until every peer that resolved them heard
        self._telling: dict[str, _Telling] = {}
        #: whether a peer may be asked now (membership: it is running)
        self.reachable: Callable[[str], bool] = lambda peer: True
        self.nursery: trio.Nursery | None = None

    # -- ours -------------------------------------------------------------------

    def export_gone(self, export: Export) -> None:
        """An export went: tell every peer that resolved it (in the background;
        ``told`` waits for them a while)."""
        peers = [p for p in self._resolved_by.pop(export.name, set()) if p in self.peers]
        if not peers or self.nursery is None:
            return
        telling = self._telling[export.name] = _Telling(len(peers))
        for peer in peers:
            self.nursery.start_soon(self._invalidate, peer, export.name, telling)

    async def told(self, region: str) -> None:
        """Wait until every peer that resolved ``region`` (which just went)
        has heard, at most ``TELL_WAIT_S``: once an unexport has answered,
        a write from any of them that can be reached fails with
        ``unknown_region`` rather than going through the old key (whose
        bytes land nowhere: ``Exports.remove``)."""
        telling = self._telling.get(region)
        if telling is not None:
            with trio.move_on_after(TELL_WAIT_S):
                await telling.done.wait()

    async def _invalidate(self, peer: str, region: str, telling: _Telling) -> None:
        """Tell ``peer`` that ``region`` went, again and again until it has
        heard (or it is forgotten: a new life holds nothing of ours, or
        ``INVALIDATE_GIVE_UP_S`` passed)."""
        key = (peer, region)
        self.pending_invalidations[key] += 1
        delay, give_up = INVALIDATE_RETRY_S[0], trio.current_time() + INVALIDATE_GIVE_UP_S
        failures = 0
        try:
            while peer in self.peers and key in self.pending_invalidations:
                try:
                    await self.peers.request(peer, "invalidate", region=region)
                except P2PXferError as exc:
                    failures += 1
                    if failures == 1 or trio.current_time() > give_up:
                        log.warning("region.invalidate_failed", peer=peer, region=region,
                                    error=bounded(str(exc)), attempts=failures,
                                    retrying=trio.current_time() <= give_up)
                    if trio.current_time() > give_up:
                        return
                else:
                    if failures:
                        log.info("region.invalidated", peer=peer, region=region,
                                 attempts=failures + 1)
                    return
                await trio.sleep(delay)
                delay = min(2 * delay, INVALIDATE_RETRY_S[1])
        finally:
            telling.one_done()
            # The last to finish forgets it, whether or not ``told`` still waited.
            if telling.done.is_set() and self._telling.get(region) is telling:
                del self._telling[region]
            if key in self.pending_invalidations:
                self.pending_invalidations[key] -= 1
                if self.pending_invalidations[key] <= 0:
                    del self.pending_invalidations[key]

    def local_descriptor(self, region: str, *, for_peer: str = "") -> RegionDescriptor:
        """Our descriptor of ``region``; ``for_peer`` will be told when it goes."""
        export = self.exports.get(region)
        if export is None:
            raise self.exports.absent(region)
        if for_peer and for_peer in self.peers:  # only known peers are told (bounded)
            self._resolved_by.setdefault(region, set()).add(for_peer)
        return export.desc

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": e.name, "length": e.length, "client": e.owner.label,
                 "kind": e.mem.kind} for e in self.exports]

    # -- theirs -----------------------------------------------------------------

    async def resolve(self, peer: str, region: str, *,
                      until: float | None = None) -> RegionDescriptor:
        """``region`` of ``peer`` (cached). ``until``: the deadline (trio
        time) of the write that asks, which bounds asking the peer."""
        if peer == self.node:
            return self.local_descriptor(region)
        key = (peer, region)
        # One resolve of a region at a time: a burst of writes to a region
        # not resolved yet sent one each, each bringing a batch of tickets
        # that replaced the last (the peer counted them all as ours: past its
        # cap it gave none, and the region was taken for one that gives
        # none). The others wait for it, within their own deadlines.
        while (hit := self._resolved.get(key)) is None \
                and (asking := self._resolving.get(key)) is not None:
            with trio.move_on_at(math.inf if until is None else until):
                await asking.wait()
            if until is not None and trio.current_time() >= until:
                break  # the request below says so, in the usual words
        if hit is not None:
            return hit
        asking = self._resolving[key] = trio.Event()
        try:
            return await self._ask_resolve(peer, region, until)
        finally:
            if self._resolving.get(key) is asking:
                del self._resolving[key]
            asking.set()

    async def _ask_resolve(self, peer: str, region: str,
                           until: float | None) -> RegionDescriptor:
        key = (peer, region)
        held = self._tickets.get(key)
        want = 0 if held is not None and held[1] else TICKET_BATCH
        result = await self.peers.request(peer, "resolve", region=region, until=until,
                                          tickets=want)
        try:
            desc = RegionDescriptor.from_wire(result.get("descriptor"))
        except P2PXferError as exc:
            raise PeerUnreachable(f"{peer} sent a bad descriptor: {exc}") from exc
        slot = result.get("slot")
        if type(slot) is not int or slot <= 0:
            raise PeerUnreachable(f"{peer} sent no immediate slot for {region!r}")
        self._resolved[key] = desc
        self._slots[key] = slot
        fresh = check_tickets(result.get("tickets"), slot, self._imm_slots())
        if want and fresh:
            self._barren.discard(key)
        elif want:
            self._barren.add(key)
        held = self._tickets.get(key)  # now: a refill may have added to it meanwhile
        if held is not None and held[0] == slot:
            fresh.extend(held[1])
        self._tickets[key] = (slot, fresh)
        if isinstance(layout := result.get("kv"), dict):
            self._kv[key] = layout
        return desc

    def kv_layout(self, peer: str, region: str) -> dict[str, Any] | None:
        """The layout a peer gave with a region it resolved as a KV pool."""
        return self._kv.get((peer, region))

    def ticket(self, peer: str, region: str) -> int | None:
        """A notification ticket of ``region`` on ``peer`` (resolved just
        now), or None where none is in hand: the peer gives none (no room
        for tags in the CQ data, or it holds too many), or a refill is still
        on its way; the notification then goes through the region's slot.
        Never waits: once half a batch is left, more are asked for in the
        background (``_refill``; not from a peer whose last answer brought
        none, nor within ``TICKET_WAIT_S`` of a refill that failed)."""
        key = (peer, region)
        slot = self._slots.get(key)
        held = self._tickets.get(key)
        if slot is None or held is None or held[0] != slot:
            return None
        if len(held[1]) <= TICKET_BATCH // 2 and key not in self._refilling \
                and self.nursery is not None and key not in self._barren \
                and trio.current_time() >= self._refill_failed.get(key, -math.inf) \
                + TICKET_WAIT_S:
            refill = self._refilling[key] = _Refill(slot)
            self.nursery.start_soon(self._refill, peer, region, slot, refill)
        return held[1].pop() if held[1] else None

    async def ticket_for_write(self, peer: str, region: str, until: float) -> int | None:
        """``ticket``, or, with none in hand while a refill is on its way
        (a burst of writes spent the batch, or the control link was cut a
        while), the refill waited for, within the write's deadline ``until``
        (the refill is bounded itself: ``_refill``). Not a fixed wait: on a
        busy host a refill took longer than one, and the writes that gave up
        on it went without a ticket, their notifications unsettleable. None
        if no ticket comes: the peer gives none, the refill failed, or the
        write's time ran out."""
        key = (peer, region)
        with trio.move_on_at(until):
            while True:
                ticket = self.ticket(peer, region)
                refill = self._refilling.get(key)
                if ticket is not None or refill is None or refill.slot != self._slots.get(key):
                    return ticket
                await refill.done.wait()
                if not refill.ok:
                    return self.ticket(peer, region)
        return None

    async def _refill(self, peer: str, region: str, slot: int, refill: _Refill) -> None:
        key = (peer, region)
        try:
            # Bounded whole, the wait for the link included: a settle or
            # resolve may hold it until its write's deadline, and writes
            # that find no ticket wait for this refill meanwhile.
            result = await self.peers.request(peer, "imm_tickets", region=region,
                                              n=TICKET_BATCH,
                                              until=trio.current_time() + _peers.PEER_TIMEOUT_S)
            held = self._tickets.get(key)
            if held is not None and held[0] == slot:  # still that export's
                fresh = check_tickets(result.get("tickets"), slot, self._imm_slots())
                held[1].extend(fresh)
                refill.ok = bool(fresh)
                self._refill_failed.pop(key, None)
                if not fresh:
                    self._barren.add(key)
        except P2PXferError as exc:
            self._refill_failed[key] = trio.current_time()
            log.info("region.tickets_failed", peer=peer, region=region,
                     error=bounded(str(exc)))
        finally:
            if self._refilling.get(key) is refill:
                del self._refilling[key]
            refill.done.set()

    async def settle(self, peer: str, ticket: int, value: int, until: float) -> bool:
        """``notify_settle`` on ``peer``: whether the notification through
        ``ticket`` had landed (if not, the peer counted it now)."""
        result = await self.peers.request(peer, "notify_settle", ticket=ticket, imm=value,
                                          until=until)
        return result.get("arrived") is True

    def slot(self, peer: str, region: str) -> int:
        """The immediate slot of a region resolved (or exported) just now."""
        if peer == self.node:
            export = self.exports.get(region)
            slot = None if export is None else export.slot
        else:
            slot = self._slots.get((peer, region))
        if slot is None:
            raise UnknownRegion(f"no region named {region!r} on {peer}")
        return slot

    def forget(self, peer: str, region: str) -> None:
        self._resolved.pop((peer, region), None)
        self._slots.pop((peer, region), None)
        self._kv.pop((peer, region), None)

    def rerouted(self, peer: str) -> None:
        """The control link to ``peer`` goes another way now (a rail healed,
        or another answers): a refill that failed on the old way is no
        reason to wait before asking again (the next write's refill goes
        the new way, and that write waits for it)."""
        for key in [k for k in self._refill_failed if k[0] == peer]:
            del self._refill_failed[key]

    def forget_peer(self, peer: str) -> None:
        """``peer``'s life (or address) changed: its descriptors are void, and
        it holds none of ours."""
        for key in [k for k in self._resolved if k[0] == peer]:
            del self._resolved[key]
            self._slots.pop(key, None)
            self._kv.pop(key, None)
            self._tickets.pop(key, None)
        for key in [k for k in (*self._barren, *self._refill_failed) if k[0] == peer]:
            self._barren.discard(key)
            self._refill_failed.pop(key, None)
        for holders in self._resolved_by.values():
            holders.discard(peer)
        for key in [k for k in self.pending_invalidations if k[0] == peer]:
            del self.pending_invalidations[key]  # their tasks stop at the next attempt

    async def locate(self, region: str) -> list[str]:
        """Every node exporting ``region``: this node, and each reachable
        peer asked at once, each within LOCATE_TIMEOUT_S; the descriptors
        found are kept like any resolved one, and dropped with their node's
        life."""
        if not region:
            raise InvalidArgument("region name must not be empty")
        found = [self.node] if region in self.exports else []
        limiter = trio.CapacityLimiter(LOCATE_CONCURRENCY)

        async def ask(peer: str) -> None:
            async with limiter:
                with trio.move_on_after(LOCATE_TIMEOUT_S):
                    try:
                        await self.resolve(peer, region)
                    except P2PXferError:
                        return  # not there, or not answering: not a place to write to
                    found.append(peer)

        async with trio.open_nursery() as nursery:
            for peer in self.peers.names():
                if self.reachable(peer):
                    nursery.start_soon(ask, peer)
        return sorted(found)


def check_tickets(tickets: Any, slot: int, table: ImmTable) -> list[int]:
    """The tickets a peer sent for a region whose slot is ``slot``: each a
    prefix of that slot number with a tag of its own, else
    ``PeerUnreachable`` (a peer that sends nonsense is no peer to count
    with). None sent, or no room for tags here: none."""
    if tickets is None or table.tag_bits == 0:
        return []
    limit = 1 << (table.bits - table.value_bits)
    if not isinstance(tickets, list) or not all(
            type(t) is int and 0 < t < limit and t >> table.tag_bits == slot >> table.tag_bits
            for t in tickets):
        raise PeerUnreachable("a peer sent notification tickets that are not of the "
                              "region's slot")
    return list(tickets)
