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
  Another member's "dead" about one we heard from ourselves within a
  suspicion's length is only a suspicion here (a healed partition's side
  declared ours dead; a true death's verdict comes later than that).
  Every ``reconnect_interval`` a member pings one random dead member, telling
  it it is considered dead, so two halves of a healed partition find each
  other again.
- **Starved, not dead** (``host_check``, ``starved_grace``; off by default,
  on in the daemon). A member whose process is not scheduled for a while
  (a busy host) answers nothing, so its suspicion runs out like a dead
  one's. Before the verdict the caller connects to its address (the
  daemon's control port shares it): a kernel that still accepts for the
  port means the process is there, and the member stays suspect, checked
  again (``host_check``, then twice, four times... that apart), for up to
  ``starved_grace``; a refusal (the
  process is gone) makes it dead at once, no answer (a silent host) at the
  end of the check.
- **Join and trust.** Every datagram carries an HMAC tag under the cluster
  token (``_wire.py``), checked before anything is parsed. Joining is a
  challenge-response both ways: the joiner sends a nonce, the seed proves the
  token on it and sends its own nonce, the joiner proves the token on that,
  and only then does the seed admit it and send the member list.

The state machine is split by concern: ``_swim_types.py`` (configuration,
records, pure helpers), ``_swim_core.py`` (state, membership rules, sending),
``_swim_probe.py`` (``tick``: probes and timers), ``_swim_receive.py``
(``receive``: the datagram handlers). ``Swim`` here joins them and adds the
public views and ``join``/``leave``/``suspect``.

What must not live here: sockets, sleeping, logging (events say what to log).
"""

from __future__ import annotations

import math
import secrets

from ._member import Member, MembershipEvent
from ._swim_probe import _SwimProbing
from ._swim_receive import _SwimReceiving
from ._swim_types import _RUNNING, ALIVE, LEFT, Outgoing, SwimConfig, SwimStatistics

__all__ = ["Outgoing", "Swim", "SwimConfig", "SwimStatistics"]


class Swim(_SwimProbing, _SwimReceiving):
    """One member's view of the cluster, and the protocol that keeps it.

    ``me.incarnation`` must be new for this life of the daemon (see
    ``new_incarnation``); it is what the daemon stamps on its descriptors.
    ``rng`` decides probe order and helpers (seed it in tests); nonces come
    from ``secrets`` whatever it is.
    """

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

    def take_host_checks(self) -> list[tuple[str, int, str]]:
        """``(name, incarnation, address)`` of each suspect whose suspicion
        ran out (``SwimConfig.host_check``): the caller tries a TCP
        connection to ``address`` within ``host_check`` and reports
        ``host_answered`` or ``host_refused`` (no answer: report nothing)."""
        out = list(self._host_checks)
        self._host_checks.clear()
        return out

    def host_answered(self, name: str, incarnation: int) -> None:
        """``name``'s host accepted a connection on its port: its process is
        there, if not scheduled. It stays suspect (``starved_grace``)."""
        r = self._reprieved.get(name)
        if r is not None and r.of[0] == incarnation:
            r.answered = True

    def host_refused(self, name: str, incarnation: int, now: float) -> None:
        """``name``'s host refused the connection: no process listens there
        any more. It is dead at the next ``tick``."""
        r = self._reprieved.get(name)
        if r is not None and r.of[0] == incarnation and name in self._suspects:
            r.answered = False  # whatever an earlier check said
            self._suspects[name] = now

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
