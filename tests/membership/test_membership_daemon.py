"""Membership wired into the daemon (``membership = "embedded" | "etcd"``).

Daemons run as ``p2pxfer daemon`` subprocesses on 127.0.0.1, each with a
fixed control port (its UDP membership socket shares the host:port) and no
configured peers: they find each other through a seed (embedded) or etcd.
Every wait is bounded; every process is killed on the way out. The first
tests drive ``Daemon``'s membership hooks in-process, with a fake backend;
the last ones run daemons (and an etcd) in network namespaces, one per "host"
(``netns.lan``); ``bench/membership_hosts.py`` reuses their helpers.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from daemon_helpers import LOOPBACK, Agent, DaemonProc, Plan, free_port, start_daemon, wait_for
from p2pxfer.daemon import Daemon, DaemonConfig
from p2pxfer.errors import InvalidArgument, PeerLost, RemoteClosed
from p2pxfer.membership import (
    Member,
    MemberDead,
    MemberDegraded,
    MemberJoined,
    MemberRestarted,
    MembershipBackend,
    MemberState,
    StaleIncarnation,
)
from p2pxfer.memory import RegionDescriptor
from p2pxfer.protocol import wire_error
from p2pxfer.testing import NO_ETCD, etcd_in

TOKEN = "s3cret-cluster-token"
DEAD_WITHIN = 8.0  # SWIM: a probe period, suspicion 3 x 0.4 s; generous for CI


# -- config -------------------------------------------------------------------------------

def test_config_membership_keys() -> None:
    assert DaemonConfig.from_dict({}).membership == "none"
    cfg = DaemonConfig.from_dict({"membership": "embedded", "cluster_token": "t",
                                  "seeds": ["127.0.0.1:7700"], "control": "127.0.0.1:7701"})
    assert cfg.seeds == ("127.0.0.1:7700",)
    with pytest.raises(InvalidArgument, match="membership must be one of"):
        DaemonConfig.from_dict({"membership": "swim"})
    with pytest.raises(InvalidArgument, match="needs a cluster_token"):
        DaemonConfig.from_dict({"membership": "etcd"})
    with pytest.raises(InvalidArgument, match="seeds"):
        DaemonConfig.from_dict({"membership": "embedded", "cluster_token": "t",
                                "seeds": ["nohost"]})
    with pytest.raises(InvalidArgument, match="etcd_endpoint"):
        DaemonConfig.from_dict({"membership": "etcd", "cluster_token": "t",
                                "etcd_endpoint": "127.0.0.1:2379"})
    with pytest.raises(InvalidArgument, match="etcd_ttl must be >= 1"):
        DaemonConfig.from_dict({"membership": "etcd", "cluster_token": "t", "etcd_ttl": 0})
    assert DaemonConfig.from_dict({"etcd_ttl": 2}).etcd_ttl == 2
    with pytest.raises(InvalidArgument, match="specific host"):
        DaemonConfig.from_dict({"membership": "embedded", "cluster_token": "t",
                                "control": "0.0.0.0:7700"})


def test_deploy_config_parses() -> None:
    root = Path(__file__).resolve().parents[2]
    DaemonConfig.from_toml(root / "deploy" / "p2pxfer.toml")


# -- the daemon's hooks, in-process ---------------------------------------------------------

class FakeBackend(MembershipBackend):
    def __init__(self, members: list[Member]) -> None:
        super().__init__("node-a", 1)
        self.view = {m.name: m for m in members}

    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()

    async def _say_goodbye(self) -> None:
        pass

    def members(self) -> list[Member]:
        return sorted(self.view.values(), key=lambda m: m.name)

    def member(self, name: str) -> Member | None:
        return self.view.get(name)


def fake_daemon(members: list[Member]) -> tuple[Daemon, FakeBackend]:
    cfg = DaemonConfig(node="node-a", membership="embedded", cluster_token="t")
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))
    d = Daemon(cfg, engine)
    d.follower.backend = backend = FakeBackend(members)
    return d, backend


def desc(node: str, inc: int) -> RegionDescriptor:
    return RegionDescriptor("r", 4096, (), node=node, incarnation=inc)


def test_stale_descriptor_is_refused_as_peer_lost() -> None:
    d, backend = fake_daemon([Member("node-b", "127.0.0.1:1", 200)])
    d.follower.check_descriptor(desc("node-b", 200))  # the running life
    with pytest.raises(StaleIncarnation) as info:
        d.follower.check_descriptor(desc("node-b", 100))  # exported by an earlier life
    assert wire_error(info.value)[0] == "peer_lost"
    assert "incarnation 100 is not running" in str(info.value)
    backend.view["node-b"] = Member("node-b", "127.0.0.1:1", 200, MemberState.DEAD)
    with pytest.raises(PeerLost, match="dead"):
        d.follower.check_peer("node-b")
    assert issubclass(PeerLost, RemoteClosed)


def test_events_update_peers_and_fail_writes_in_flight() -> None:
    b1 = Member("node-b", "127.0.0.1:1", 100)
    d, _ = fake_daemon([b1])

    async def main() -> None:
        d.follower.on_event(MemberJoined(b1))
        assert d.peers.peers["node-b"].address == "127.0.0.1:1"
        d.regions._resolved[("node-b", "r")] = desc("node-b", 100)
        failed: list[BaseException] = []

        async def write() -> None:
            try:
                with d.follower.track_write("node-b"):
                    await trio.sleep_forever()
            except PeerLost as exc:
                failed.append(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                await trio.sleep(0.05)
                d.follower.on_event(MemberDead(Member("node-b", "127.0.0.1:1", 100,
                                                        MemberState.DEAD)))
        assert len(failed) == 1 and "node-b died" in str(failed[0])
        assert wire_error(failed[0])[0] == "peer_lost"
        assert ("node-b", "r") not in d.regions._resolved
        assert not d.follower._writes_to.get("node-b")
        b2 = Member("node-b", "127.0.0.1:2", 300)
        d.regions._resolved[("node-b", "r")] = desc("node-b", 100)
        d.follower.on_event(MemberRestarted(b2, 100))
        assert d.peers.peers["node-b"].address == "127.0.0.1:2"
        assert ("node-b", "r") not in d.regions._resolved

    trio.run(main)


def test_a_degraded_member_stays_a_peer_and_its_writes_go_on() -> None:
    addrs = ("10.0.0.2:7", "10.1.0.2:7")
    b = Member("node-b", addrs[0], 100, addresses=addrs, unreachable=addrs[:1])
    d, _ = fake_daemon([b])

    async def main() -> None:
        d.follower.on_event(MemberJoined(Member("node-b", addrs[0], 100, addresses=addrs)))
        d.regions._resolved[("node-b", "r")] = desc("node-b", 100)
        with trio.fail_after(5), d.follower.track_write("node-b"):
            d.follower.on_event(MemberDegraded(b))
            await trio.sleep(0.05)  # not cancelled: the write goes on
        # Its control port reached on the rail that answers; nothing forgotten.
        assert d.peers.peers["node-b"].address == addrs[1]
        assert ("node-b", "r") in d.regions._resolved
        d.follower.check_peer("node-b")
        d.follower.check_descriptor(desc("node-b", 100))
        [listed] = d.peer_list()
        assert listed["state"] == "degraded" and listed["unreachable"] == [addrs[0]]
        assert listed["addresses"] == list(addrs)
        got = await d.follower.watch(0, 0.0, d.peer_list)
        assert [(e["event"], e["state"]) for e in got["events"]] == [
            ("joined", "alive"), ("degraded", "degraded")]

    trio.run(main)


# -- daemons --------------------------------------------------------------------------------

def start_member(workdir: Path, name: str, port: int, **keys: Any) -> DaemonProc:
    return start_daemon(workdir, name, control_port=port, **keys)


def members(d: DaemonProc) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in d.status()["peers"]}


def states(d: DaemonProc) -> dict[str, str]:
    return {n: p["state"] for n, p in members(d).items()}


def kill(d: DaemonProc) -> None:
    if d.alive():
        d.proc.kill()
        d.proc.wait(5)


def stop_all(procs: list[Any]) -> None:
    """Stop (and forget) these daemons and agents, the last started first."""
    while procs:
        p = procs.pop()
        if isinstance(p, Agent):
            p.close()
        else:
            p.stop()


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Daemons and agents to stop at the end, whatever happens."""
    out: list[Any] = []
    yield out
    stop_all(out)


def three_members(workdir: Path, procs: list[Any], backend: str, **keys: Any
                  ) -> tuple[dict[str, int], DaemonProc, DaemonProc, DaemonProc]:
    """node-a, node-b and node-c (embedded: seeded by node-a), once each
    sees all three alive; their control ports and the daemons."""
    ports = {n: free_port() for n in ("node-a", "node-b", "node-c")}
    keys = {"membership": backend, "cluster_token": TOKEN, **keys}
    if backend == "embedded":
        keys["seeds"] = [f"{LOOPBACK}:{ports['node-a']}"]
    ds = {}
    for n, port in ports.items():
        ds[n] = start_member(workdir, n, port, **keys)
        procs.append(ds[n])
    for d in ds.values():
        wait_for(lambda d=d: states(d) == {n: "alive" for n in ports},
                 f"{d.name} to see all three alive")
    return ports, ds["node-a"], ds["node-b"], ds["node-c"]


def test_embedded_discovery_kill_and_restart(tmp_path: Path, procs: list[Any]) -> None:
    ports, a, b, c = three_members(tmp_path, procs, "embedded")
    keys = {"membership": "embedded", "cluster_token": TOKEN,
            "seeds": [f"{LOOPBACK}:{ports['node-a']}"]}
    view = members(a)
    assert view["node-b"]["address"] == f"{LOOPBACK}:{ports['node-b']}"
    assert view["node-a"]["incarnation"] == a.status()["incarnation"]
    assert a.status()["membership"] == "embedded"
    from daemon_helpers import p2pxfer_cmd

    out = subprocess.run([*p2pxfer_cmd(), "peers", "--socket", a.socket], capture_output=True,
                         text=True, timeout=20, check=True).stdout
    assert "state" in out and "incarnation" in out and "last heard" in out, out
    assert out.count("alive") == 3 and "node-c" in out, out

    # A transfer between two members nobody introduced.
    plan = Plan(0x5EED, pieces=256, min_len=4 << 10, max_len=32 << 10, region=16 << 20)
    target = Agent("trio", b.socket, "target")
    procs.append(target)
    initiator = Agent("trio", a.socket, "initiator")
    procs.append(initiator)
    assert target.ok("export", "r", plan.region) == plan.region
    pieces = initiator.ok("write", "node-b", "r", plan, 7)
    reply = target.call("verify", "r", plan, 7, pieces)
    assert reply[0] == "ok", reply

    # Writes in flight while node-b is SIGKILLed fail quickly, not hang.
    old_inc = members(a)["node-b"]["incarnation"]
    assert initiator.call("loop", "node-b", "r", plan, 8) == ("ok", "looping")
    t0 = time.monotonic()
    kill(b)
    reply = initiator.wait_reply("the write loop", timeout=DEAD_WITHIN)
    assert reply[0] == "raised" and reply[1] in ("PeerLost", "PeerUnreachable", "TransferError",
                                                "RailsExhausted", "TransferTimeout"), \
        reply
    assert time.monotonic() - t0 < DEAD_WITHIN
    for d in (a, c):
        wait_for(lambda d=d: states(d).get("node-b") == "dead", f"{d.name} to see b dead",
                 timeout=DEAD_WITHIN)
    # Known dead: refused at once with peer_lost, nothing posted.
    t0 = time.monotonic()
    reply = initiator.call("write", "node-b", "r", plan, 9, timeout=5)
    assert reply[:3] == ("raised", "PeerLost", "peer_lost"), reply
    assert "node-b is dead" in reply[3]
    assert time.monotonic() - t0 < 3
    # Unaffected pairs keep working.
    target_c = Agent("trio", c.socket, "target-c")
    procs.append(target_c)
    assert target_c.ok("export", "rc", plan.region) == plan.region
    initiator.ok("write", "node-c", "rc", plan, 10)

    # Restarted: a new life; nothing of the old one is used.
    b2 = start_member(tmp_path, "node-b", ports["node-b"], **keys)
    procs.append(b2)
    for d in (a, c):
        wait_for(lambda d=d: members(d).get("node-b", {}).get("state") == "alive" and
                 members(d)["node-b"]["incarnation"] > old_inc,
                 f"{d.name} to see b's new life", timeout=DEAD_WITHIN)
    # The old region died with the old life: a clear error, never a write into reused memory.
    reply = initiator.call("write", "node-b", "r", plan, 11, timeout=10)
    assert reply[:3] == ("raised", "UnknownRegion", "unknown_region") or \
        reply[2] == "unknown_region", reply
    target2 = Agent("trio", b2.socket, "target2")
    procs.append(target2)
    assert target2.ok("export", "r", plan.region) == plan.region
    pieces = initiator.ok("write", "node-b", "r", plan, 12)
    assert target2.call("verify", "r", plan, 12, pieces)[0] == "ok"

    # A graceful stop: the others see "left" promptly.
    assert c.stop() == 0
    wait_for(lambda: states(a).get("node-c") == "left", "a to see c left", timeout=3)


def host_checked(d: DaemonProc) -> bool:
    """``d`` asked node-b's host and it answered (``Swim`` reprieves)."""
    return any("membership.host_checked" in line and "node-b" in line and "answered" in line
               for line in d.log.read_text(errors="replace").splitlines())


@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_a_stopped_member_is_suspect_not_dead_while_its_host_answers(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path,
        procs: list[Any]) -> None:
    """A member daemon not scheduled for several suspicion timeouts (SIGSTOP:
    a starved process) answers no probe (embedded) or lets its lease lapse
    (etcd), but its kernel still accepts on its control port: the others
    keep it suspect (``STARVED_GRACE_S``), never dead, and once it runs
    again it refutes (puts its key back) and takes writes as before, the
    same life."""
    from p2pxfer.daemon._follow import STARVED_GRACE_S

    keys = {} if backend == "embedded" else \
        {"etcd_endpoint": request.getfixturevalue("etcd"), "etcd_ttl": 2}
    _, a, b, c = three_members(tmp_path, procs, backend, **keys)
    plan = Plan(0x5709, pieces=64, min_len=4 << 10, max_len=16 << 10, region=4 << 20)
    target = Agent("trio", b.socket, "target")
    initiator = Agent("trio", a.socket, "initiator")
    procs.extend([target, initiator])
    assert target.ok("export", "r", plan.region) == plan.region
    initiator.ok("write", "node-b", "r", plan, 1)
    inc = members(a)["node-b"]["incarnation"]
    b.proc.send_signal(signal.SIGSTOP)
    seen: set[str] = set()
    samples: list[tuple[float, str, str]] = []  # (seconds after the stop, member, b's state)
    try:
        t0 = time.monotonic()
        # Three suspicion timeouts and more; on a host that delays the
        # others (or these status calls), until each has suspected b and
        # asked its host (its own suspicion ran out: one learnt by gossip
        # starts later), while the stop is still well within the grace.
        while (elapsed := time.monotonic() - t0) < 4.0 or (
                elapsed < STARVED_GRACE_S - 2.0 and (
                    {m for _, m, st in samples if st == "suspect"} != {"node-a", "node-c"}
                    or not all(host_checked(d) for d in (a, c)))):
            for d in (a, c):
                st = states(d)["node-b"]
                seen.add(st)
                samples.append((round(time.monotonic() - t0, 2), d.name, st))
            time.sleep(0.1)
    finally:
        b.proc.send_signal(signal.SIGCONT)
        stopped_s = time.monotonic() - t0
    def told() -> str:  # what each saw, and what their membership logged
        return f"{samples}\n" + "\n".join(
            f"{d.name}: " + "\n".join(line for line in d.log_tail(400).splitlines()
                                      if "membership" in line) for d in (a, c))

    assert "suspect" in seen, told()  # it was missed: the test is not vacuous
    assert "dead" not in seen, told()
    assert stopped_s < STARVED_GRACE_S, (stopped_s, told())  # the stop fell within the grace
    for d in (a, c):
        wait_for(lambda d=d: states(d).get("node-b") == "alive", f"{d.name} to see b alive")
        assert members(d)["node-b"]["incarnation"] == inc, told()  # the same life
    pieces = initiator.ok("write", "node-b", "r", plan, 2)
    assert target.call("verify", "r", plan, 2, pieces)[0] == "ok"
    assert host_checked(a) and host_checked(c), told()


def test_wrong_token_cannot_join(tmp_path: Path, procs: list[Any]) -> None:
    pa, pe = free_port(), free_port()
    a = start_member(tmp_path, "node-a", pa, membership="embedded", cluster_token=TOKEN)
    procs.append(a)
    evil = start_member(tmp_path, "node-e", pe, membership="embedded",
                        cluster_token="not-the-token", seeds=[f"{LOOPBACK}:{pa}"])
    procs.append(evil)
    wait_for(lambda: "auth_failed" in a.log.read_text(errors="replace"),
             "a to log the failed join")
    time.sleep(1.0)
    assert set(members(a)) == {"node-a"}
    assert set(members(evil)) == {"node-e"}


# -- etcd -----------------------------------------------------------------------------------



def test_etcd_discovery_and_transfer(etcd: str, tmp_path: Path, procs: list[Any]) -> None:
    _, a, b, c = three_members(tmp_path, procs, "etcd", etcd_endpoint=etcd)
    plan = Plan(0xE7CD, pieces=128, min_len=4 << 10, max_len=32 << 10, region=8 << 20)
    target = Agent("trio", b.socket, "target")
    procs.append(target)
    initiator = Agent("trio", a.socket, "initiator")
    procs.append(initiator)
    assert target.ok("export", "r", plan.region) == plan.region
    pieces = initiator.ok("write", "node-b", "r", plan, 3)
    assert target.call("verify", "r", plan, 3, pieces)[0] == "ok"
    # SIGKILL: the lease runs out (ttl 5 s), then a write is refused with peer_lost.
    kill(b)
    wait_for(lambda: states(a).get("node-b") == "dead", "a to see b dead", timeout=15)
    reply = initiator.call("write", "node-b", "r", plan, 4, timeout=5)
    assert reply[:3] == ("raised", "PeerLost", "peer_lost"), reply
    assert c.stop() == 0
    wait_for(lambda: states(a).get("node-c") == "left", "a to see c left", timeout=5)


# -- several hosts: network namespaces ------------------------------------------------------

CONTROL_PORT = 7700  # every host's daemon: control (TCP) and membership (UDP)
# seconds (config etcd_ttl): a killed member is seen dead about this long after.
# 2 s let a loaded CI machine miss a live member's keepalives (a false death).
ETCD_TTL = 3
#: how soon after a SIGKILL a write in flight to the node fails with PeerLost:
#: SWIM (~1.2 s with the daemon's local suspicion); etcd waits for the lease
PEER_LOST_WITHIN = {"embedded": 3.0, "etcd": ETCD_TTL + 2.0}
#: how long a SIGKILLed (or cut off) member may take to be seen dead: SWIM's
#: suspicion, or etcd's lease
DEAD_WITHIN_BY = {"embedded": DEAD_WITHIN, "etcd": 10.0}


def start_in(host: Any, workdir: Path, name: str, membership: dict[str, Any]) -> DaemonProc:
    """A daemon inside ``host``'s namespace, control (and membership) on its
    address, port 7700; its unix socket in ``workdir`` (reachable from here);
    ``membership``: its membership keys (from ``lan_members``)."""
    from daemon_helpers import spawn_daemon

    addr = host.addresses[0]
    return spawn_daemon(workdir, {
        "node": name, "socket": str(workdir / f"{name}.sock"),
        "control": f"{addr}:{CONTROL_PORT}", "provider": "tcp;ofi_rxm", "fabric_node": addr,
        "log_level": "INFO", **membership,
    }, host.exec_argv)


@contextmanager
def lan_members(backend: str, n: int,
                workdir: Path) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """``n`` hosts on one switch (``netns.lan``) and the membership keys for
    their daemons: "embedded", seeded by the first host; "etcd", an etcd in
    one more namespace on the same switch. Skips where namespaces (or etcd)
    are missing; everything is gone on the way out."""
    from netns import lan

    if backend == "etcd" and shutil.which("etcd") is None:
        pytest.skip(NO_ETCD)
    with lan(n + (backend == "etcd")) as hosts:
        if backend == "embedded":
            yield hosts, {"membership": "embedded", "cluster_token": TOKEN,
                          "seeds": [f"{hosts[0].addresses[0]}:{CONTROL_PORT}"]}
        else:
            with etcd_in(hosts[n], workdir / "etcd") as url:
                yield hosts[:n], {"membership": "etcd", "cluster_token": TOKEN,
                                  "etcd_endpoint": url, "etcd_ttl": ETCD_TTL}


def four_hosts_scenario(hosts: list[Any], keys: dict[str, Any], workdir: Path,
                        procs: list[Any], dead_within: float) -> None:
    """The scenario of ``test_four_hosts_join_leave_kill_restart``, whatever
    the backend behind ``keys``."""
    from netns import ip

    names = [f"h{i}" for i in range(4)]
    ds = {}
    for i in range(3):
        ds[names[i]] = start_in(hosts[i], workdir, names[i], keys)
        procs.append(ds[names[i]])
    h0, h1 = ds["h0"], ds["h1"]
    for n in names[:3]:
        wait_for(lambda n=n: states(ds[n]) == {m: "alive" for m in names[:3]},
                 f"{n} to see h0..h2 alive")
    plan = Plan(0x4E75, pieces=256, min_len=4 << 10, max_len=32 << 10, region=16 << 20)
    target = Agent("trio", h1.socket, "target-h1")
    procs.append(target)
    looper = Agent("trio", h0.socket, "looper-h0")
    procs.append(looper)
    other = Agent("trio", h0.socket, "other-h0")
    procs.append(other)
    assert target.ok("export", "r", plan.region) == plan.region
    assert looper.call("loop", "h1", "r", plan, 1) == ("ok", "looping")

    # h3 joins while h0 -> h1 runs.
    ds["h3"] = h3 = start_in(hosts[3], workdir, "h3", keys)
    procs.append(h3)
    for n in names:
        wait_for(lambda n=n: states(ds[n]) == {m: "alive" for m in names},
                 f"{n} to see four alive", timeout=10)
    target3 = Agent("trio", h3.socket, "target-h3")
    procs.append(target3)
    assert target3.ok("export", "r3", plan.region) == plan.region
    pieces = other.ok("write", "h3", "r3", plan, 2)
    assert target3.call("verify", "r3", plan, 2, pieces)[0] == "ok"

    # h2 leaves gracefully: seen as left at once.
    assert ds["h2"].stop() == 0
    wait_for(lambda: states(h0).get("h2") == "left", "h0 to see h2 left", timeout=3)

    # h3 is killed while a write loop to it is in flight: the loop fails with
    # PeerLost as soon as membership knows; a write after that is refused at once.
    old_inc = members(h0)["h3"]["incarnation"]
    to_h3 = Agent("trio", h0.socket, "to-h3")
    procs.append(to_h3)
    assert to_h3.call("loop", "h3", "r3", plan, 5) == ("ok", "looping")
    kill(h3)
    t_kill = time.monotonic()
    reply = to_h3.wait_reply("the write loop to h3 to fail", timeout=dead_within + 5)
    detect_s = time.monotonic() - t_kill
    bound = PEER_LOST_WITHIN[keys["membership"]]
    assert detect_s < bound, f"PeerLost came {detect_s:.2f} s after the kill (bound {bound} s)"
    assert reply[:3] == ("raised", "PeerLost", "peer_lost"), reply
    assert "h3 died" in reply[3], reply
    wait_for(lambda: states(h0).get("h3") == "dead", "h0 to see h3 dead", timeout=dead_within)
    t0 = time.monotonic()
    reply = other.call("write", "h3", "r3", plan, 3, timeout=10)
    assert reply[:3] == ("raised", "PeerLost", "peer_lost"), reply
    assert time.monotonic() - t0 < 3, "PeerLost took longer than 3 s"

    # Restarted: a new life, its old descriptors are void.
    ds["h3"] = h3b = start_in(hosts[3], workdir, "h3", keys)
    procs.append(h3b)
    wait_for(lambda: members(h0).get("h3", {}).get("state") == "alive" and
             members(h0)["h3"]["incarnation"] > old_inc, "h0 to see h3's new life",
             timeout=dead_within)
    reply = other.call("write", "h3", "r3", plan, 4, timeout=10)
    assert reply[0] == "raised" and reply[2] in ("unknown_region", "peer_lost"), reply
    # The new life exports a region of the same name: writes reach the new
    # memory, never through the old life's descriptor (cached by h0's daemon).
    target3b = Agent("trio", h3b.socket, "target-h3b")
    procs.append(target3b)
    assert target3b.ok("export", "r3", plan.region) == plan.region
    pieces = other.ok("write", "h3", "r3", plan, 6)
    assert target3b.call("verify", "r3", plan, 6, pieces)[0] == "ok"

    # Killed and restarted at once, faster than failure detection: h0 sees a
    # new incarnation replace the running one, and a write loop in flight to
    # the old life fails with PeerLost naming the restart.
    mid_inc = members(h0)["h3"]["incarnation"]
    to_h3 = Agent("trio", h0.socket, "to-h3b")
    procs.append(to_h3)
    assert to_h3.call("loop", "h3", "r3", plan, 7) == ("ok", "looping")
    kill(h3b)
    ds["h3"] = h3b = start_in(hosts[3], workdir, "h3", keys)
    procs.append(h3b)
    reply = to_h3.wait_reply("the write loop to the old h3 to fail", timeout=dead_within + 5)
    assert reply[:3] == ("raised", "PeerLost", "peer_lost"), reply
    wait_for(lambda: members(h0).get("h3", {}).get("state") == "alive" and
             members(h0)["h3"]["incarnation"] > mid_inc, "h0 to see h3's third life",
             timeout=dead_within)

    # A partition: h3's link down (SWIM: suspected; etcd: its lease runs out),
    # then up; membership converges again.
    ip("-n", hosts[3].ns, "link", "set", hosts[3].interfaces[0], "down")
    wait_for(lambda: states(h0).get("h3") in ("suspect", "dead"), "h0 to miss h3",
             timeout=dead_within)
    ip("-n", hosts[3].ns, "link", "set", hosts[3].interfaces[0], "up")
    wait_for(lambda: states(h0).get("h3") == "alive" and states(h3b).get("h0") == "alive",
             "the partition to heal", timeout=20)

    # The unaffected pair never saw an error: the loop is still running.
    assert not looper.conn.poll(0), looper.conn.recv()
    looper.kill()  # it loops until killed


@pytest.mark.netns
@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_four_hosts_join_leave_kill_restart(backend: str, tmp_path: Path,
                                            procs: list[Any]) -> None:
    """h0..h3 in namespaces on one switch: h3 joins while h0 writes to h1 in a
    loop; h2 leaves gracefully; h3 is SIGKILLed with a write loop to it in
    flight (PeerLost within 3 s over SWIM, the lease + 2 s over etcd; then
    refused at once), restarted (a new life), and h3's link
    is cut and healed (membership converges again). h0 -> h1 never fails.
    Once over SWIM (seeded by h0), once over etcd (in a fifth namespace)."""
    with lan_members(backend, 4, tmp_path) as (hosts, keys):
        try:
            four_hosts_scenario(hosts, keys, tmp_path, procs, DEAD_WITHIN_BY[backend])
        finally:
            stop_all(procs)  # before etcd and the namespaces go
