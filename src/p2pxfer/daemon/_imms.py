"""Immediates, as the daemon routes and counts them: scoped, hard to forge
where the fabric has room, and 32 bits wide where it carries no more.

Every immediate that lands on this node is ``slot | tag | value``: the top
``SLOT_BITS`` name a *slot* this daemon handed out; with 8-byte CQ data (tcp,
shm) the next ``TAG_BITS`` are that slot's tag, drawn at random each time
the slot is given out; the last ``VALUE_BITS`` are the sender's value (20
bits whatever the width, so a cluster's values mean the same on EFA and
verbs, which carry 4 bytes and so no tag). A slot with its tag belongs to
one export (given out with its descriptor in ``resolve``) or to one KV
request (``kv_begin``); ``ImmTable`` routes each arrival to its slot's sink
only if the tag matches, so a count never reaches anyone but the slot's
owner, and someone who holds the key of some *other* region here (its own,
say) cannot complete this one's waits by writing forged CQ data into its own
region: it would have to guess 32 random bits. A client's exports count
into its session's ``ImmCounts``, which die with the session; arrivals for
a slot nobody holds, or with a wrong tag, are dropped (counted). Slots are
handed out round-robin, so a slot just freed is not soon reused (a late
piece of an old writer must not count for a new owner).

*Notification tickets* make a notify-mode write's one notification
identifiable, so that when its outcome is unknown (its rail broke before
the ack) the writer can learn whether it landed and have it counted if it
did not, exactly once. A ticket is a one-shot prefix of a region's slot with
a tag of its own, handed to one peer (with ``resolve``, then in batches on
``imm_tickets``); the first arrival through it counts for the region and
spends it (remembered as fired). ``settle`` answers the peer: fired, or not,
and then revokes the ticket and counts the notification itself, so a late
arrival through it cannot count twice. Only where the CQ data carries tags.

Owned by the daemon's trio thread (arrivals are delivered there).
What must not live here: the engine's own counting (``p2pxfer.engine``), or
what a KV request does with its layers (``_kv``).
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable

from p2pxfer._waiters import Tally
from p2pxfer.engine import Engine
from p2pxfer.errors import InvalidArgument, LimitExceeded, UnknownRegion
from p2pxfer.log import get_logger

__all__ = ["FIRED_KEPT", "MAX_UNCLAIMED", "SLOT_BITS", "TAG_BITS", "TICKETS_PER_PEER",
           "VALUE_BITS", "ImmCounts", "ImmTable", "SlotsExhausted"]

log = get_logger("p2pxfer.daemon")

SLOT_BITS = 12
#: bits of a slot's secret tag, where the CQ data has room (8 bytes)
TAG_BITS = 32
#: bits of the sender's value (``write.imm``, a KV layer), whatever the width
VALUE_BITS = 20
#: distinct (region, value) counts a session keeps that nobody has waited for
#: yet; beyond it the oldest are dropped (and logged)
MAX_UNCLAIMED = 4096
#: notification tickets one peer may hold unspent here; asking for more gets none
TICKETS_PER_PEER = 4096
#: spent tickets remembered for ``settle`` (oldest forgotten first): far more
#: than the notifications in flight whose outcome a writer may ask about
FIRED_KEPT = 1 << 16

Sink = Callable[[int, int], None]  # (value, count)


class SlotsExhausted(LimitExceeded):
    """Every slot is in use (too many exports and KV requests at once)."""


class ImmTable:
    """Slots -> sinks, installed as the engine's immediate route."""

    def __init__(self, engine: Engine) -> None:
        self.bits = engine.imm_bits
        # With 8 bytes of CQ data a slot also carries a secret tag: see the
        # module's docstring (4 bytes leave no room for one).
        self.tag_bits = TAG_BITS if self.bits >= SLOT_BITS + TAG_BITS + VALUE_BITS else 0
        self.value_bits = self.bits - SLOT_BITS - self.tag_bits
        self._sinks: dict[int, Sink] = {}  # slot << tag_bits | tag -> sink
        self._used: set[int] = set()  # slot numbers held
        self._next = 1
        self.dropped = 0  # pieces that arrived for a slot nobody holds (or a wrong tag)
        # Notification tickets: unspent ones (-> their slot's prefix, the peer
        # holding it), those of each slot, how many each peer holds, and the
        # spent ones remembered (-> the peer).
        self._tickets: dict[int, tuple[int, str]] = {}
        self._slot_tickets: dict[int, set[int]] = {}
        self._held: Counter[str] = Counter()
        self._fired: OrderedDict[int, str] = OrderedDict()
        # Every immediate < 2**bits: ``imm >> bits == 0`` routes them all here.
        engine.route_imms(self.bits, 0, self._arrival)

    def allocate(self, sink: Sink) -> int:
        """A free slot (never 0), round-robin from the last one given out,
        with a fresh random tag: the high bits of every immediate that is to
        reach ``sink`` (what ``resolve`` and ``kv_begin`` hand out)."""
        limit = 1 << SLOT_BITS
        for _ in range(limit - 1):
            slot = self._next
            self._next = self._next % (limit - 1) + 1
            if slot not in self._used:
                self._used.add(slot)
                prefix = slot << self.tag_bits | secrets.randbits(self.tag_bits)
                self._sinks[prefix] = sink
                return prefix
        raise SlotsExhausted(f"all {limit - 1} immediate slots are in use (exports and KV "
                             "requests on this node)")

    def free(self, prefix: int) -> None:
        if self._sinks.pop(prefix, None) is not None:
            self._used.discard(prefix >> self.tag_bits)
        for ticket in self._slot_tickets.pop(prefix, ()):
            self._spend(ticket)

    # -- notification tickets --------------------------------------------------------

    def tickets(self, prefix: int, peer: str, n: int) -> list[int]:
        """Up to ``n`` fresh tickets of slot ``prefix`` for ``peer`` (none
        without tags, or while the peer holds ``TICKETS_PER_PEER``)."""
        if self.tag_bits == 0 or prefix not in self._sinks:
            return []
        n = max(0, min(n, TICKETS_PER_PEER - self._held[peer]))
        slot_bits = prefix >> self.tag_bits << self.tag_bits
        mine = self._slot_tickets.setdefault(prefix, set())
        out: list[int] = []
        while len(out) < n:
            ticket = slot_bits | secrets.randbits(self.tag_bits)
            if ticket in self._sinks or ticket in self._tickets or ticket in self._fired:
                continue
            self._tickets[ticket] = (prefix, peer)
            mine.add(ticket)
            out.append(ticket)
        self._held[peer] += len(out)
        return out

    def settle(self, ticket: int, peer: str, value: int) -> bool:
        """Whether the notification ``peer`` sent through ``ticket`` landed;
        if it has not, the ticket is revoked and the notification counted
        now (``value``, once): either way it counts exactly once."""
        self.check_value(value)
        if self._fired.get(ticket) == peer:
            del self._fired[ticket]
            return True
        held = self._tickets.get(ticket)
        if held is None or held[1] != peer:
            raise UnknownRegion(f"no notification ticket {ticket:#x} of {peer!r} here (its "
                                "region went, or it was settled already)")
        self._spend(ticket)
        self._slot_tickets[held[0]].discard(ticket)
        self._sinks[held[0]](value, 1)
        return False

    def forget_peer(self, peer: str) -> None:
        """``peer``'s life changed: its unspent tickets go with it."""
        if not self._held.get(peer):
            return
        for ticket, (prefix, holder) in list(self._tickets.items()):
            if holder == peer:
                self._spend(ticket)
                self._slot_tickets[prefix].discard(ticket)

    def _spend(self, ticket: int) -> tuple[int, str] | None:
        held = self._tickets.pop(ticket, None)
        if held is not None:
            self._held[held[1]] -= 1
            if self._held[held[1]] <= 0:
                del self._held[held[1]]
        return held

    def check_value(self, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) \
                or not 0 <= value < 1 << self.value_bits:
            raise InvalidArgument(f"immediate {value!r} does not fit: values are 0.."
                                  f"{(1 << self.value_bits) - 1} ({self.bits}-bit immediates, "
                                  f"{self.bits - self.value_bits} bits of which name the "
                                  "target)")
        return value

    def compose(self, slot: int, value: int) -> int:
        """The immediate that reaches ``slot`` (as ``allocate`` gave it, tag
        included) on its owner's node with ``value``."""
        return slot << self.value_bits | self.check_value(value)

    def deliver(self, imm: int, count: int) -> None:
        """``count`` pieces carrying ``imm`` landed without the fabric (the
        same-daemon copy, ``_local``): routed and counted exactly as if the
        engine had read them from a CQ."""
        self._arrival(imm, count)

    def _arrival(self, imm: int, count: int) -> None:
        prefix = imm >> self.value_bits
        sink = self._sinks.get(prefix)
        if sink is None and (held := self._spend(prefix)) is not None:
            # A notification through its ticket: it counts for the slot, and
            # the ticket is spent (remembered for ``settle``).
            self._slot_tickets[held[0]].discard(prefix)
            self._fired[prefix] = held[1]
            if len(self._fired) > FIRED_KEPT:
                self._fired.popitem(last=False)
            sink = self._sinks.get(held[0])
            count = 1  # one notification, one count, whatever the CQ batched
        if sink is None:
            self.dropped += count
            return
        sink(imm & ((1 << self.value_bits) - 1), count)


class ImmCounts:
    """One session's immediate counts: per (region, value), and per value
    over all of its regions (``region`` None). Each view is consumed by its
    own waits. Cancellation-safe: a withdrawn waiter leaves the counts. At
    most ``max_waiters`` waits at once (``LimitExceeded``)."""

    def __init__(self, owner: str, limit: int = MAX_UNCLAIMED,
                 max_waiters: int | None = None) -> None:
        self.owner = owner
        self.limit = limit
        self._tally = Tally[tuple[str | None, int]](max_waiters, "wait_imm calls of this client")
        self.dropped = 0

    @property
    def waiting(self) -> int:
        return self._tally.waiting

    def sink(self, region: str) -> Sink:
        """Where ``region``'s arrivals go (``ImmTable.allocate``)."""
        return lambda value, count: self.arrive(region, value, count)

    def arrive(self, region: str, value: int, count: int) -> None:
        self._tally.add((region, value), count)
        self._tally.add((None, value), count)
        if len(self._tally.counts) > self.limit:
            self._trim()

    def _trim(self) -> None:
        for key in list(self._tally.counts):
            if len(self._tally.counts) <= self.limit:
                return
            if not self._tally.awaited(key):
                self.dropped += self._tally.discard(key)
                log.warning("imm.unclaimed_dropped", client=self.owner, region=key[0],
                            imm=key[1])

    def count(self, region: str | None, value: int) -> int:
        return self._tally.count((region, value))

    async def wait(self, region: str | None, value: int, count: int) -> None:
        """Return once ``count`` pieces with ``value`` have landed in
        ``region`` (None: in any of the session's regions), consuming them."""
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise InvalidArgument(f"count must be an integer > 0, got {count!r}")
        await self._tally.wait((region, value), count)
