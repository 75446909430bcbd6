"""``fabric_ports`` / ``--fabric-ports``: the fabric listens inside a fixed
range (so a firewall can be written), checked at start with one line each:
malformed, too small for the rails, taken, or for a provider without ports."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_helpers import LOOPBACK, DaemonProc, p2pxfer_cmd, start_daemon
from p2pxfer.daemon import DaemonConfig
from p2pxfer.errors import ConfigError
from p2pxfer.fabric._ports import parse_port_range

RUN_TIMEOUT = 60.0


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*p2pxfer_cmd(), *args], check=False, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)


def free_range(n: int) -> tuple[int, int]:
    """``n`` consecutive ports free on loopback now."""
    for _ in range(200):
        low = random.randrange(20000, 30000)
        socks = []
        try:
            for port in range(low, low + n):
                s = socket.socket()
                socks.append(s)
                s.bind((LOOPBACK, port))
            return low, low + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} free consecutive ports")


def base(tmp_path: Path) -> list[str]:
    return ["daemon", "--node", "a", "--socket", str(tmp_path / "a.sock"),
            "--fabric-node", LOOPBACK]


@pytest.mark.parametrize("text", ["7500", "75x-7600", "7600-7500", "0-10", "7500-70000"])
def test_malformed_range_exits_78(tmp_path: Path, text: str) -> None:
    r = run(*base(tmp_path), "--fabric-ports", text)
    assert r.returncode == 78, r.stderr
    assert "fabric_ports" in r.stderr and "LOW-HIGH" in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="fabric_ports"):
        DaemonConfig.from_dict({"fabric_ports": text})


def test_range_for_a_provider_without_ports(tmp_path: Path) -> None:
    r = run(*base(tmp_path), "--provider", "shm", "--fabric-ports", "7500-7531")
    assert r.returncode == 78, r.stderr
    assert "fabric_ports is for the tcp provider" in r.stderr, r.stderr


def test_port_in_use_is_named(tmp_path: Path) -> None:
    low, high = free_range(2)
    with socket.socket() as a, socket.socket() as b:
        a.bind((LOOPBACK, low))
        a.listen()
        b.bind((LOOPBACK, high))
        b.listen()
        r = run(*base(tmp_path), "--fabric-ports", f"{low}-{high}")
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert f"{low}, {high} are in use" in lines[0] and "--fabric-ports" in lines[0], lines[0]


@pytest.fixture
def ranged(tmp_path: Path) -> Iterator[tuple[DaemonProc, tuple[int, int]]]:
    low, high = free_range(4)
    d = start_daemon(tmp_path, "ranged", fabric_ports=f"{low}-{high}")
    try:
        yield d, (low, high)
    finally:
        d.stop()


def test_fabric_listens_inside_the_range(ranged: tuple[DaemonProc, tuple[int, int]]) -> None:
    d, (low, high) = ranged
    st = json.loads(run("status", "--socket", d.socket, "--json").stdout)
    ports = [int(r["address"].rsplit(":", 1)[1]) for r in st["rails"]]
    assert ports and all(low <= p <= high for p in ports), (ports, low, high)
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True,
                               check=True, timeout=10).stdout
    for port in ports:
        assert f"{LOOPBACK}:{port} " in listening, listening
    assert parse_port_range(f"{low}-{high}") == (low, high)
