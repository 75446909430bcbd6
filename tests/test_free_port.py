"""``p2pxfer.testing.free_port``: the ports tests start daemons on come from
below the kernel's ephemeral range (an outgoing connection could take a
port from there between the check and the daemon's bind: "Address already
in use"), and each pytest-xdist worker from a slice of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def ports(worker: str, count: str, n: int = 20) -> list[int]:
    env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": count}
    out = subprocess.run([sys.executable, "-c", "from p2pxfer.testing import free_port; "
                          f"print(*(free_port() for _ in range({n})))"],
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    return [int(p) for p in out.stdout.split()]


def test_ports_are_outside_the_ephemeral_range_and_apart_per_worker() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low < 12000:
        pytest.skip(f"the ephemeral range starts at {low}: free_port falls back to bind(0)")
    a, b = ports("gw0", "2"), ports("gw1", "2")
    assert all(p < low for p in a + b)
    assert len(set(a)) == len(a)  # one process never hands a port out twice
    assert max(a) < min(b)  # worker 0's slice lies below worker 1's
