"""The SWIM state machine's plain parts: its configuration, what it hands
out (``Outgoing``, ``SwimStatistics``), its per-member and per-probe records
(``_Entry``, ``_Probe``), and pure helpers over them (``_newer``, ``_rec_size``).

Everything here is data, or a function of its arguments only.

What must not live here: protocol decisions or anything that reads a
``Swim``'s state (``_swim_core.py`` and the modules beside it), sockets,
clocks, logging.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from p2pxfer.errors import InvalidArgument

from ._member import STATE_RANK, Member, MemberState
from ._wire import Record

ALIVE, SUSPECT, DEAD, LEFT = (MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD,
                              MemberState.LEFT)
_RUNNING = (ALIVE, SUSPECT)
_MAX_PENDING_CHALLENGES = 1024
_MAX_AUTH_SOURCES = 4096
_HEADER_SLACK = 64  # msgpack map overhead, kind, seq, "to"... besides the sender record


@dataclass(frozen=True, slots=True)
class SwimConfig:
    """Timings in seconds (of whatever clock the caller passes as ``now``)."""

    #: one probe per member per period (8 members: a death is known everywhere
    #: in about 6 periods; see bench/membership.py)
    period: float = 0.4
    #: wait this long for a direct ack before asking others to probe
    ack_timeout: float = 0.15
    #: how many members are asked to probe indirectly (SWIM's k)
    indirect_probes: int = 3
    #: suspicion lasts suspicion_mult * max(1, log10(n)) periods
    suspicion_mult: float = 3.0
    #: each change is piggybacked retransmit_mult * ceil(ln(n + 1)) times (SWIM's lambda)
    retransmit_mult: int = 3
    #: largest datagram sent (piggybacked updates fill up to this)
    max_datagram: int = 1400
    #: dead and left members are remembered (and refused if reported alive) this long
    tombstone: float = 60.0
    #: ping one random dead member this often (heals partitions)
    reconnect_interval: float = 5.0
    #: resend the join to the seeds this often until one answers
    join_retry: float = 1.0
    #: a leaving member says goodbye directly to this many members
    leave_fanout: int = 4
    #: start a full-state exchange at most this often (when views disagree)
    sync_interval: float = 5.0
    #: ... and only once our own view has been still this long (gossip had its chance)
    sync_quiet: float = 1.0
    #: an address (rail) of an alive member that missed this many of our probes
    #: in a row, while another answered, makes the member *degraded*
    degrade_after: int = 2
    #: a suspect whose suspicion ran out is first asked about at its host
    #: (``take_host_checks``: the caller connects to its address's port),
    #: which has this long to answer; 0: no such check, it is dead at once
    host_check: float = 0.0
    #: ... a host that answers for the port (the member's process is there,
    #: if starved: not scheduled, its datagrams unread) keeps it suspect,
    #: checked again further apart each time, for up to this long in all; a
    #: refusal, or no answer in time, makes it dead
    starved_grace: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.ack_timeout < self.period:
            raise InvalidArgument("SwimConfig needs 0 < ack_timeout < period")
        if self.indirect_probes < 0 or self.retransmit_mult < 1 or self.leave_fanout < 1 \
                or self.degrade_after < 1:
            raise InvalidArgument("SwimConfig counts must be positive")
        if self.suspicion_mult <= 0 or self.tombstone <= 0 or self.reconnect_interval <= 0 \
                or self.join_retry <= 0 or self.sync_interval <= 0 or self.sync_quiet < 0:
            raise InvalidArgument("SwimConfig durations must be > 0")
        if self.host_check < 0 or self.starved_grace < 0 or (
                self.starved_grace > 0 and self.host_check <= 0):
            raise InvalidArgument("SwimConfig needs host_check >= 0 and starved_grace >= 0 "
                                  "(a grace needs host checks)")
        if self.max_datagram < 512:
            raise InvalidArgument("SwimConfig.max_datagram must be >= 512")


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One datagram to send: ``data`` to ``address`` (``host:port``), from our
    address number ``via`` (0: the primary; pings to a member's address ``i``
    go from our ``i``-th, so each rail's probe travels on that rail, and an
    answer goes back from the address its question came to)."""

    address: str
    data: bytes
    kind: str
    via: int = 0


@dataclass(frozen=True, slots=True)
class SwimStatistics:
    sent: int
    received: int
    bytes_sent: int
    bytes_received: int
    probes: int
    indirect_probes: int
    suspicions: int
    refutations: int
    auth_failures: int
    bad_datagrams: int
    syncs: int
    sent_by_kind: dict[str, int]


@dataclass(slots=True)
class _Counters:
    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    probes: int = 0
    indirect_probes: int = 0
    suspicions: int = 0
    refutations: int = 0
    auth_failures: int = 0
    bad_datagrams: int = 0
    syncs: int = 0
    sent_by_kind: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Reprieve:
    """A suspect kept from its verdict while its host answers
    (``SwimConfig.host_check``): since when, for which life and version,
    whether the last check was answered, how many were made."""

    since: float
    of: tuple[int, int]
    answered: bool = False
    checks: int = 0


class _Entry:
    """Our mutable record of one member (snapshots are ``Member``). ``missed``:
    per address, how many of our probes in a row it left unanswered."""

    __slots__ = ("_hash", "address", "extra", "incarnation", "last_heard", "missed", "name",
                 "shown_degraded", "since", "state", "version")

    def __init__(self, rec: Record, now: float) -> None:
        self.name, self.address, self.incarnation, self.version, self.state, self.extra = rec
        self.missed = [0] * (1 + len(self.extra))
        self.shown_degraded = False  # a MemberDegraded is the last word on its paths
        self.last_heard = now
        self.since = now  # when the state (or life) last changed
        self._hash = (-1, 0)

    def life_hash(self) -> int:
        """64 bits of (name, incarnation), the same in every process."""
        if self._hash[0] != self.incarnation:
            h = hashlib.blake2b(f"{self.name}\0{self.incarnation}".encode(), digest_size=8)
            self._hash = (self.incarnation, int.from_bytes(h.digest(), "little"))
        return self._hash[1]

    @property
    def addresses(self) -> tuple[str, ...]:
        return (self.address, *self.extra)

    def set_addresses(self, address: str, extra: tuple[str, ...]) -> None:
        if (address, extra) != (self.address, self.extra):
            self.address, self.extra = address, extra
            self.missed = [0] * (1 + len(extra))

    def unreachable(self, limit: int) -> tuple[str, ...]:
        return tuple(a for a, m in zip(self.addresses, self.missed, strict=True) if m >= limit)

    def route(self, limit: int) -> int:
        """The index of the first address that answers (0 if none does)."""
        return next((i for i, m in enumerate(self.missed) if m < limit), 0)

    def record(self) -> Record:
        return (self.name, self.address, self.incarnation, self.version, self.state,
                self.extra)

    def snapshot(self, limit: int) -> Member:
        return Member(self.name, self.address, self.incarnation, self.state, self.last_heard,
                      self.version, self.addresses if self.extra else (),
                      self.unreachable(limit))


class _Probe:
    """One probe of ``target``: a ping to each of its addresses, address ``i``
    with sequence number ``seq + i``; ``answered``: the addresses that acked."""

    __slots__ = ("acked", "answered", "deadline", "incarnation", "indirect_at",
                 "indirect_sent", "naddr", "seq", "target")

    def __init__(self, target: _Entry, seq: int, now: float, config: SwimConfig) -> None:
        self.target = target.name
        self.incarnation = target.incarnation
        self.seq = seq
        self.naddr = len(target.missed)
        self.answered: set[int] = set()
        self.indirect_at = now + config.ack_timeout
        self.deadline = now + config.period
        self.acked = False
        self.indirect_sent = False


def _newer(inc: int, ver: int, state: MemberState, e: _Entry) -> bool:
    if inc != e.incarnation:
        return inc > e.incarnation
    if ver != e.version:
        return ver > e.version
    return STATE_RANK[state] > STATE_RANK[e.state]


def _rec_size(rec: Record) -> int:
    """Bytes a record may take on the wire: 5 array elements, two strings
    (with their headers) and three small ints, rounded up."""
    return len(rec[0]) + len(rec[1]) + 24 + sum(len(a) + 3 for a in rec[5]) + 2 * bool(rec[5])
