"""Who a member is, and the events a membership view emits.

Shared by every backend (embedded SWIM, etcd), so the daemon reacts to one
vocabulary. What must not live here: any protocol rule or I/O.

Two numbers order what is known about a member:

- ``incarnation`` is the *life* of a daemon: chosen once when it starts
  (``new_incarnation()``, time-based, so a restart always gets a higher one)
  and stamped on every region descriptor it exports. A higher incarnation of
  a name is a new member; everything stamped with a lower one is void.
- ``version`` counts refutations within one life (SWIM's incarnation number):
  a member that hears it is suspected (or falsely declared dead) bumps it and
  says it is alive. It never changes what ``is_current`` answers for a life.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "AuthFailed",
    "BadDatagram",
    "Member",
    "MemberAlive",
    "MemberDead",
    "MemberDegraded",
    "MemberJoined",
    "MemberLeft",
    "MemberRestarted",
    "MemberState",
    "MemberSuspect",
    "MembershipEvent",
    "Superseded",
    "new_incarnation",
]


def new_incarnation() -> int:
    """A fresh incarnation for a daemon that is starting: nanoseconds since the
    epoch, so a restarted daemon's is higher than any of its earlier lives'
    (as long as the clock does not go back by the time a restart takes)."""
    return time.time_ns()


class MemberState(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


#: Which state wins between two reports of the same (incarnation, version).
STATE_RANK = {MemberState.ALIVE: 0, MemberState.SUSPECT: 1, MemberState.DEAD: 2,
              MemberState.LEFT: 3}


@dataclass(frozen=True, slots=True)
class Member:
    """One member as this node sees it. ``last_heard`` is in the clock of the
    view that made the snapshot (``trio.current_time()`` in the backends): the
    last time the member itself was heard from (a datagram or an ack relayed
    for it; with etcd, its last put), or when it was first heard of by
    gossip. For this node itself: the last timer run (keepalive with etcd).

    ``addresses``: every address the member answers on, one per rail,
    ``address`` first (empty: ``address`` only). ``unreachable``: those of
    them that missed our last probes (embedded backend; a view of the paths
    from this node, not gossiped)."""

    name: str
    address: str
    incarnation: int
    state: MemberState = MemberState.ALIVE
    last_heard: float = 0.0
    version: int = 0
    addresses: tuple[str, ...] = ()
    unreachable: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        """Alive or suspect: its life is not over as far as we know."""
        return self.state in (MemberState.ALIVE, MemberState.SUSPECT)

    @property
    def every_address(self) -> tuple[str, ...]:
        """``addresses``, or just ``address`` if it has no others."""
        return self.addresses or (self.address,)

    @property
    def degraded(self) -> bool:
        """Alive, but some of its addresses (rails) do not answer us while
        others do. (None answering us directly while others' indirect
        probes reach it is not a rail's fault: that member is just alive.)"""
        return self.state is MemberState.ALIVE \
            and 0 < len(self.unreachable) < len(self.every_address)

    @property
    def shown_state(self) -> str:
        """The state as ``peers``, ``status`` and ``watch`` show it: the
        member's state, or ``"degraded"`` for an alive member some of whose
        addresses do not answer."""
        return "degraded" if self.degraded else str(self.state)


@dataclass(frozen=True, slots=True)
class MemberJoined:
    """A life we did not know is running (a new name, or a new incarnation of
    a name whose previous life we already saw end). Nothing to invalidate."""

    kind: ClassVar[str] = "joined"  # its name in logs and on the wire

    member: Member


@dataclass(frozen=True, slots=True)
class MemberAlive:
    """A suspect (or falsely declared dead) member proved it is alive, same
    incarnation: its descriptors are valid again. Also: a degraded member
    answers on every address again."""

    kind: ClassVar[str] = "alive"  # its name in logs and on the wire

    member: Member


@dataclass(frozen=True, slots=True)
class MemberDegraded:
    """An alive member stopped answering on some of its addresses (rails)
    while others still answer: still alive and current (never declared dead
    while any address answers). It is ``MemberAlive`` again once every
    address answers."""

    kind: ClassVar[str] = "degraded"  # its name in logs and on the wire

    member: Member


@dataclass(frozen=True, slots=True)
class MemberSuspect:
    """A member missed its probes; it is still current until declared dead."""

    kind: ClassVar[str] = "suspect"  # its name in logs and on the wire

    member: Member


@dataclass(frozen=True, slots=True)
class MemberDead:
    """A member's life ended without a goodbye (failed probes and suspicion
    timeout, or its lease expired): fail its transfers with ``PeerLost`` and
    drop its regions. Covers every incarnation up to ``member.incarnation``."""

    kind: ClassVar[str] = "dead"  # its name in logs and on the wire

    member: Member


@dataclass(frozen=True, slots=True)
class MemberLeft:
    """A member said goodbye: drop its regions; nothing more will come from it."""

    kind: ClassVar[str] = "left"  # its name in logs and on the wire

    member: Member


@dataclass(frozen=True, slots=True)
class MemberRestarted:
    """A new life of a name replaced one we still thought running: everything
    stamped with ``previous_incarnation`` is void (fail its transfers with
    ``PeerLost``, drop its descriptors); ``member`` is the new life."""

    kind: ClassVar[str] = "restarted"  # its name in logs and on the wire

    member: Member
    previous_incarnation: int


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """Something that does not hold the cluster token tried to talk to us (a
    bad MAC, or a failed join challenge). ``count`` is how many failures came
    from ``source`` so far; the event repeats at 1, 2, 4, 8, ... failures so a
    flood cannot flood the log."""

    source: str
    reason: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class BadDatagram:
    """An authenticated datagram that did not follow the protocol (version
    skew or a bug in a member): dropped."""

    source: str
    reason: str


@dataclass(frozen=True, slots=True)
class Superseded:
    """Another process claims this node's name with a newer incarnation: this
    process is the stale one and should stop."""

    member: Member


MembershipEvent = (MemberJoined | MemberAlive | MemberDegraded | MemberSuspect | MemberDead
                   | MemberLeft | MemberRestarted | AuthFailed | BadDatagram | Superseded)
