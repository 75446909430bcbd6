"""The core of ``Swim``: its state, the membership rules that change it, and
sending (with piggybacked gossip).

``_SwimCore`` holds every attribute of a ``Swim`` (set up in its
``__init__``) and the methods both halves of the protocol share: applying a
member record (``_apply``: the ordering and the events), suspecting, the
indexes kept in line with each member's state (``_track``), the gossip queue,
and sealing an outgoing datagram with its piggybacked updates (``_send``).
The timer side (``_swim_probe.py``) and the message side
(``_swim_receive.py``) build on it; ``Swim`` (``_swim.py``) joins them.

What must not live here: timers (``tick``), datagram handlers (``receive``),
the public views, and anything with I/O (sockets, sleeping, logging).
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

from ._member import (
    STATE_RANK,
    AuthFailed,
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
from ._swim_types import (
    _HEADER_SLACK,
    _MAX_AUTH_SOURCES,
    _RUNNING,
    ALIVE,
    DEAD,
    SUSPECT,
    Outgoing,
    SwimConfig,
    _Counters,
    _Entry,
    _newer,
    _Probe,
    _rec_size,
    _Reprieve,
)
from ._wire import TAG_SIZE, ClusterAuth, Record, encode


class _SwimCore:
    """The state of one member's view and the rules that change it (see
    ``Swim`` for the public face)."""

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
        self._reprieved: dict[str, _Reprieve] = {}  # suspects whose hosts are asked
        self._host_checks: list[tuple[str, int, str]] = []  # for the caller to make
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

    # -- views the rules need ------------------------------------------------

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

    def _snap(self, e: _Entry) -> Member:
        return e.snapshot(self.config.degrade_after)

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
        if (state is DEAD and not direct and inc == e.incarnation and e.state in _RUNNING
                and now - e.last_heard < self.suspicion_timeout()):
            # Another member's verdict on one we heard from ourselves within
            # a suspicion's length: a true death's verdict comes later than
            # that (its sender had to suspect first). It is a healed
            # partition's side declaring ours dead: a suspicion here, which
            # the member refutes if it lives; our own timer decides if not.
            if e.state is ALIVE:
                self._suspect(e, now)
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

    def _suspect(self, e: _Entry, now: float) -> None:
        self._set_state(e, SUSPECT, e.version, now)
        self._stats.suspicions += 1
        self._gossip(e)
        self._events.append(MemberSuspect(self._snap(e)))

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
            self._reprieved.pop(e.name, None)
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

    def _show_paths(self, e: _Entry) -> None:
        """Degraded (some addresses do not answer) or alive again (all do)."""
        degraded = e.state is ALIVE \
            and 0 < len(e.unreachable(self.config.degrade_after)) < len(e.missed)
        if degraded != e.shown_degraded:
            e.shown_degraded = degraded
            snap = self._snap(e)
            self._events.append(MemberDegraded(snap) if degraded else MemberAlive(snap))

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
