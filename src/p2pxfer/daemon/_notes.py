"""What ``status`` says about the engine beyond its counters: each rail's
provider, address and NUMA node, and the slow paths this daemon runs on
(a loopback rail, a shm poller that backs off instead of blocking, tcp where
efa or verbs is present), each logged once as a warning at startup.

Read from the engine's shards and rails after it opened; nothing here changes
them. What must not live here: counters (``engine.statistics()``) or metrics.
"""

from __future__ import annotations

from typing import Any

from p2pxfer.engine import Engine
from p2pxfer.log import get_logger
from p2pxfer.topology import faster_providers, is_loopback

__all__ = ["rails", "slow_paths"]

log = get_logger("p2pxfer.daemon")


def rails(engine: Engine) -> list[dict[str, Any]]:
    """One entry per rail: shard, NIC, provider, endpoint address, NUMA node."""
    out = []
    for shard in engine.shards:
        for rail in shard.memory.rails:
            out.append({"shard": shard.index, "nic": rail.name, "provider": rail.provider,
                        "address": rail.av.straddr(rail.address),
                        "numa_node": shard.topo.numa_node})
    return out


def slow_paths(engine: Engine, provider: str, sysfs_root: str = "/sys") -> list[str]:
    """The slow paths of this engine, as notes for ``status``; each is logged
    as a ``daemon.slow_path`` warning (call once, at startup)."""
    notes: list[str] = []
    for shard in engine.shards:
        for rail in shard.memory.rails:
            if is_loopback(rail.name, sysfs_root):
                notes.append(f"rail {rail.name} is a loopback interface: its writes never "
                             f"leave this host (set interfaces or fabric_node for real NICs)")
            if rail.cq.wait_fd < 0:
                notes.append(f"rail {rail.name} ({rail.provider}) has no completion wait fd: "
                             f"its poller sleeps with back-off instead of blocking, which "
                             f"adds latency to the first completion after idle")
    if faster := faster_providers(provider):
        notes.append(f"provider {provider} copies through sockets while "
                     f"{' and '.join(faster)} is present here (set provider)")
    for note in notes:
        log.warning("daemon.slow_path", note=note)
    return notes
