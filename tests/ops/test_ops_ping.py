"""``p2pxfer ping PEER`` between two daemons on loopback: every step passes
and says the path; against a peer that is gone it names the step and the
port; an unknown peer is named with the known ones."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import p2pxfer
from daemon_helpers import DaemonProc, daemon_pair, p2pxfer_cmd
from p2pxfer.errors import NameTaken, UnknownPeer

RUN_TIMEOUT = 60.0


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*p2pxfer_cmd(), *args], check=False, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL,
                          env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    with daemon_pair(tmp_path) as daemons:
        yield daemons


def test_ping_passes_and_says_the_path(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    with p2pxfer.SyncClient(a.socket) as client:
        result = client.ping("node-b")
        assert result["ok"], result
        assert result["control_ms"] > 0
        (rail,) = result["rails"]
        assert rail["ok"] and rail["via"] == ["lo"] and rail["peer_nic"] == "lo", rail
        with pytest.raises(UnknownPeer, match="node-c"):
            client.ping("node-c")
        with pytest.raises(NameTaken, match="daemon's own"):  # ping's scratch region
            client.export("p2pxfer.ping", client.alloc(4096))
        assert all(r["name"] != "p2pxfer.ping" for r in b.status()["regions"])
    r = run("ping", "node-a", "--socket", b.socket)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: node-b reaches node-a over 1 rail(s), every byte checked" in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout


def test_ping_names_the_step_and_the_port(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    port = b.control.rsplit(":", 1)[1]
    b.stop()
    r = run("ping", "node-b", "--socket", a.socket, "--timeout", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "control round trip to node-b" in r.stderr, r.stderr
    assert f"tcp port {port} on 127.0.0.1 refuses connections" in r.stderr, r.stderr


@pytest.mark.netns
def test_ping_checks_every_rail(tmp_path: Path) -> None:
    """Two hosts with two NICs each: one verified write per peer rail, each
    carried by our NIC on that rail's subnet."""
    from daemon_helpers import spawn_daemon
    from netns import two_hosts

    (tmp_path / "token").write_text("a secret\n")
    with two_hosts(rails=2) as hosts:
        daemons: list[DaemonProc] = []
        try:
            for i, (host, name) in enumerate(zip(hosts, ("node-a", "node-b"), strict=True)):
                other = hosts[1 - i]
                daemons.append(spawn_daemon(tmp_path, {
                    "node": name, "socket": str(tmp_path / f"{name}.sock"),
                    "control": f"{host.addresses[0]}:7700", "fabric_node": "",
                    "interfaces": list(host.interfaces), "fabric_ports": "7500-7531",
                    "cluster_token_file": str(tmp_path / "token"),
                    "peers": [{"name": "node-b" if i == 0 else "node-a",
                               "address": f"{other.addresses[0]}:7700"}]}, host.exec_argv))
            with p2pxfer.SyncClient(daemons[0].socket) as client:
                result = client.ping("node-b", timeout=20)
        finally:
            for d in daemons:
                d.stop()
    assert result["ok"], result
    rails = result["rails"]
    assert [r["peer_nic"] for r in rails] == list(hosts[1].interfaces), rails
    assert [r["via"] for r in rails] == [[dev] for dev in hosts[0].interfaces], rails
    for rail, address in zip(rails, hosts[1].addresses, strict=True):
        assert rail["peer_rail"].startswith(f"{address}:75"), rail
