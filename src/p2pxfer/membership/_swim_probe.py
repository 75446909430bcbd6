"""The timer side of ``Swim``: probing and everything else ``tick`` runs.

``_SwimProbing`` picks the next member to probe (a shuffled round robin),
pings every address of it, asks others to probe it indirectly after
``ack_timeout``, and at the end of the period counts unanswered addresses
(degraded) or suspects the member. ``tick`` also runs suspicion timeouts,
join retries, reconnect pings to dead members and tombstone expiry;
``next_deadline`` says when it is due again.

What must not live here: handling received datagrams (``_swim_receive.py``),
the membership rules and sending (``_swim_core.py``), and any clock of its
own: time is only the ``now`` the caller passes.
"""

from __future__ import annotations

from ._member import STATE_RANK, MemberDead
from ._swim_core import _SwimCore
from ._swim_types import _RUNNING, ALIVE, DEAD, Outgoing, _Entry, _Probe, _Reprieve


class _SwimProbing(_SwimCore):
    """``tick`` and ``next_deadline``: the probe and the other timers."""

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
                    if self._reprieve(e, now):
                        continue
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

    def _reprieve(self, e: _Entry, now: float) -> bool:
        """``e``'s suspicion ran out: ask its host first (``host_check``).
        True while it stays suspect: its first expiry, then as long as the
        host answered within each check and ``starved_grace`` lasts. The
        checks come further apart each time (a starved host's accept queue
        holds every one until its process runs). A suspicion of another
        life or version of ``e`` starts afresh."""
        cfg = self.config
        if cfg.host_check <= 0:
            return False
        r = self._reprieved.get(e.name)
        if r is not None and r.of != (e.incarnation, e.version):
            r = None
        if r is None:
            r = self._reprieved[e.name] = _Reprieve(now, (e.incarnation, e.version))
        elif not r.answered or now - r.since >= cfg.starved_grace:
            del self._reprieved[e.name]
            return False
        r.answered = False
        wait = cfg.host_check * (1 << min(r.checks, 4))
        r.checks += 1
        left = r.since + cfg.starved_grace - now
        self._suspects[e.name] = now + max(cfg.host_check, min(wait, left))
        self._host_checks.append((e.name, e.incarnation, e.address))
        return True

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

    def _count_misses(self, e: _Entry, p: _Probe) -> None:
        """A probe of ``e`` ended with an ack: count its unanswered addresses."""
        for i in range(min(p.naddr, len(e.missed))):
            if i not in p.answered:
                e.missed[i] += 1
        self._show_paths(e)

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
