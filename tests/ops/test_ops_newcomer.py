"""The errors a newcomer hits on the README's paths say what to do next, in
the words they typed (flags and config keys), and a wrong configuration
exits 78 wherever it is found."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

import p2pxfer
from daemon_helpers import LOOPBACK, DaemonProc, p2pxfer_cmd, start_daemon
from p2pxfer.errors import ConnectionLost, ProviderNotFound, WaitTimeout
from p2pxfer.fabric import getinfo
from p2pxfer.fabric._info import providers_here
from p2pxfer.scatter import ScatterList

RUN_TIMEOUT = 60.0


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*p2pxfer_cmd(), *args], check=False, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)


def test_no_socket_says_start_the_daemon(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.sock")
    r = run("status", "--socket", path)
    assert r.returncode == 1, r.stderr
    assert "is the daemon running?" in r.stderr, r.stderr
    assert f"p2pxfer daemon --socket {path}" in r.stderr, r.stderr
    with pytest.raises(ConnectionLost, match="is the daemon running"):
        p2pxfer.SyncClient(path)


def test_stale_socket_says_start_the_daemon(tmp_path: Path) -> None:
    path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:  # bound, never listening: a dead daemon's
        s.bind(path)
    r = run("peers", "--socket", path)
    assert r.returncode == 1, r.stderr
    assert "left by a daemon that stopped" in r.stderr, r.stderr
    assert "is the daemon running?" in r.stderr, r.stderr


def test_missing_provider_lists_this_machines() -> None:
    here = providers_here()
    assert "tcp;ofi_rxm" in here and "shm" in here, here
    with pytest.raises(ProviderNotFound) as info:
        getinfo("efa")
    assert "providers on this machine: " in str(info.value)
    assert "'tcp;ofi_rxm'" in str(info.value) and "'shm'" in str(info.value)
    with pytest.raises(ProviderNotFound, match="is here but not on that address or interface"):
        getinfo("tcp;ofi_rxm", domain="nosuchnic0")


def test_daemon_with_missing_provider_exits_78(tmp_path: Path) -> None:
    r = run("daemon", "--node", "a", "--socket", str(tmp_path / "a.sock"),
            "--fabric-node", LOOPBACK, "--provider", "efa")
    assert r.returncode == 78, r.stderr
    assert "'tcp;ofi_rxm'" in r.stderr, r.stderr


def test_no_credentials_names_flags_and_keys(tmp_path: Path) -> None:
    r = run("daemon", "--node", "a", "--socket", str(tmp_path / "a.sock"),
            "--control", "0.0.0.0:0", "--fabric-node", LOOPBACK)
    assert r.returncode == 78, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    for words in ("--control", "--token-file", "cluster_token_file", "cluster_token",
                  "tls_cert", "--fabric-node 127.0.0.1"):
        assert words in lines[0], (words, lines[0])


def test_bad_peer_flag_exits_78(tmp_path: Path) -> None:
    r = run("daemon", "--node", "a", "--socket", str(tmp_path / "a.sock"), "--peer", "nope")
    assert r.returncode == 78, r.stderr
    assert "--peer" in r.stderr and "name=host:port" in r.stderr, r.stderr


@pytest.fixture
def daemon(tmp_path: Path) -> object:
    d: DaemonProc = start_daemon(tmp_path, "solo")
    try:
        yield d
    finally:
        d.stop()


def test_wait_imm_timeout_says_how_many_came(daemon: DaemonProc) -> None:
    with p2pxfer.SyncClient(daemon.socket) as c:
        dst = c.alloc(1 << 16)
        c.export("kv", dst)
        src = c.alloc(1 << 16)
        src.array[:] = 3
        pages = np.arange(3, dtype=np.int64) * 4096
        n = c.write("solo", "kv", ScatterList(pages, pages, np.full(3, 4096, np.int64)),
                    src=src, imm=7)
        assert n == 3
        with pytest.raises(WaitTimeout) as info:
            c.wait_imm(7, 8, region="kv", timeout=1)
        assert str(info.value) == "3 of 8 arrivals for imm 7 on region 'kv' within 1 s"
        with pytest.raises(WaitTimeout, match="3 of 4 arrivals for imm 7 on this client's"):
            c.wait_imm(7, 4, timeout=0.2)
        c.wait_imm(7, 3, region="kv", timeout=30)  # a timed-out wait consumed nothing
