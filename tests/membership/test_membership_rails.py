"""Membership over every rail: a member is alive while any of its addresses
answers, *degraded* while some do not, and dead only when none does.

The first tests drive ``Swim`` objects sans-IO over a small fake network that
knows which address (rail) each datagram leaves from and goes to, so one
rail of one member can be cut. The last one runs daemons on three hosts in
network namespaces, two veth "NICs" each on two bridges, cuts one host's
rail 0 (the control rail) and checks that it is reported degraded, never
dead, that writes to it keep going, and that it is alive again once the rail
is back. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from p2pxfer.membership import (
    ClusterAuth,
    Member,
    MemberAlive,
    MemberDead,
    MemberDegraded,
    MembershipEvent,
    MemberState,
    MemberSuspect,
    Outgoing,
    Swim,
    SwimConfig,
)
from p2pxfer.membership._wire import WireError, decode, encode

TOKEN = b"cluster-token"
ALIVE = MemberState.ALIVE


class Rails:
    """``n`` members with ``rails`` addresses each (``10.<rail>.0.<i>:7``),
    delivering every datagram after 1 ms unless its source or destination
    address is cut. Time is fake (``now``)."""

    def __init__(self, n: int, rails: int = 2, config: SwimConfig | None = None) -> None:
        self.config = config or SwimConfig()
        self.now = 0.0
        self.cut: set[str] = set()
        #: more to drop: (source, destination) -> True
        self.drop: Callable[[str, str], bool] = lambda src, dst: False
        self.nodes: dict[str, Swim] = {}
        self.where: dict[str, tuple[str, int]] = {}  # address -> (node, its index)
        self.events: dict[str, list[MembershipEvent]] = {}
        self.queue: list[tuple[float, str, str, bytes]] = []  # (when, src, dst, data)
        rng = random.Random(7)
        for i in range(n):
            name = f"m{i}"
            addrs = tuple(f"10.{r}.0.{i + 1}:7" for r in range(rails))
            self.nodes[name] = Swim(Member(name, addrs[0], 100 + i, addresses=addrs), TOKEN,
                                    self.config, rng=random.Random(rng.random()))
            self.events[name] = []
            for k, a in enumerate(addrs):
                self.where[a] = (name, k)
        seed = self.nodes["m0"].me.address
        for name, node in self.nodes.items():
            self._send(name, node.join([seed] if name != "m0" else [], self.now))

    def _send(self, name: str, out: list[Outgoing]) -> None:
        node = self.nodes[name]
        src = node.me.every_address[out[0].via] if out else ""
        for o in out:
            src = node.me.every_address[o.via]
            self.queue.append((self.now + 0.001, src, o.address, o.data))
        self.events[name] += node.take_events()

    def run(self, seconds: float, step: float = 0.01) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += step
            due = [q for q in self.queue if q[0] <= self.now]
            self.queue = [q for q in self.queue if q[0] > self.now]
            for _, src, dst, data in due:
                if src in self.cut or dst in self.cut or dst not in self.where \
                        or self.drop(src, dst):
                    continue
                name, via = self.where[dst]
                self._send(name, self.nodes[name].receive(data, src, self.now, via))
            for name, node in self.nodes.items():
                if node.next_deadline() <= self.now:
                    self._send(name, node.tick(self.now))

    def wait(self, pred: Callable[[], bool], within: float) -> float:
        start = self.now
        while not pred():
            if self.now - start > within:
                raise AssertionError(f"not within {within} s")
            self.run(0.05)
        return self.now - start


def seen(c: Rails, by: str, name: str) -> Member:
    m = c.nodes[by].member(name)
    assert m is not None
    return m


def formed(n: int = 3) -> Rails:
    c = Rails(n)
    c.wait(lambda: all((m := c.nodes[a].member(b)) is not None and m.state is ALIVE
                       for a in c.nodes for b in c.nodes), 10)
    return c


def test_members_learn_every_address() -> None:
    c = formed()
    m = seen(c, "m0", "m2")
    assert m.every_address == ("10.0.0.3:7", "10.1.0.3:7")
    assert not m.degraded and m.shown_state == "alive"


def test_a_cut_rail_makes_a_member_degraded_never_dead_and_healing_makes_it_alive() -> None:
    c = formed()
    for evs in c.events.values():
        evs.clear()
    c.cut.add("10.0.0.3:7")  # m2's rail 0 (its primary address)
    took = c.wait(lambda: seen(c, "m0", "m2").degraded and seen(c, "m1", "m2").degraded, 10)
    assert took < 6 * c.config.period * 2
    m = seen(c, "m0", "m2")
    assert m.shown_state == "degraded" and m.unreachable == ("10.0.0.3:7",)
    assert m.running and c.nodes["m0"].is_current("m2", m.incarnation)
    # Far longer than a death takes: still never suspect or dead anywhere.
    c.run(10 * (c.config.period * 4 + c.nodes["m0"].suspicion_timeout()))
    for name in ("m0", "m1"):
        assert seen(c, name, "m2").degraded
        evs = c.events[name]
        assert not [e for e in evs if isinstance(e, MemberSuspect | MemberDead)], evs
        assert [e for e in evs if isinstance(e, MemberDegraded) and e.member.name == "m2"]
    # m2 itself reaches the others only on rail 1: they are degraded to it.
    assert seen(c, "m2", "m0").degraded
    c.cut.clear()
    c.wait(lambda: not any(seen(c, a, b).degraded for a in c.nodes for b in c.nodes
                           if a != b), 10)
    assert [e for e in c.events["m0"] if isinstance(e, MemberAlive)
            and e.member.name == "m2" and not e.member.degraded]


def test_a_member_cut_off_every_rail_is_dead_as_fast_as_with_one_rail() -> None:
    c = formed()
    c.cut.update({"10.0.0.3:7", "10.1.0.3:7"})
    bound = 4 * c.config.period + c.nodes["m0"].suspicion_timeout()
    took = c.wait(lambda: seen(c, "m0", "m2").state is MemberState.DEAD
                  and seen(c, "m1", "m2").state is MemberState.DEAD, 2 * bound)
    assert took <= bound + c.config.period


def test_indirect_probes_keep_a_member_alive_that_we_cannot_reach_ourselves() -> None:
    c = formed()
    # m0 and m2 cannot reach each other on any rail; m1 reaches both.
    c.drop = lambda src, dst: {src[-4:], dst[-4:]} == {".1:7", ".3:7"}
    c.run(20 * c.config.period)
    m = seen(c, "m0", "m2")
    # Alive through m1, and not degraded: no rail of m2 answers m0 directly, so
    # it is the pair's path, not one of m2's rails, that is broken.
    assert m.state is ALIVE and not m.degraded, m
    assert m.unreachable == m.every_address
    assert not [e for e in c.events["m0"] if isinstance(e, MemberSuspect | MemberDegraded)
                and e.member.name == "m2"]
    assert seen(c, "m1", "m2").state is ALIVE and not seen(c, "m1", "m2").unreachable


def test_records_carry_other_addresses_on_the_wire() -> None:
    rec: Any = ("a", "10.0.0.1:7", 5, 1, ALIVE, ("10.1.0.1:7",))
    body = encode("swim_ping", rec, seq=1, to="b", d=0, u=[rec])
    msg = decode(body)
    assert msg.sender == rec and msg.updates == [rec]
    single: Any = ("a", "10.0.0.1:7", 5, 1, ALIVE, ())
    assert decode(encode("swim_leave", single, u=[])).sender == single
    too_many: Any = ("a", "10.0.0.1:7", 5, 1, ALIVE, tuple(f"10.{i}.0.1:7" for i in range(9)))
    with pytest.raises(WireError, match="more addresses"):
        decode(encode("swim_leave", too_many, u=[]))
    not_addresses: Any = ("a", "10.0.0.1:7", 5, 1, ALIVE, ("nocolon",))
    with pytest.raises(WireError):
        decode(encode("swim_leave", not_addresses, u=[]))
    # Version 2 on the wire: a version-1 peer's datagrams are refused, not misread.
    sealed = ClusterAuth(TOKEN).seal(body)
    assert sealed[0] == 2


# -- daemons on three two-rail hosts -------------------------------------------------------

CONTROL_PORT = 7720
DAEMON_TOKEN = "rails-cluster-token"
# A probe round or two per member, twice (degrade_after = 2); 6 s ran out on a loaded CI run.
DEGRADED_WITHIN = 15.0
DEAD_WITHIN = 8.0  # as in test_membership_daemon: generous for CI


def start_on_rails(host: Any, workdir: Any, name: str, seed: str) -> Any:
    """A daemon in ``host``: control (and membership) on rail 0's address,
    data striped over both rails."""
    from daemon_helpers import spawn_daemon

    return spawn_daemon(workdir, {
        "node": name, "socket": str(workdir / f"{name}.sock"),
        "control": f"{host.addresses[0]}:{CONTROL_PORT}", "provider": "tcp;ofi_rxm",
        "interfaces": list(host.interfaces), "log_level": "INFO",
        "membership": "embedded", "cluster_token": DAEMON_TOKEN, "seeds": [seed],
        # Three daemons, three agents and a write loop on two cores: 1.5 s
        # without a completion once took a healthy pair down (its write's
        # notification in flight there: the write failed, outcome unknown).
        "rail_stall_s": 4.0,
    }, host.exec_argv)


def peer_states(d: Any) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in d.status()["peers"]}


@pytest.mark.netns
def test_control_rail_cut_is_degraded_not_dead(tmp_path: Any) -> None:
    """h0..h2, two NICs each on two switches. (1) h2's control port is cut on
    rail 0 only (nftables): h2 is degraded everywhere, never dead, and h0's
    writes to h2 keep going (data still flows on both rails) and land intact.
    (2) h2's rail-0 link goes down: still degraded, never suspect or dead;
    up again: alive everywhere, and the write loop never failed (its writes
    use notify mode, so they fail over to rail 1). (3) h2 is SIGKILLed: dead
    as fast as with one rail."""
    import time

    from daemon_helpers import Agent, Plan, wait_for
    from netns import block_port, ip, rails_lan, unblock

    procs: list[Any] = []
    with rails_lan(3, rails=2) as hosts:
        try:
            seed = f"{hosts[0].addresses[0]}:{CONTROL_PORT}"
            names = ["h0", "h1", "h2"]
            ds = {}
            for i, n in enumerate(names):
                ds[n] = start_on_rails(hosts[i], tmp_path, n, seed)
                procs.append(ds[n])
            for n in names:
                wait_for(lambda n=n: {m: p["state"] for m, p in peer_states(ds[n]).items()}
                         == dict.fromkeys(names, "alive"), f"{n} to see three alive")
            h2_addrs = [f"{a}:{CONTROL_PORT}" for a in hosts[2].addresses]
            assert peer_states(ds["h0"])["h2"]["addresses"] == h2_addrs

            plan = Plan(0x2A17, pieces=256, min_len=4 << 10, max_len=64 << 10,
                        region=32 << 20)
            target = Agent("trio", ds["h2"].socket, "target-h2")
            procs.append(target)
            assert target.ok("export", "r", plan.region) == plan.region
            looper = Agent("trio", ds["h0"].socket, "looper-h0")
            procs.append(looper)
            assert looper.call("loop", "h2", "r", plan, 1, True) == ("ok", "looping")
            writer = Agent("trio", ds["h1"].socket, "writer-h1")
            procs.append(writer)
            assert writer.ok("write", "h2", "r", plan, 2, True) > 0  # h1 resolves r now

            def never_dead(seconds: float) -> None:
                # Suspect is allowed (and refuted): with rail 0 down the write
                # loop fails over to rail 1 and keeps this 2-core VM busy, so a
                # probe's answer can come late; dead never.
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for n in ("h0", "h1"):
                        st = peer_states(ds[n])["h2"]["state"]
                        assert st in ("degraded", "suspect"), f"{n} sees h2 {st}"
                    time.sleep(0.1)
                for n in ("h0", "h1"):
                    wait_for(lambda n=n: peer_states(ds[n])["h2"]["state"] == "degraded",
                             f"{n} to see h2 degraded", timeout=DEGRADED_WITHIN)

            # (1) The control port cut on h2's rail 0.
            block_port(hosts[2], hosts[2].interfaces[0], CONTROL_PORT)
            for n in ("h0", "h1"):
                wait_for(lambda n=n: peer_states(ds[n])["h2"]["state"] == "degraded",
                         f"{n} to see h2 degraded", timeout=DEGRADED_WITHIN)
            assert peer_states(ds["h0"])["h2"]["unreachable"] == h2_addrs[:1]
            never_dead(3.0)
            pieces = writer.ok("write", "h2", "r", plan, 3, True)
            assert target.call("verify", "r", plan, 3, pieces)[0] == "ok"
            assert not looper.conn.poll(0), looper.conn.recv()
            unblock(hosts[2])
            for n in ("h0", "h1"):
                wait_for(lambda n=n: peer_states(ds[n])["h2"]["state"] == "alive",
                         f"{n} to see h2 alive again", timeout=DEGRADED_WITHIN)

            # (2) h2's whole rail 0 down.
            ip("-n", hosts[2].ns, "link", "set", hosts[2].interfaces[0], "down")
            for n in ("h0", "h1"):
                wait_for(lambda n=n: peer_states(ds[n])["h2"]["state"] == "degraded",
                         f"{n} to see h2 degraded", timeout=DEGRADED_WITHIN)
            never_dead(2 * DEAD_WITHIN / 2)
            ip("-n", hosts[2].ns, "link", "set", hosts[2].interfaces[0], "up")
            for n in ("h0", "h1"):
                wait_for(lambda n=n: peer_states(ds[n])["h2"]["state"] == "alive",
                         f"{n} to see h2 alive again", timeout=DEGRADED_WITHIN + 4)
            assert not looper.conn.poll(0), looper.conn.recv()
            pieces = writer.ok("write", "h2", "r", plan, 4, True)
            assert target.call("verify", "r", plan, 4, pieces)[0] == "ok"

            # (3) A real death is found as before.
            looper.kill()
            ds["h2"].proc.kill()
            ds["h2"].proc.wait(5)
            t0 = time.monotonic()
            wait_for(lambda: peer_states(ds["h0"])["h2"]["state"] == "dead"
                     and peer_states(ds["h1"])["h2"]["state"] == "dead",
                     "h2 dead everywhere", timeout=DEAD_WITHIN)
            assert time.monotonic() - t0 < DEAD_WITHIN
        except BaseException:
            # What each daemon said, for the failure's report (a daemon that
            # died shows its last words here).
            for d in ds.values():
                print(f"--- {d.name} (alive: {d.alive()}, exit: {d.proc.returncode})")
                print(d.log_tail(80))
            raise
        finally:
            for p in reversed(procs):
                if isinstance(p, Agent):
                    p.kill()
                else:
                    p.stop()


def test_rail_hosts_from_endpoint_addresses() -> None:
    from p2pxfer.daemon._follow import rail_hosts

    assert rail_hosts(["fi_sockaddr_in://10.79.1.1:40000", "fi_sockaddr_in://10.79.2.1:40001",
                       "fi_sockaddr_in://10.79.1.1:40002"]) == ["10.79.1.1", "10.79.2.1"]
    # Never advertised: loopback, link-local, non-IP rails.
    assert rail_hosts(["fi_sockaddr_in://127.0.0.1:5", "fi_sockaddr_in6://[fe80::1]:5",
                       "fi_shm://1234", "fi_sockaddr_in6://[fd00::2]:7"]) == ["fd00::2"]
