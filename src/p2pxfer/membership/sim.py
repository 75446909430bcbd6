"""A whole SWIM cluster in one process: fake network, fake time.

For tests and ``bench/membership.py``: drives many ``Swim`` state machines
through a discrete-event simulation: datagrams arrive after a random delay,
may be dropped, and cross a partition only when it is healed; every member's
``tick`` runs exactly at its ``next_deadline()``. No sockets, no sleeping.

What must not live here: anything the daemon runs.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._member import Member, MembershipEvent, MemberState
from ._swim import Outgoing, Swim, SwimConfig

__all__ = ["FakeNetwork", "SimCluster"]

_DELIVER, _TICK, _CHECKED = 0, 1, 2


@dataclass
class FakeNetwork:
    """Datagram delivery: ``delay`` seconds (uniform in the range), ``drop``
    probability, and partition groups (addresses in different groups do not
    hear each other; addresses in no group hear everyone not partitioned)."""

    rng: random.Random
    delay: tuple[float, float] = (0.001, 0.01)
    drop: float = 0.0

    def __post_init__(self) -> None:
        self.groups: dict[str, int] = {}
        self.delivered = 0
        self.dropped = 0

    def passes(self, src: str, dst: str) -> bool:
        if self.drop and self.rng.random() < self.drop:
            return False
        return self.groups.get(src, -1) == self.groups.get(dst, -1)

    def latency(self) -> float:
        return self.rng.uniform(*self.delay)


class SimCluster:
    """Members named ``m000``, ``m001``... at fake addresses ``10.0.x.y:7946``;
    the first one started is everybody's seed unless told otherwise."""

    def __init__(self, config: SwimConfig | None = None, *, seed: int = 1,
                 token: bytes = b"cluster-token", drop: float = 0.0,
                 delay: tuple[float, float] = (0.001, 0.01)) -> None:
        self.config = config or SwimConfig(period=1.0, ack_timeout=0.4)
        self.rng = random.Random(seed)
        self.token = token
        self.net = FakeNetwork(random.Random(seed + 1), delay, drop)
        self.now = 0.0
        self.nodes: dict[str, Swim] = {}  # running members by name
        self.by_address: dict[str, Swim] = {}
        self.events: dict[str, list[MembershipEvent]] = {}
        # (time, tie-break, _DELIVER, (dst, data, src)), (time, tie-break, _TICK, name)
        # or (time, tie-break, _CHECKED, (checker, name, incarnation, verdict))
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._scheduled: dict[str, float] = {}
        self._incarnation = 1000
        # Starved members: what reached them meanwhile, delivered on resume.
        self.paused: dict[str, list[tuple[str, bytes, str]]] = {}
        self.gone: set[str] = set()  # addresses of killed members: their hosts refuse
        self.host_checks = 0  # connections members made to ask hosts

    # -- membership of the simulation ------------------------------------------

    @staticmethod
    def address_of(i: int) -> str:
        return f"10.0.{i // 250}.{i % 250 + 1}:7946"

    def start(self, name: str, address: str, seeds: Iterable[str] = (), *,
              token: bytes | None = None, incarnation: int | None = None) -> Swim:
        """Start a member now and join it through ``seeds``."""
        if incarnation is None:
            self._incarnation += 1
            incarnation = self._incarnation
        node = Swim(Member(name, address, incarnation), self.token if token is None else token,
                    self.config, rng=random.Random(self.rng.random()))
        self.nodes[name] = node
        self.by_address[address] = node
        self.gone.discard(address)
        self.events.setdefault(name, [])
        self._send(node, node.join(list(seeds), self.now))
        self._schedule(node)
        return node

    def bootstrap(self, n: int, *, stagger: float = 0.0) -> list[str]:
        """Start ``n`` members, each joining through the first; with ``stagger``,
        starts are spread over that many seconds."""
        names = []
        seed = self.address_of(0)
        for i in range(n):
            if stagger and i:
                self.run_for(stagger / n)
            name = f"m{i:03d}"
            self.start(name, self.address_of(i), [seed] if i else [])
            names.append(name)
        return names

    def kill(self, name: str) -> Swim:
        """Stop a member abruptly: it sends nothing more, hears nothing more."""
        node = self.nodes.pop(name)
        del self.by_address[node.me.address]
        self._scheduled.pop(name, None)
        self.paused.pop(name, None)
        self.gone.add(node.me.address)
        return node

    def pause(self, name: str) -> None:
        """Starve a member: it runs nothing (no timer, no datagram read) until
        ``resume``; what reaches it waits, and its host still answers."""
        self.paused.setdefault(name, [])

    def resume(self, name: str) -> None:
        """It runs again: first its timers (late), then what waited."""
        waiting = self.paused.pop(name)
        node = self.nodes[name]
        self._send(node, node.tick(self.now))
        for _dst, data, src in waiting:
            self._send(node, node.receive(data, src, self.now))
        self._drain(node)
        self._schedule(node)

    def leave(self, name: str, linger: float | None = None) -> None:
        """Graceful leave: say goodbye, keep answering for ``linger`` seconds
        (default one period), then stop."""
        node = self.nodes[name]
        self._send(node, node.leave(self.now))
        self.run_for(self.config.period if linger is None else linger)
        self.kill(name)

    def partition(self, *groups: Iterable[str]) -> None:
        """Members of different groups stop hearing each other."""
        self.net.groups = {self.nodes[n].me.address: g for g, names in enumerate(groups)
                           for n in names}

    def heal(self) -> None:
        self.net.groups = {}

    # -- running ----------------------------------------------------------------

    def run_for(self, seconds: float) -> None:
        self.run_until_time(self.now + seconds)

    def run_until_time(self, until: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == _CHECKED:
                checker, name, inc, verdict = payload
                node = self.nodes.get(checker)
                if node is None or checker in self.paused:
                    continue
                if verdict == "answered":
                    node.host_answered(name, inc)
                elif verdict == "refused":
                    node.host_refused(name, inc, t)
                self._schedule(node)
                continue
            if kind == _DELIVER:
                dst, data, src = payload
                node = self.by_address.get(dst)
                if node is None:
                    continue
                if node.me.name in self.paused:
                    self.paused[node.me.name].append(payload)
                    continue
                self.net.delivered += 1
                self._send(node, node.receive(data, src, t))
                self._drain(node)
                self._schedule(node)
            else:
                name = payload
                assert isinstance(name, str)
                node = self.nodes.get(name)
                if node is None or self._scheduled.get(name) != t:
                    continue  # stale timer
                if name in self.paused:
                    del self._scheduled[name]  # runs on resume
                    continue
                del self._scheduled[name]
                self._send(node, node.tick(t))
                self._drain(node)
                self._schedule(node)
        self.now = until

    def run_until(self, condition: Callable[[], bool], timeout: float,
                  check_every: float | None = None) -> float | None:
        """Run until ``condition()`` holds (checked every ``check_every``,
        default a tenth of a period); the simulated seconds it took, or None
        if it did not hold within ``timeout``."""
        step = check_every or self.config.period / 10
        t0 = self.now
        while self.now - t0 < timeout:
            if condition():
                return self.now - t0
            self.run_for(step)
        return self.now - t0 if condition() else None

    # -- views --------------------------------------------------------------------

    def view(self, name: str) -> dict[str, Member]:
        return {m.name: m for m in self.nodes[name].members(include_self=False)}

    def all_see(self, who: str, states: Iterable[MemberState],
                incarnation: int | None = None) -> bool:
        """Every running member (but ``who``) sees ``who`` in one of ``states``
        (unknown counts as gone for DEAD/LEFT)."""
        wanted = set(states)
        for name, node in self.nodes.items():
            if name == who:
                continue
            m = node.member(who)
            if m is None:
                if not wanted & {MemberState.DEAD, MemberState.LEFT}:
                    return False
                continue
            if m.state not in wanted or (incarnation is not None
                                         and m.incarnation != incarnation):
                return False
        return True

    def converged(self) -> bool:
        """Every running member sees exactly the running members, all alive,
        at their current incarnations."""
        n = len(self.nodes)
        # Cheap necessary condition first (in-package, so the private view is fair game).
        for node in self.nodes.values():
            if len(node._running) != n - 1 or node._suspects:
                return False
        lives = {n: node.me.incarnation for n, node in self.nodes.items()}
        for node in self.nodes.values():
            seen = {m.name: m.incarnation for m in node.members(include_self=False)
                    if m.state is MemberState.ALIVE}
            if len(seen) != len(lives) - 1:
                return False
            for other, inc in seen.items():
                if lives.get(other) != inc:
                    return False
            if any(m.state is MemberState.SUSPECT for m in node.members(include_self=False)):
                return False
        return True

    # -- internals ----------------------------------------------------------------

    def _send(self, node: Swim, out: list[Outgoing]) -> None:
        src = node.me.address
        for o in out:
            if not self.net.passes(src, o.address):
                self.net.dropped += 1
                continue
            self._seq += 1
            heapq.heappush(self._heap, (self.now + self.net.latency(), self._seq, _DELIVER,
                                        (o.address, o.data, src)))

    def _drain(self, node: Swim) -> None:
        self.events[node.me.name] += node.take_events()
        src = node.me.address
        for name, inc, address in node.take_host_checks():
            self.host_checks += 1
            # A host that hears us answers for a process there (running or
            # starved); one whose member was killed refuses; a cut one is silent.
            if not self.net.passes(src, address):
                continue
            verdict = "answered" if address in self.by_address else \
                "refused" if address in self.gone else None
            if verdict is not None:
                self._seq += 1
                heapq.heappush(self._heap, (self.now + 2 * self.net.latency(), self._seq,
                                            _CHECKED, (node.me.name, name, inc, verdict)))

    def _schedule(self, node: Swim) -> None:
        name = node.me.name
        t = max(node.next_deadline(), self.now)
        current = self._scheduled.get(name)
        if current is not None and current <= t:
            return
        self._scheduled[name] = t
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, _TICK, name))
