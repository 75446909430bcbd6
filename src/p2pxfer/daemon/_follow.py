"""Membership, as the daemon follows it (``membership = "embedded" | "etcd"``).

``Follower`` starts the backend, reacts to its events (a member up: a peer;
dead, left or restarted: its descriptors, link and writes in flight are
void), keeps the numbered log of changes that clients ``watch``, and answers
the write path's questions (``check_peer``, ``check_descriptor``,
``track_write``). What must not live here: the membership protocol
(``p2pxfer.membership``) or the region directory (``_regions``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import trio

from p2pxfer.errors import InvalidArgument
from p2pxfer.fabric import parse_sockaddr
from p2pxfer.log import get_logger
from p2pxfer.membership import (
    EmbeddedBackend,
    EtcdBackend,
    MemberAlive,
    MemberDead,
    MemberDegraded,
    MemberJoined,
    MemberLeft,
    MemberRestarted,
    MembershipBackend,
    MembershipEvent,
    MemberSuspect,
    PeerLost,
    Superseded,
    SwimConfig,
)
from p2pxfer.memory import RegionDescriptor

from ._config import DaemonConfig
from ._peers import PeerTable

__all__ = ["EVENT_LOG", "WATCH_TIMEOUT_MAX_S", "Follower", "WatchLog"]

log = get_logger("p2pxfer.daemon")

EVENT_LOG = 1024  # membership changes kept for watching clients
WATCH_TIMEOUT_MAX_S = 300.0
#: The host check (SWIM's, and etcd's for a lapsed lease): how long a
#: suspect's host has to accept a connection on its control port before the
#: verdict, and how long in all a member whose host keeps accepting (its
#: daemon not scheduled: a busy host) stays suspect rather than dead
HOST_CHECK_S = 0.8
STARVED_GRACE_S = 10.0

_CHANGES = (MemberJoined, MemberAlive, MemberDegraded, MemberSuspect, MemberDead, MemberLeft,
            MemberRestarted)


def rail_hosts(straddrs: Sequence[str]) -> list[str]:
    """The IP hosts of the rails whose endpoint addresses (``fi_av_straddr``)
    are ``straddrs``, in order, without repeats. Non-IP rails give none, nor
    do loopback, link-local and unspecified addresses: another member
    probing those would reach itself (or nothing)."""
    out: list[str] = []
    for text in straddrs:
        endpoint = parse_sockaddr(text)
        if endpoint is None:
            continue
        ip = endpoint[0]
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified) and str(ip) not in out:
            out.append(str(ip))
    return out


class WatchLog:
    """Membership changes, numbered; the newest EVENT_LOG kept. A watcher
    further behind starts over (``reset``)."""

    def __init__(self) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENT_LOG)
        self._seq = 0
        self._wake = trio.Event()

    def record(self, ev: MemberJoined | MemberAlive | MemberDegraded | MemberSuspect
               | MemberDead | MemberLeft | MemberRestarted) -> None:
        m = ev.member
        self._seq += 1
        entry: dict[str, Any] = {"seq": self._seq, "event": ev.kind, "name": m.name,
                                 "address": m.address, "state": m.shown_state,
                                 "incarnation": m.incarnation}
        if isinstance(ev, MemberRestarted):
            entry["previous_incarnation"] = ev.previous_incarnation
        self._events.append(entry)
        self._notify()

    def start_over(self) -> None:
        """Changes were missed: every watcher starts over."""
        self._events.clear()
        self._seq += 1
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    async def watch(self, after: int, timeout_s: float,
                    members: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
        """Changes numbered above ``after``, waiting up to ``timeout_s`` for
        one. ``after`` < 0, or older than what is kept: ``reset`` with every
        member as it is now, to start over from."""
        if not self._missed(after):
            with trio.move_on_after(timeout_s):
                while self._seq <= after:
                    await self._wake.wait()
        if self._missed(after):  # also: the log was cleared while we waited
            return {"reset": True, "members": members(), "events": [], "next": self._seq}
        return {"events": [e for e in self._events if e["seq"] > after], "next": self._seq}

    def _missed(self, after: int) -> bool:
        oldest = self._events[0]["seq"] if self._events else self._seq + 1
        return after < 0 or after > self._seq or (after < self._seq and after + 1 < oldest)


class Follower:
    """The daemon's side of membership; ``backend`` is None with membership off."""

    def __init__(self, node: str, peers: PeerTable) -> None:
        self.node = node
        self.peers = peers
        self.backend: MembershipBackend | None = None
        self.log = WatchLog()
        # Writes in flight per peer (their cancel scopes), failed with
        # ``peer_lost`` when membership says the peer died, left or restarted.
        self._writes_to: dict[str, set[trio.CancelScope]] = {}
        self._lost_reason: dict[str, str] = {}
        #: called when a newer life of this node appeared: the daemon stops
        self.on_superseded: Callable[[], None] = lambda: None
        #: called with (name, reason) when a peer's life ended (KV requests it
        #: was sending fail with ``PeerLost``)
        self.on_peer_lost: Callable[[str, str], None] = lambda name, reason: None

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def running(self, peer: str) -> bool:
        """Whether ``peer`` may be asked (not known to be dead or gone)."""
        m = self.backend.member(peer) if self.backend is not None else None
        return m is None or m.running

    async def start(self, config: DaemonConfig, control_address: str, incarnation: int,
                    nursery: trio.Nursery, rails: Sequence[str] = ()) -> None:
        """Join the cluster, bound to the control address; then follow it in a
        task of ``nursery``. ``rails``: the IP hosts of the engine's rails;
        the embedded backend also listens (same port) and is probed on each
        of them, so a member is alive while any of its rails answers. etcd
        keeps its lease over whatever route reaches etcd."""
        token = config.cluster_token.encode()
        backend: MembershipBackend
        if config.membership == "embedded":
            seeds = [s for s in config.seeds if s != control_address]
            # The control port shares the membership address: a member whose
            # suspicion ran out is asked there whether its process is merely
            # starved (a busy host), not dead.
            backend = EmbeddedBackend(self.node, control_address, token, seeds,
                                      incarnation=incarnation, join_timeout=2.0,
                                      rails=rails, config=SwimConfig(
                                          host_check=HOST_CHECK_S,
                                          starved_grace=STARVED_GRACE_S))
        else:
            # A lapsed lease is the same question: a starved daemon's lease
            # lapses too; its host is asked before the verdict.
            backend = EtcdBackend(self.node, control_address, token, config.etcd_endpoint,
                                  incarnation=incarnation, ttl=config.etcd_ttl,
                                  host_check=HOST_CHECK_S, starved_grace=STARVED_GRACE_S)
        events = backend.events()
        await backend.start(nursery)
        self.backend = backend
        for m in backend.members():
            if m.running:
                self.peers.up(m.name, m.address)
        nursery.start_soon(self._follow, backend, events)

    async def stop(self) -> None:
        """Leave gracefully (the others see ``left`` at once)."""
        if self.backend is not None:
            await self.backend.stop()

    async def _follow(self, backend: MembershipBackend,
                      events: trio.MemoryReceiveChannel[MembershipEvent]) -> None:
        while True:
            async with events:
                async for ev in events:
                    self.on_event(ev)
            if backend.finished:
                return
            # Cut off (fell too far behind): subscribe again, catch up from the
            # view. Watching clients missed changes too: make them start over.
            events = backend.events()
            self.log.start_over()
            for m in backend.members():
                if m.name == self.node:
                    continue
                if m.running:
                    self.peers.up(m.name, m.address)
                else:
                    self.peer_lost(m.name, f"{m.name} is {m.state}")

    def on_event(self, ev: MembershipEvent) -> None:
        if isinstance(ev, Superseded):
            log.error("daemon.superseded", newer_incarnation=ev.member.incarnation)
            self.on_superseded()
            return
        if not isinstance(ev, _CHANGES) or ev.member.name == self.node:
            return
        self.log.record(ev)
        m = ev.member
        if isinstance(ev, MemberDegraded):
            # Still alive and current: its writes go on (on the rails that
            # answer), and so do our requests to it (ticket refills, settling
            # a notification whose rail failed) on an address that answers.
            answering = [a for a in m.every_address if a not in m.unreachable]
            if answering:
                self.peers.reroute(m.name, answering[0])
            return
        if isinstance(ev, MemberJoined | MemberAlive):
            self.peers.up(m.name, m.address, m.every_address)
        elif isinstance(ev, MemberDead | MemberLeft):
            what = "died" if isinstance(ev, MemberDead) else "left"
            self.peer_lost(m.name, f"{m.name} {what} (incarnation {m.incarnation})")
        elif isinstance(ev, MemberRestarted):
            self.peer_lost(m.name, f"{m.name} restarted (incarnation "
                                   f"{ev.previous_incarnation} -> {m.incarnation})")
            self.peers.up(m.name, m.address)

    def peer_lost(self, name: str, reason: str) -> None:
        """``name``'s life ended: forget its descriptors and connection, and
        fail its writes in flight with ``peer_lost``."""
        self.peers.drop(name)
        self.on_peer_lost(name, reason)
        scopes = self._writes_to.get(name, set())
        if scopes:
            self._lost_reason[name] = reason
            log.warning("transfer.peer_lost", peer=name, writes=len(scopes), reason=reason)
        for scope in scopes:
            scope.cancel()

    async def watch(self, after: int, timeout_s: float,
                    members: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
        if self.backend is None:
            raise InvalidArgument(f"membership is off on {self.node}: there are no "
                                  "membership events to watch (static peers)")
        return await self.log.watch(after, timeout_s, members)

    def check_peer(self, peer: str) -> None:
        """With membership: refuse at once a peer known to be dead or gone."""
        if self.backend is None or peer == self.node:
            return
        m = self.backend.member(peer)
        if m is not None and not m.running:
            raise PeerLost(f"{peer} is {m.state} (incarnation {m.incarnation})")

    def check_descriptor(self, desc: RegionDescriptor) -> None:
        """With membership: refuse a descriptor of a life that is not running."""
        if self.backend is not None and desc.node and desc.node != self.node:
            self.backend.check_current(desc.node, desc.incarnation)

    @contextlib.contextmanager
    def track_write(self, peer: str) -> Iterator[None]:
        """A cancel scope for one write to ``peer``; ``peer_lost`` cancels it,
        and then this raises ``PeerLost`` with the reason."""
        scope = trio.CancelScope()
        scopes = self._writes_to.setdefault(peer, set())
        scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            scopes.discard(scope)
            if not scopes:
                self._writes_to.pop(peer, None)
        if scope.cancelled_caught:
            raise PeerLost(f"write to {peer} failed: "
                           f"{self._lost_reason.get(peer, 'peer lost')}")
