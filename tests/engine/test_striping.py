"""Multi-shard striping that uses every NIC, and rails paired by reachability.

- In one process (no root): two engines whose two shards (NUMA nodes 0 and 1)
  each hold one rail on loopback. A write from a buffer registered on node 0
  goes through shard 0 only, yet reaches *both* of the target's NICs; the
  buffer is registered on that shard alone.
- Across two "hosts" (network namespaces, ``netns.two_hosts``): each has two
  veth NICs on two subnets, put on nodes 0 and 1 with ``numa_override``.
  Writes from a node-0 and a node-1 source leave through both of the
  initiator's NICs and land on both of the target's.
- ``lo`` is never a rail towards a remote peer: with ``lo`` and one veth per
  host, every byte goes veth to veth, none to the peer's 127.0.0.1.
- ``pair_rails`` on made-up addresses: loopback only within a host, every
  peer rail covered, non-IP providers paired in turn.
"""

from __future__ import annotations

import json
import mmap
import socket
import struct
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from test_rails_netns import CHILD_PROTOCOL, child

from netns import two_hosts
from p2pxfer.engine import EngineConfig, open_engine_on
from p2pxfer.engine._pairing import pair_rails
from p2pxfer.errors import DescriptorError
from p2pxfer.fabric import getinfo
from p2pxfer.memory import RailDescriptor, RegionDescriptor, numa_node_of
from p2pxfer.scatter import ScatterList
from p2pxfer.topology import Nic, Topology
from p2pxfer.topology import Shard as TopologyShard

LOOPBACK = "127.0.0.1"
STEP = 20.0
TEST_TIMEOUT = 45.0


def sockaddr(ip: str, port: int = 5000) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) \
        + socket.inet_aton(ip) + bytes(8)


# -- pairing on made-up addresses ------------------------------------------------------

def test_loopback_rails_pair_all_ways_within_a_host() -> None:
    # One loopback rail of ours, two of a peer on this host: both take traffic.
    assert pair_rails([(sockaddr(LOOPBACK), "lo")],
                      [sockaddr(LOOPBACK, 1), sockaddr(LOOPBACK, 2)]) == [(0, 0), (0, 1)]
    assert pair_rails([(sockaddr(LOOPBACK, 1), "lo"), (sockaddr(LOOPBACK, 2), "lo")],
                      [sockaddr(LOOPBACK, 3)]) == [(0, 0), (1, 0)]


def test_a_remote_peers_loopback_rail_is_never_a_target() -> None:
    # The peer's other address (TEST-NET-3) is not ours: it is remote, so its
    # 127.0.0.1 is not the 127.0.0.1 we could reach.
    remote = [sockaddr(LOOPBACK), sockaddr("203.0.113.9")]
    assert pair_rails([(sockaddr(LOOPBACK), "lo")], remote) == []


def test_addresses_that_are_not_ip_pair_in_turn() -> None:
    shm = [b"fi_shm://1:0:0\0", b"fi_shm://1:0:1\0"]
    assert pair_rails([(shm[0], "shm")], shm) == [(0, 0), (0, 1)]
    assert pair_rails([(shm[0], "shm"), (shm[1], "shm")], shm[:1]) == [(0, 0), (1, 0)]


# -- two shards in one process ---------------------------------------------------------

def two_node_topology() -> Topology:
    info = getinfo("tcp;ofi_rxm", node=LOOPBACK, domain="lo")[0]
    nics = tuple(Nic(info.provider, info.domain_name, info.fabric_name, node, info)
                 for node in (0, 1))
    return Topology(nics, tuple(TopologyShard(n.numa_node, (n,), ()) for n in nics))


async def test_a_shard_writes_to_every_nic_of_a_two_shard_target() -> None:
    config = EngineConfig(provider="tcp;ofi_rxm", node=LOOPBACK)
    async with open_engine_on(two_node_topology(), config) as a, \
            open_engine_on(two_node_topology(), config) as b:
        target = np.zeros(8 << 20, np.uint8)
        desc = b.export(target, "two")
        assert [r.numa for r in desc.rails] == [0, 1]
        again = RegionDescriptor.from_bytes(desc.to_bytes())
        assert again == desc
        src = np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8)
        a.register(src, numa_node=1)
        regs = a.statistics().registrations
        assert [r.entries for r in regs] == [0, 1], "registered only on node 1's shard"
        sl = ScatterList.contiguous(4 << 20, dst=1 << 20)
        with trio.fail_after(STEP):
            n = await a.write(src, again, sl, imm=21)
            await b.wait_imm(21, n)
        assert (target[1 << 20:5 << 20] == src).all()
        sent = {(s.shard, s.pieces) for s in a.statistics().nics}
        assert sent == {(0, 0), (1, n)}, sent
        received = [s.received for s in b.statistics().nics]
        assert all(r > 0 for r in received) and sum(received) == n, received
        # A buffer for node 0 goes to node 0's shard.
        other = np.ones(4096, np.uint8)
        a.register(other, numa_node=0)
        assert [r.entries for r in a.statistics().registrations] == [1, 1]


async def test_without_a_hint_the_page_s_numa_node_picks_the_shard() -> None:
    touched = np.ones(1 << 16, np.uint8)  # its pages exist: the kernel knows their node
    node = numa_node_of(touched.ctypes.data)
    if node not in (0, 1):
        pytest.skip(f"move_pages gives no node 0/1 for a touched page here ({node})")
    config = EngineConfig(provider="tcp;ofi_rxm", node=LOOPBACK)
    async with open_engine_on(two_node_topology(), config) as a:
        a.register(touched)
        want = [0, 0]
        want[node] = 1
        assert [r.entries for r in a.statistics().registrations] == want
        # Never touched: no node yet, so the shard with fewer registered bytes.
        fresh = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)  # a new anonymous mapping
        assert numa_node_of(fresh.ctypes.data) == -1
        a.register(fresh)
        want[1 - node] += 1
        assert [r.entries for r in a.statistics().registrations] == want
        # Touched now, its node is known: registering again keeps it where it is.
        fresh[:] = 1
        a.register(fresh)
        assert [r.entries for r in a.statistics().registrations] == want


def test_a_four_element_rail_from_an_older_peer_still_reads() -> None:
    old = {"v": 1, "name": "r", "node": "", "inc": 0, "len": 4096,
           "rails": [["tcp;ofi_rxm", sockaddr(LOOPBACK), 7, 0]]}
    (rail,) = RegionDescriptor.from_wire(old).rails
    assert (rail.key, rail.numa) == (7, -1)


# -- two hosts -------------------------------------------------------------------------

_PRELUDE = """\
import json, sys
import numpy as np
import trio
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.memory import RailDescriptor, RegionDescriptor, numa_node_of
from p2pxfer.scatter import ScatterList

""" + CHILD_PROTOCOL + """\
NAMES = sys.argv[1].split(",")
MODE = "@MODE@"
"""

TARGET = _PRELUDE + textwrap.dedent("""
    def config():
        if MODE == "lo":
            return EngineConfig(provider="tcp;ofi_rxm", interfaces=("lo", NAMES[0]))
        return EngineConfig(provider="tcp;ofi_rxm", interfaces=tuple(NAMES),
                            numa_override={n: i for i, n in enumerate(NAMES)})

    async def main():
        async with open_engine(config()) as engine:
            region = np.zeros(8 << 20, np.uint8)
            say("descriptor", engine.export(region, "r").to_bytes().hex())
            imm, count = map(int, (await read_line()).split())
            with trio.fail_after(30):
                await engine.wait_imm(imm, count)
            st = engine.statistics()
            say("result", json.dumps({
                "received": {n.name: n.received for n in st.nics},
                "low": int(region[:4 << 20].min()), "high": int(region[4 << 20:].min()),
            }))
            await read_line()

    trio.run(main)
""")

INITIATOR = _PRELUDE + textwrap.dedent("""
    def config():
        if MODE == "lo":
            return EngineConfig(provider="tcp;ofi_rxm", interfaces=("lo", NAMES[0]))
        return EngineConfig(provider="tcp;ofi_rxm", interfaces=tuple(NAMES),
                            numa_override={n: i for i, n in enumerate(NAMES)})

    async def main():
        async with open_engine(config()) as engine:
            sources = [np.full(4 << 20, 1, np.uint8), np.full(4 << 20, 2, np.uint8)]
            for node, s in enumerate(sources):
                engine.register(s, numa_node=node)
            desc = RegionDescriptor.from_bytes(bytes.fromhex(await read_line()))
            pieces = 0
            with trio.fail_after(30):
                for i, s in enumerate(sources):
                    pieces += await engine.write(s, desc, ScatterList.contiguous(
                        4 << 20, dst=i << 22), imm=77)
            st = engine.statistics()
            say("stats", json.dumps({
                "pieces": pieces,
                "nics": {n.name: {"bytes": n.bytes, "shard": n.shard} for n in st.nics},
                "entries": [r.entries for r in st.registrations],
                "failed": st.failed,
            }))
            await read_line()

    trio.run(main)
""")


def exchange(tmp_path: Path, mode: str) -> tuple[dict[str, Any], dict[str, Any], Any, Any]:
    rails = 1 if mode == "lo" else 2
    with two_hosts(rails=rails) as (a, b), ExitStack() as stack:
        deadline = time.monotonic() + TEST_TIMEOUT
        target = stack.enter_context(child("target", a, TARGET.replace("@MODE@", mode),
                                           tmp_path))
        descriptor = target.expect("descriptor", deadline)
        initiator = stack.enter_context(child("initiator", b,
                                              INITIATOR.replace("@MODE@", mode), tmp_path))
        initiator.send(descriptor)
        stats: dict[str, Any] = json.loads(initiator.expect("stats", deadline))
        target.send(f"77 {stats['pieces']}")
        result: dict[str, Any] = json.loads(target.expect("result", deadline))
        for c in (target, initiator):
            c.send("bye")
        for c in (target, initiator):
            c.finish(deadline)
        return stats, result, a, b


@pytest.mark.netns
def test_two_shards_each_side_use_every_nic(tmp_path: Path) -> None:
    stats, result, a, b = exchange(tmp_path, "")
    assert stats["failed"] == 0, stats
    assert result["low"] == 1 and result["high"] == 2, result
    assert stats["entries"] == [1, 1], "each source registered on its own node's shard only"
    sent = stats["nics"]
    assert [sent[n]["shard"] for n in b.interfaces] == [0, 1], sent
    assert all(sent[n]["bytes"] == 4 << 20 for n in b.interfaces), sent
    received = result["received"]
    assert all(received[n] > 0 for n in a.interfaces), received
    assert sum(received.values()) == stats["pieces"], received


@pytest.mark.netns
def test_lo_is_never_a_rail_towards_a_remote_peer(tmp_path: Path) -> None:
    stats, result, a, b = exchange(tmp_path, "lo")
    assert stats["failed"] == 0, stats
    assert result["low"] == 1 and result["high"] == 2, result
    sent = stats["nics"]
    assert sent["lo"]["bytes"] == 0 and sent[b.interfaces[0]]["bytes"] == 8 << 20, sent
    received = result["received"]
    assert received["lo"] == 0 and received[a.interfaces[0]] == stats["pieces"], received


def test_a_descriptor_no_rail_reaches_is_refused() -> None:
    with pytest.raises(DescriptorError, match="reaches"):
        trio.run(_write_to_unreachable)


async def _write_to_unreachable() -> None:
    config = EngineConfig(provider="tcp;ofi_rxm", node=LOOPBACK)
    async with open_engine_on(two_node_topology(), config) as a:
        src = np.ones(4096, np.uint8)
        a.register(src)
        desc = RegionDescriptor("far", 4096, tuple(
            RailDescriptor("tcp;ofi_rxm", addr, 1, 0)
            for addr in (sockaddr(LOOPBACK), sockaddr("203.0.113.9"))))
        await a.write(src, desc, ScatterList.contiguous(16))


async def test_a_shard_that_fails_to_start_stops_the_started_ones_before_closing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A poller thread that cannot start (no threads left) fails the open;
    the shards started before it have their pollers stopped before their
    CQs and fds are closed, never under a running poller."""
    from p2pxfer.engine._shard import Shard

    seen: list[Shard] = []
    start = Shard.start

    def start_once(self: Shard) -> None:
        seen.append(self)
        if len(seen) > 1:
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(Shard, "start", start_once)
    config = EngineConfig(provider="tcp;ofi_rxm", node=LOOPBACK)
    with trio.fail_after(STEP), pytest.raises(RuntimeError, match="can't start new thread"):
        async with open_engine_on(two_node_topology(), config):
            raise AssertionError("opened")
    assert len(seen) == 2
    assert seen[0].thread_done.is_set(), "the started poller was still running"
    assert seen[0].thread_error is None
