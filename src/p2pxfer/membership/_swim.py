"""SWIM membership as a sans-IO state machine: datagrams in, datagrams out.

No trio, no sockets, no clock: the caller passes ``now`` (seconds, any
monotonic clock) to every call, delivers what ``tick``/``receive``/``join``/
``leave`` return (``Outgoing``: an address and the sealed bytes), and calls
``tick`` again by ``next_deadline()``. Events (``MemberJoined``, ...) queue up
until ``take_events()``.

The protocol (Das, Gupta, Motivala: SWIM, 2002; with the refinements most
implementations share):

- **Probes.** Every ``period`` a member pings the next member of a shuffled
  round-robin list (bounded detection time). No ack within ``ack_timeout``:
  it asks ``indirect_probes`` other members to ping the target for it
  (``swim_ping_req``; they forward the ack). No ack by the end of the period:
  the target becomes *suspect*.
- **Suspicion.** Whoever hears a member is suspect starts a timer of
  ``suspicion_mult * max(1, log10(n)) * period``; at its end, still suspect,
  the member is *dead*. A suspect member that hears about it bumps its
  ``version`` and says it is alive (refutation). Messages to a member we see
  as suspect or dead always carry that view, so it hears quickly.
- **Dissemination.** Changes ride on pings and acks, least sent first, each
  ``retransmit_mult * ceil(ln(n + 1))`` times by every member that hears it: O(1)
  messages per member per period, O(log n) periods to reach everyone.
- **Ordering.** Reports about a member are ordered by (incarnation, version,
  state rank alive < suspect < dead < left): a higher incarnation is a new
  life, and a restarted daemon always comes back with a higher one
  (``new_incarnation``). ``is_current(name, incarnation)`` is what the
  daemon checks before it trusts a descriptor stamped with an incarnation.
- **Partitions.** A member declared dead by mistake refutes like a suspect.
  Every ``reconnect_interval`` a member pings one random dead member, telling
  it it is considered dead, so two halves of a healed partition find each
  other again.
- **Join and trust.** Every datagram carries an HMAC tag under the cluster
  token (``_wire.py``), checked before anything is parsed. Joining is a
  challenge-response both ways: the joiner sends a nonce, the seed proves the
  token on it and sends its own nonce, the joiner proves the token on that,
  and only then does the seed admit it and send the member list.

What must not live here: sockets, sleeping, logging (events say what to log).
"""

from __future__ import annotations

import hashlib
import math
import random
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from p2pxfer.errors import InvalidArgument

from ._member import (
    STATE_RANK,
    AuthFailed,
    BadDatagram,
    Member,
    MemberAlive,
    MemberDead,
    MemberDegraded,
    MemberJoined,
    MemberLeft,
    MemberRestarted,
    MembershipEvent,
    MemberState,
    MemberSuspect,
    Superseded,
)
from ._wire import TAG_SIZE, ClusterAuth, Record, SwimMessage, WireError, decode, encode

__all__ = ["Outgoing", "Swim", "SwimConfig", "SwimStatistics"]

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

    def __post_init__(self) -> None:
        if not 0 < self.ack_timeout < self.period:
            raise InvalidArgument("SwimConfig needs 0 < ack_timeout < period")
        if self.indirect_probes < 0 or self.retransmit_mult < 1 or self.leave_fanout < 1 \
                or self.degrade_after < 1:
            raise InvalidArgument("SwimConfig counts must be positive")
        if self.suspicion_mult <= 0 or self.tombstone <= 0 or self.reconnect_interval <= 0 \
                or self.join_retry <= 0 or self.sync_interval <= 0 or self.sync_quiet < 0:
            raise InvalidArgument("SwimConfig durations must be > 0")
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


class Swim:
    """One member's view of the cluster, and the protocol that keeps it.

    ``me.incarnation`` must be new for this life of the daemon (see
    ``new_incarnation``); it is what the daemon stamps on its descriptors.
    ``rng`` decides probe order and helpers (seed it in tests); nonces come
    from ``secrets`` whatever it is.
    """

    def __init__(self, me: Member, token: bytes, config: SwimConfig | None = None, *,
                 rng: random.Random | None = None) -> None:
        self.config = config or SwimConfig()
        self._auth = ClusterAuth(token)
        self._rng = rng or random.Random()
        extra = tuple(a for a in dict.fromkeys(me.addresses) if a != me.address)
        self._self = _Entry((me.name, me.address, me.incarnation, me.version, ALIVE, extra),
                            me.last_heard)
        self._nlocal = 1 + len(extra)  # our own addresses: Outgoing.via < this
        self._members: dict[str, _Entry] = {}
        self._running: set[str] = set()  # names of others that are alive or suspect
        # Forgotten tombstones: (incarnation, version, rank) per name, to refuse stale gossip.
        self._gone: dict[str, tuple[int, int, int]] = {}
        # Changes to piggyback: times each was sent so far, and the records bucketed
        # by that count, so picking the least sent is O(picked), not a sort.
        self._queue: dict[str, int] = {}
        self._buckets: list[dict[str, Record]] = [{}]
        self._events: deque[MembershipEvent] = deque()
        self._seq = 0
        self._probe: _Probe | None = None
        self._order: list[str] = []
        self._order_pos = 0
        self._suspects: dict[str, float] = {}  # name -> suspicion deadline
        # our ping seq -> (requester address, requester name, its seq, target, expiry)
        # (address and via the request came through, ...)
        self._relays: dict[int, tuple[str, int, str, int, str, float]] = {}
        self._challenges: dict[bytes, tuple[str, float]] = {}  # nonce -> (joiner, expiry)
        self._seeds: list[str] = []
        self._join_nonce: bytes | None = None
        self._joined = False
        self._leaving = False
        self._superseded = False
        self._started = False
        self._next_probe = 0.0
        self._next_join = math.inf
        self._next_reconnect = 0.0
        self._next_purge = 0.0
        self._auth_sources: dict[str, int] = {}
        self._stats = _Counters()
        # XOR of life_hash() over running members and us: equal digests, same view
        # (states aside), kept up to date in _track; _view_changed: when it last moved.
        self._digest_value = self._self.life_hash()
        self._in_digest: dict[str, int] = {}
        self._view_changed = 0.0
        self._next_sync = 0.0

    # -- views ----------------------------------------------------------------

    @property
    def me(self) -> Member:
        return self._snap(self._self)

    @property
    def joined(self) -> bool:
        """True once a seed admitted us (or at once when joining with no seeds)."""
        return self._joined

    @property
    def leaving(self) -> bool:
        return self._leaving

    def members(self, *, include_self: bool = True) -> list[Member]:
        """Every member we know, dead and left ones until their tombstones
        expire, sorted by name."""
        out = [self._snap(e) for e in self._members.values()]
        if include_self:
            out.append(self._snap(self._self))
        return sorted(out, key=lambda m: m.name)

    def member(self, name: str) -> Member | None:
        if name == self._self.name:
            return self._snap(self._self)
        e = self._members.get(name)
        return None if e is None else self._snap(e)

    def is_current(self, name: str, incarnation: int) -> bool:
        """True if ``incarnation`` is the running life of ``name``: the only
        life whose descriptors may be used. False for an earlier (or later)
        incarnation, a dead or left member, or a name we do not know."""
        e = self._self if name == self._self.name else self._members.get(name)
        return e is not None and e.incarnation == incarnation and e.state in _RUNNING

    def take_events(self) -> list[MembershipEvent]:
        """The events since the last call, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out

    def statistics(self) -> SwimStatistics:
        s = self._stats
        return SwimStatistics(s.sent, s.received, s.bytes_sent, s.bytes_received, s.probes,
                              s.indirect_probes, s.suspicions, s.refutations,
                              s.auth_failures, s.bad_datagrams, s.syncs,
                              dict(s.sent_by_kind))

    def digest(self) -> int:
        """64 bits that two members share when they agree on who is running
        (at which incarnation); carried on pings and acks."""
        return self._digest_value

    def suspicion_timeout(self) -> float:
        n = len(self._running) + 1
        return self.config.suspicion_mult * max(1.0, math.log10(n)) * self.config.period

    def retransmit_limit(self) -> int:
        """How many times each change is piggybacked: ``retransmit_mult *
        ceil(ln(n + 1))``. Every member that learns a change passes it on that
        often, so each member hears it about that often and misses it with a
        probability near ``exp(-limit)``: ln n keeps the n**2 pairs safe."""
        return self.config.retransmit_mult * math.ceil(math.log(len(self._running) + 2))

    def next_deadline(self) -> float:
        """When ``tick`` must be called next (it may be called earlier)."""
        times = [self._next_reconnect, self._next_purge, self._next_join]
        if not self._leaving:
            times.append(self._next_probe)
            p = self._probe
            if p is not None:
                times.append(p.deadline if p.indirect_sent or p.acked else p.indirect_at)
        if self._suspects:
            times.append(min(self._suspects.values()))
        return min(times)

    # -- driving --------------------------------------------------------------

    def join(self, seeds: list[str] | tuple[str, ...], now: float) -> list[Outgoing]:
        """Start joining through ``seeds`` (``host:port`` of any members). With
        no seed other than ourselves we are a cluster of one, joined at once;
        otherwise the join is resent every ``join_retry`` until a seed admits us."""
        self._start(now)
        self._seeds = [s for s in dict.fromkeys(seeds) if s not in self._self.addresses]
        if not self._seeds:
            self._joined = True
            return []
        self._join_nonce = secrets.token_bytes(16)
        self._next_join = now + self.config.join_retry
        return [self._send("swim_join", s, None, nonce=self._join_nonce) for s in self._seeds]

    def leave(self, now: float) -> list[Outgoing]:
        """Say goodbye: we become *left*, tell ``leave_fanout`` members directly
        (gossip does the rest) and stop probing. Keep delivering ``receive``
        for a period or so afterwards, so pings are answered with the news."""
        self._start(now)
        if self._leaving:
            return []
        self._leaving = True
        self._probe = None
        self._next_join = math.inf
        self._self.state = LEFT  # our record, on every message from now on, says so
        self._self.since = now
        alive = [self._members[n] for n in sorted(self._running)]
        fanout = self._rng.sample(alive, min(self.config.leave_fanout, len(alive)))
        return [self._send_to(e, "swim_leave") for e in fanout]

    def tick(self, now: float) -> list[Outgoing]:
        """Run the timers due by ``now``: probes, indirect probes, suspicion
        timeouts, join retries, reconnects, tombstone expiry."""
        self._start(now)
        self._self.last_heard = now
        out: list[Outgoing] = []
        cfg = self.config
        if not self._leaving:
            p = self._probe
            if p is not None and not p.acked and not p.indirect_sent and now >= p.indirect_at:
                p.indirect_sent = True
                out += self._indirect(p)
            if p is not None and now >= p.deadline:
                self._probe = None
                e = self._members.get(p.target)
                if e is not None and e.incarnation == p.incarnation and e.state is ALIVE:
                    if p.acked:
                        self._count_misses(e, p)
                    else:
                        self._suspect(e, now)
            if now >= self._next_probe:
                self._next_probe += cfg.period
                if self._next_probe <= now:  # we were held up: no burst of probes
                    self._next_probe = now + cfg.period
                target = self._next_target()
                if target is not None:
                    p = self._probe = _Probe(target, self._seq + 1, now, cfg)
                    self._seq += p.naddr
                    self._stats.probes += 1
                    # Every address at once: a member is alive while any of its
                    # rails answers, and which do not makes it degraded.
                    out += [self._send("swim_ping", a, target.name, seq=p.seq + i,
                                       to=target.name, via=self._via(i))
                            for i, a in enumerate(target.addresses)]
        if self._suspects:
            for name, deadline in list(self._suspects.items()):
                if deadline <= now:
                    e = self._members[name]
                    self._set_state(e, DEAD, e.version, now)
                    self._gossip(e)
                    self._events.append(MemberDead(self._snap(e)))
        if now >= self._next_join and not self._joined and self._join_nonce is not None:
            self._next_join = now + cfg.join_retry
            out += [self._send("swim_join", s, None, nonce=self._join_nonce)
                    for s in self._seeds]
        if now >= self._next_reconnect:
            self._next_reconnect = now + cfg.reconnect_interval
            dead = [e for e in self._members.values() if e.state is DEAD]
            if dead and not self._leaving:
                e = self._rng.choice(dead)
                self._seq += 1
                out.append(self._send("swim_ping", e.address, e.name, seq=self._seq,
                                      to=e.name))
        if now >= self._next_purge:
            self._next_purge = now + min(cfg.tombstone, 10 * cfg.period)
            self._purge(now)
        return out

    def receive(self, data: bytes, source: str, now: float, via: int = 0) -> list[Outgoing]:
        """Handle one datagram from ``source`` (``host:port``) that came to our
        address number ``via``. Answers go back to ``source`` from there."""
        self._start(now)
        self._stats.received += 1
        self._stats.bytes_received += len(data)
        try:
            msg = decode(self._auth.open(data))
        except WireError as exc:
            if exc.authentic:
                self._stats.bad_datagrams += 1
                self._events.append(BadDatagram(source, exc.reason))
            else:
                self._auth_failed(source, exc.reason)
            return []
        kind, sender = msg.kind, msg.sender
        if sender[0] == self._self.name and sender[2] == self._self.incarnation:
            return []  # our own datagram, echoed
        if self._leaving:
            # Only answer pings, so whoever still probes us hears we left.
            if kind == "swim_ping" and msg.to == self._self.name:
                return [self._send("swim_ack", source, sender[0], seq=msg.seq, via=via)]
            return []
        if kind == "swim_join":
            return self._on_join(msg, source, via, now)
        if kind == "swim_challenge":
            return self._on_challenge(msg, source, via)
        # Everything else: the sender speaks for itself first, then its gossip.
        self._apply(sender, now, direct=True)
        for rec in msg.updates:
            self._apply(rec, now, direct=False)
        if kind == "swim_ping":
            if msg.to != self._self.name:
                return []  # meant for whoever had this address before us
            out = [self._send("swim_ack", source, sender[0], seq=msg.seq, via=via)]
            return out + self._maybe_sync(msg, source, via, now)
        if kind == "swim_ack":
            return self._on_ack(msg, now) + self._maybe_sync(msg, source, via, now)
        if kind == "swim_ping_req":
            return self._on_ping_req(msg, source, via, now)
        if kind in ("swim_welcome", "swim_sync"):
            for rec in msg.members:
                self._apply(rec, now, direct=False)
            if kind == "swim_sync":
                return self._full_state("swim_sync", sender, source, via) if msg.reply else []
            if self._join_nonce is not None:
                self._joined = True
                self._join_nonce = None
                self._next_join = math.inf
        return []  # swim_leave: the sender's record said it all

    # -- handlers -------------------------------------------------------------

    def _on_ack(self, msg: SwimMessage, now: float) -> list[Outgoing]:
        p = self._probe
        responder = msg.on_behalf or msg.sender[0]
        if p is not None and responder == p.target and (
                p.seq <= msg.seq < p.seq + p.naddr if msg.on_behalf is None
                else msg.seq == p.seq):
            p.acked = True
            if (e := self._members.get(p.target)) is not None:
                e.last_heard = now
                if msg.on_behalf is None and e.incarnation == p.incarnation:
                    i = msg.seq - p.seq
                    p.answered.add(i)
                    if i < len(e.missed):
                        e.missed[i] = 0
                    self._show_paths(e)
            return []
        relay = self._relays.get(msg.seq) if msg.on_behalf is None else None
        if relay is not None and relay[4] == msg.sender[0]:
            del self._relays[msg.seq]
            address, via, name, seq, target, _ = relay
            return [self._send("swim_ack", address, name, seq=seq, on_behalf=target, via=via)]
        return []

    def _count_misses(self, e: _Entry, p: _Probe) -> None:
        """A probe of ``e`` ended with an ack: count its unanswered addresses."""
        for i in range(min(p.naddr, len(e.missed))):
            if i not in p.answered:
                e.missed[i] += 1
        self._show_paths(e)

    def _show_paths(self, e: _Entry) -> None:
        """Degraded (some addresses do not answer) or alive again (all do)."""
        degraded = e.state is ALIVE \
            and 0 < len(e.unreachable(self.config.degrade_after)) < len(e.missed)
        if degraded != e.shown_degraded:
            e.shown_degraded = degraded
            snap = self._snap(e)
            self._events.append(MemberDegraded(snap) if degraded else MemberAlive(snap))

    def _on_ping_req(self, msg: SwimMessage, source: str, via: int,
                     now: float) -> list[Outgoing]:
        assert msg.target is not None
        target = msg.target[0]
        if target == self._self.name:
            return [self._send("swim_ack", source, msg.sender[0], seq=msg.seq,
                               on_behalf=target, via=via)]
        known = self._members.get(target)
        addresses = known.addresses if known is not None else (msg.target[1], *msg.target[5])
        self._seq += 1
        self._relays[self._seq] = (source, via, msg.sender[0], msg.seq, target,
                                   now + self.config.period)
        # Every address, one seq: the first ack is forwarded.
        return [self._send("swim_ping", a, target, seq=self._seq, to=target, via=self._via(i))
                for i, a in enumerate(addresses)]

    def _on_join(self, msg: SwimMessage, source: str, via: int,
                 now: float) -> list[Outgoing]:
        sender = msg.sender
        if msg.challenge is None or msg.proof is None:
            # Step 1: prove we hold the token on their nonce, and challenge them.
            if len(self._challenges) >= _MAX_PENDING_CHALLENGES:
                self._expire_challenges(now)
                if len(self._challenges) >= _MAX_PENDING_CHALLENGES:
                    return []
            challenge = secrets.token_bytes(16)
            lifetime = 4 * max(self.config.join_retry, self.config.period)
            self._challenges[challenge] = (sender[0], now + lifetime)
            return [self._send("swim_challenge", source, None, nonce=msg.nonce,
                               proof=self._auth.prove(msg.nonce, self._self.name),
                               challenge=challenge, via=via)]
        # Step 2: they answered our challenge.
        pending = self._challenges.pop(msg.challenge, None)
        if pending is None or pending[0] != sender[0] or pending[1] < now:
            self._auth_failed(source, f"join from {sender[0]!r} answers no pending challenge")
            return []
        if not self._auth.check(msg.challenge, sender[0], msg.proof):
            self._auth_failed(source, f"join from {sender[0]!r} failed the challenge")
            return []
        self._apply(sender, now, direct=True)
        return self._full_state("swim_welcome", sender, source, via)

    def _on_challenge(self, msg: SwimMessage, source: str, via: int) -> list[Outgoing]:
        if self._join_nonce is None or msg.nonce != self._join_nonce:
            return []  # an answer to a join we no longer wait for
        assert msg.proof is not None and msg.challenge is not None
        if not self._auth.check(msg.nonce, msg.sender[0], msg.proof):
            self._auth_failed(source, f"seed {msg.sender[0]!r} failed the challenge")
            return []
        return [self._send("swim_join", source, None, nonce=self._join_nonce,
                           challenge=msg.challenge,
                           proof=self._auth.prove(msg.challenge, self._self.name), via=via)]

    def _maybe_sync(self, msg: SwimMessage, source: str, via: int,
                    now: float) -> list[Outgoing]:
        """Views disagree and gossip had its chance: exchange full states with
        the sender (push-pull), at most once per ``sync_interval``. This
        ends the long tail of a dissemination that died out before reaching
        everyone (mass joins, heavy loss, a healed partition)."""
        if msg.digest is None or msg.digest == self.digest() or now < self._next_sync \
                or now - self._view_changed < self.config.sync_quiet:
            return []
        self._next_sync = now + self.config.sync_interval
        self._stats.syncs += 1
        return self._full_state("swim_sync", msg.sender, source, via, reply=True)

    def _full_state(self, kind: str, to: Record, address: str, via: int,
                    **first: Any) -> list[Outgoing]:
        """Every member we know (tombstones too), to ``address`` from our
        ``via``, in as many datagrams as it takes; ``first``'s fields go on
        the first datagram only."""
        budget = self.config.max_datagram - TAG_SIZE - 1 - _HEADER_SLACK \
            - _rec_size(self._self.record())
        out: list[Outgoing] = []
        chunk: list[Record] = []
        room = budget
        for e in self._members.values():
            if e.name == to[0]:
                continue
            rec = e.record()
            size = _rec_size(rec)
            if size > room and chunk:
                out.append(self._send(kind, address, None, members=chunk, via=via, **first))
                chunk, room, first = [], budget, {}
            chunk.append(rec)
            room -= size
        out.append(self._send(kind, address, None, members=chunk, via=via, **first))
        return out

    def _indirect(self, p: _Probe) -> list[Outgoing]:
        target = self._members.get(p.target)
        if target is None:
            return []
        helpers = [n for n in sorted(self._running)
                   if n != p.target and self._members[n].state is ALIVE]
        k = min(self.config.indirect_probes, len(helpers))
        out = []
        for name in self._rng.sample(helpers, k):
            h = self._members[name]
            self._stats.indirect_probes += 1
            out.append(self._send_to(h, "swim_ping_req", seq=p.seq, target=target.record()))
        return out

    # -- the membership rules -------------------------------------------------

    def _apply(self, rec: Record, now: float, *, direct: bool) -> None:
        name, address, inc, ver, state, extra = rec
        if name == self._self.name:
            self._about_me(rec)
            return
        e = self._members.get(name)
        if e is None:
            gone = self._gone.get(name)
            if gone is not None and (inc, ver, STATE_RANK[state]) <= gone:
                return  # stale news of a life we already buried
            self._gone.pop(name, None)
            e = self._members[name] = _Entry(rec, now)
            self._track(e, now)
            self._gossip(e)
            if state in _RUNNING:
                self._events.append(MemberJoined(self._snap(e)))
                if state is SUSPECT:
                    self._events.append(MemberSuspect(self._snap(e)))
            return
        if not _newer(inc, ver, state, e):
            if direct and e.state is ALIVE:
                e.last_heard = now
            return
        old_inc, old_state = e.incarnation, e.state
        e.set_addresses(address, extra)
        if direct:
            e.last_heard = now
        if inc > old_inc:
            e.incarnation = inc
            self._set_state(e, state, ver, now)
            self._gossip(e)
            if state in _RUNNING:
                if old_state in _RUNNING:
                    self._events.append(MemberRestarted(self._snap(e), old_inc))
                else:
                    self._events.append(MemberJoined(self._snap(e)))
                if state is SUSPECT:
                    self._events.append(MemberSuspect(self._snap(e)))
            elif old_state in _RUNNING:
                self._events.append(MemberDead(self._snap(e)) if state is DEAD
                                    else MemberLeft(self._snap(e)))
            return
        self._set_state(e, state, ver, now)
        self._gossip(e)
        if state is old_state:
            return  # a newer version of the same state (a refutation already seen)
        if state is ALIVE:
            self._events.append(MemberAlive(self._snap(e)))
        elif state is SUSPECT:
            if old_state is not ALIVE:
                self._events.append(MemberAlive(self._snap(e)))
            self._stats.suspicions += 1
            self._events.append(MemberSuspect(self._snap(e)))
        elif old_state in _RUNNING:
            self._events.append(MemberDead(self._snap(e)) if state is DEAD
                                else MemberLeft(self._snap(e)))

    def _about_me(self, rec: Record) -> None:
        _, _, inc, ver, state, _ = rec
        me = self._self
        if inc < me.incarnation:
            return  # about an earlier life of ours
        if inc > me.incarnation:
            if not self._superseded:
                self._superseded = True
                self._events.append(Superseded(Member(rec[0], rec[1], inc, state, 0.0, ver)))
            return
        if state is ALIVE or self._leaving or ver < me.version:
            return
        # Suspected, declared dead, or a stale "left" from before we rejoined: refute.
        # Every message we send carries our record: that is the refutation, and
        # whoever hears it gossips it on.
        me.version = ver + 1
        self._stats.refutations += 1

    def suspect(self, name: str, now: float) -> bool:
        """Local evidence that ``name`` is gone (say, its control port refused
        us right after a write to it failed): suspect it now instead of at its
        next failed probe. The suspicion runs its normal course and is gossiped;
        a live member refutes it. True if ``name`` was alive and is now suspect."""
        e = self._members.get(name)
        if e is None or e.state is not ALIVE:
            return False
        self._suspect(e, now)
        return True

    def _suspect(self, e: _Entry, now: float) -> None:
        self._set_state(e, SUSPECT, e.version, now)
        self._stats.suspicions += 1
        self._gossip(e)
        self._events.append(MemberSuspect(self._snap(e)))

    def _snap(self, e: _Entry) -> Member:
        return e.snapshot(self.config.degrade_after)

    def _set_state(self, e: _Entry, state: MemberState, version: int, now: float) -> None:
        if state is not e.state:
            e.since = now
            e.shown_degraded = False  # shown again by the next probe if it still is
        e.state, e.version = state, version
        self._track(e, now)

    def _track(self, e: _Entry, now: float) -> None:
        """Bring the indexes in line with ``e``'s (new) state or life."""
        state = e.state
        h_old = self._in_digest.get(e.name)
        h_new = e.life_hash() if state in _RUNNING else None
        if h_old != h_new:
            if h_old is not None:
                self._digest_value ^= h_old
                del self._in_digest[e.name]
            if h_new is not None:
                self._digest_value ^= h_new
                self._in_digest[e.name] = h_new
            self._view_changed = now
        if state is SUSPECT:
            self._suspects[e.name] = now + self.suspicion_timeout()
        else:
            self._suspects.pop(e.name, None)
        if state in _RUNNING:
            if e.name not in self._running:
                self._running.add(e.name)
                self._order.insert(self._rng.randint(self._order_pos, len(self._order)),
                                   e.name)
        else:
            self._running.discard(e.name)
            if self._probe is not None and self._probe.target == e.name:
                self._probe = None

    def _gossip(self, e: _Entry) -> None:
        self._unqueue(e.name)
        self._queue[e.name] = 0
        self._buckets[0][e.name] = e.record()

    def _unqueue(self, name: str) -> None:
        count = self._queue.pop(name, None)
        if count is not None:
            del self._buckets[count][name]

    def _next_target(self) -> _Entry | None:
        for _ in range(2):
            while self._order_pos < len(self._order):
                name = self._order[self._order_pos]
                self._order_pos += 1
                if name in self._running:
                    return self._members[name]
            self._order = sorted(self._running)
            self._rng.shuffle(self._order)
            self._order_pos = 0
        return None

    # -- sending --------------------------------------------------------------

    def _via(self, i: int) -> int:
        """Our address to send from to a member's address ``i`` (rails pair up
        by their order)."""
        return i if i < self._nlocal else 0

    def _send_to(self, e: _Entry, kind: str, **fields: Any) -> Outgoing:
        """To member ``e``, on its first address that answers our probes."""
        i = e.route(self.config.degrade_after)
        return self._send(kind, e.addresses[i], e.name, via=self._via(i), **fields)

    def _send(self, kind: str, address: str, recipient: str | None, *, via: int = 0,
              **fields: Any) -> Outgoing:
        me = self._self.record()
        if kind in ("swim_ping", "swim_ack"):
            fields["d"] = self.digest()
        if kind in ("swim_ping", "swim_ack", "swim_ping_req", "swim_leave"):
            used = _rec_size(me) + (_rec_size(fields["target"]) if "target" in fields else 0)
            fields["u"] = self._piggyback(recipient, self.config.max_datagram - TAG_SIZE - 1
                                          - _HEADER_SLACK - used)
        data = self._auth.seal(encode(kind, me, **fields))
        s = self._stats
        s.sent += 1
        s.bytes_sent += len(data)
        s.sent_by_kind[kind] = s.sent_by_kind.get(kind, 0) + 1
        return Outgoing(address, data, kind, via)

    def _piggyback(self, to: str | None, budget: int) -> list[Record]:
        out: list[Record] = []
        if to is not None and (e := self._members.get(to)) is not None and e.state is not ALIVE:
            # Tell a member we think suspect or dead what we think: it refutes at once.
            rec = e.record()
            out.append(rec)
            budget -= _rec_size(rec)
        else:
            to = None  # nothing said about the recipient yet: its queued news may go too
        if not self._queue:
            return out
        taken: list[tuple[int, str, Record]] = []
        full = False
        for count, bucket in enumerate(self._buckets):
            for name, rec in bucket.items():
                if name == to:
                    continue
                size = _rec_size(rec)
                if size > budget:
                    full = True
                    break
                out.append(rec)
                budget -= size
                taken.append((count, name, rec))
            if full:
                break
        limit = self.retransmit_limit()
        buckets = self._buckets
        for count, name, rec in taken:
            del buckets[count][name]
            if count + 1 >= limit:
                del self._queue[name]
                continue
            if count + 1 == len(buckets):
                buckets.append({})
            buckets[count + 1][name] = rec
            self._queue[name] = count + 1
        return out

    # -- housekeeping ---------------------------------------------------------

    def _start(self, now: float) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.config
        # Spread first probes over a period so members do not probe in lockstep.
        self._next_probe = now + self._rng.random() * cfg.period
        self._next_reconnect = now + cfg.reconnect_interval * (0.5 + self._rng.random())
        self._next_purge = now + min(cfg.tombstone, 10 * cfg.period)

    def _purge(self, now: float) -> None:
        horizon = now - self.config.tombstone
        for name in [n for n, e in self._members.items()
                     if e.state not in _RUNNING and e.since <= horizon]:
            e = self._members.pop(name)
            self._gone[name] = (e.incarnation, e.version, STATE_RANK[e.state])
            self._unqueue(name)
        for seq in [s for s, r in self._relays.items() if r[5] <= now]:
            del self._relays[seq]
        self._expire_challenges(now)

    def _expire_challenges(self, now: float) -> None:
        for nonce in [n for n, c in self._challenges.items() if c[1] <= now]:
            del self._challenges[nonce]

    def _auth_failed(self, source: str, reason: str) -> None:
        self._stats.auth_failures += 1
        if len(self._auth_sources) >= _MAX_AUTH_SOURCES and source not in self._auth_sources:
            self._auth_sources.clear()
        count = self._auth_sources[source] = self._auth_sources.get(source, 0) + 1
        if count & (count - 1) == 0:  # 1, 2, 4, 8, ...
            self._events.append(AuthFailed(source, reason, count))
