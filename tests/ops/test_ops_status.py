"""``status`` shows peers with their state, each rail's provider, address and
NUMA node, and notes for slow paths; ``peers`` shows state and last-heard,
also for static peers (the state of the control connection to each)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import p2pxfer
from daemon_helpers import LOOPBACK, DaemonProc, free_port, start_daemon
from p2pxfer.cli import main
from p2pxfer.errors import P2PXferError
from p2pxfer.topology import faster_providers, is_loopback


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "250"})


@pytest.fixture
def trio_of_nodes(tmp_path: Path) -> Iterator[tuple[DaemonProc, DaemonProc, str]]:
    """node-a knowing node-b (running) and node-c (a port nobody listens on)."""
    port_a, port_b, dead = free_port(), free_port(), f"{LOOPBACK}:{free_port()}"
    a = start_daemon(tmp_path, "node-a", control_port=port_a,
                     peers=[{"name": "node-b", "address": f"{LOOPBACK}:{port_b}"},
                            {"name": "node-c", "address": dead}])
    try:
        b = start_daemon(tmp_path, "node-b", control_port=port_b)
        try:
            yield a, b, dead
        finally:
            b.stop()
    finally:
        a.stop()


def test_static_peer_states(trio_of_nodes: tuple[DaemonProc, DaemonProc, str]) -> None:
    a, _, dead = trio_of_nodes
    links = {link["name"]: link for link in a.status()["links"]}
    assert links == {}  # nobody asked yet
    r = cli("peers", "--socket", a.socket)
    assert r.exit_code == 0, r.output
    assert r.output.count("not contacted") == 2 and "never" in r.output

    # Asking every peer for a region dials both: b answers, c refuses.
    with p2pxfer.SyncClient(a.socket) as client, contextlib.suppress(P2PXferError):
        client.locate("nowhere")
    links = {link["name"]: link for link in a.status()["links"]}
    assert links["node-b"]["state"] == "connected"
    assert links["node-b"]["last_heard_s"] is not None and links["node-b"]["error"] == ""
    assert links["node-c"]["state"] == "unreachable"
    assert links["node-c"]["last_heard_s"] is None and links["node-c"]["error"]

    r = cli("peers", "--socket", a.socket)
    assert r.exit_code == 0, r.output
    row_b = next(line for line in r.output.splitlines() if "node-b" in line)
    row_c = next(line for line in r.output.splitlines() if "node-c" in line)
    assert "connected" in row_b and "s ago" in row_b
    assert "unreachable" in row_c and dead in row_c and "never" in row_c


def test_status_shows_peers_rails_and_notes(
        trio_of_nodes: tuple[DaemonProc, DaemonProc, str]) -> None:
    a, _, _ = trio_of_nodes
    st = a.status()
    (rail,) = st["rails"]
    assert rail["nic"] == "lo" and rail["provider"] == "tcp;ofi_rxm"
    assert LOOPBACK in rail["address"] and rail["numa_node"] >= 0
    assert any("rail lo is a loopback interface" in n for n in st["notes"])
    assert "daemon.slow_path" in a.log.read_text()

    r = cli("status", "--socket", a.socket)
    assert r.exit_code == 0, r.output
    host_port = rail["address"].split("://", 1)[1]  # the table shows it as host:port
    for word in ("peers", "node-b", "node-c", "not contacted", "tcp;ofi_rxm", host_port,
                 "NUMA", "note:", "loopback interface"):
        assert word in r.output, (word, r.output)


def test_is_loopback(tmp_path: Path) -> None:
    for name, kind in (("veth0", "1\n"), ("lo2", "772\n")):
        (tmp_path / "class" / "net" / name).mkdir(parents=True)
        (tmp_path / "class" / "net" / name / "type").write_text(kind)
    assert is_loopback("lo", tmp_path)
    assert is_loopback("lo2", tmp_path)
    assert not is_loopback("veth0", tmp_path)
    assert not is_loopback("missing", tmp_path)


def test_faster_providers_only_for_socket_providers() -> None:
    assert faster_providers("shm") == []
    assert faster_providers("efa") == []
    assert set(faster_providers("tcp;ofi_rxm")) <= {"efa", "verbs"}


def test_peer_with_another_token_is_auth_failed(tmp_path: Path) -> None:
    port_a, port_b = free_port(), free_port()
    a = start_daemon(tmp_path, "node-a", control_port=port_a, cluster_token="one-secret",
                     peers=[{"name": "node-b", "address": f"{LOOPBACK}:{port_b}"}])
    try:
        b = start_daemon(tmp_path, "node-b", control_port=port_b, cluster_token="other-secret")
        try:
            with p2pxfer.SyncClient(a.socket) as client, contextlib.suppress(P2PXferError):
                client.locate("anything")
            (link,) = a.status()["links"]
        finally:
            b.stop()
    finally:
        a.stop()
    assert link["state"] == "auth failed" and link["last_heard_s"] is not None
    assert "cluster token" in link["error"]
