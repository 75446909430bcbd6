"""Prometheus metrics: a daemon with ``metrics`` set serves text that
prometheus-client's own parser reads, and a scrape taken while a client
writes shows the bytes moving on the rail."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import p2pxfer
from daemon_helpers import LOOPBACK, Agent, DaemonProc, Plan, free_port, start_daemon, wait_for
from p2pxfer.kv_plan import KVLayout

SCRAPE_TIMEOUT = 10.0


def http_get(address: str, path: str = "/metrics") -> tuple[int, str]:
    """A bare HTTP GET (no proxies from the environment): status and body."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SCRAPE_TIMEOUT) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample, by sample name (``p2pxfer_rail_bytes_total``, ...)."""
    status, text = http_get(address)
    assert status == 200, text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def rail_bytes(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    return {labels["nic"]: value for labels, value in samples["p2pxfer_rail_bytes_total"]}


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DaemonProc, DaemonProc, str]]:
    port_a, port_b, port_m = free_port(), free_port(), free_port()
    metrics = f"{LOOPBACK}:{port_m}"
    a = start_daemon(tmp_path, "node-a", control_port=port_a, metrics=metrics,
                     peers=[{"name": "node-b", "address": f"{LOOPBACK}:{port_b}"}])
    try:
        b = start_daemon(tmp_path, "node-b", control_port=port_b,
                         peers=[{"name": "node-a", "address": f"{LOOPBACK}:{port_a}"}])
        try:
            yield a, b, metrics
        finally:
            b.stop()
    finally:
        a.stop()


def test_metrics_during_a_transfer(pair: tuple[DaemonProc, DaemonProc, str]) -> None:
    a, b, metrics = pair
    idle = scrape(metrics)
    assert rail_bytes(idle) == {"lo": 0.0}
    assert idle["p2pxfer_client_sessions"] == [({}, 0.0)]

    plan = Plan(seed=7, pieces=512, min_len=4 << 10, max_len=16 << 10, region=16 << 20)
    target = Agent("trio", b.socket, "target")
    initiator = Agent("trio", a.socket, "initiator")
    try:
        target.ok("export", "kv", plan.region)
        # Writes the plan over and over until killed; replies after the first.
        assert initiator.ok("loop", "node-b", "kv", plan, 0x51) == "looping"
        first = rail_bytes(scrape(metrics))["lo"]
        assert first >= plan.scatter().nbytes
        # Scraped again while the loop runs: the rail's bytes keep growing.
        wait_for(lambda: rail_bytes(scrape(metrics))["lo"] > first, "more bytes on lo")
        during = scrape(metrics)
        assert during["p2pxfer_client_sessions"] == [({}, 1.0)]
        pieces = {lb["nic"]: v for lb, v in during["p2pxfer_rail_pieces_total"]}
        assert pieces["lo"] >= plan.pieces
        written = {lb["outcome"]: v for lb, v in during["p2pxfer_write_seconds_count"]}
        assert written["ok"] >= 1
        assert any(v >= 1 for _, v in during["p2pxfer_registration_cache_misses_total"])
        peers = {lb["state"]: v for lb, v in during["p2pxfer_peers"]}
        assert sum(peers.values()) == 1
        # The rail pair the writes use is up; nothing failed over.
        assert [v for lb, v in during["p2pxfer_rail_pair_up"] if lb["nic"] == "lo"] == [1.0]
        assert during["p2pxfer_rail_failovers_total"] == [({}, 0.0)]
    finally:
        initiator.kill()
        target.close()
    assert a.alive() and b.alive()


def test_small_client_writes_take_the_express_path(
        pair: tuple[DaemonProc, DaemonProc, str]) -> None:
    """A client's writes of a few pieces, one at a time, run on the sending
    daemon's express path (``engine/_express.py``): counted in ``status``
    and the metrics, every byte checked by the agent."""
    a, b, metrics = pair
    plan = Plan(seed=8, pieces=16, min_len=4 << 10, max_len=8 << 10, region=1 << 20)
    target = Agent("trio", b.socket, "target")
    initiator = Agent("trio", a.socket, "initiator")
    try:
        target.ok("export", "small", plan.region)
        for _ in range(20):
            assert initiator.ok("write", "node-b", "small", plan, 0x52) == plan.pieces
        target.ok("verify", "small", plan, 0x52, 20 * plan.pieces)
        express = {lb["outcome"]: v for lb, v in scrape(metrics)["p2pxfer_express_writes_total"]}
        assert express["completed"] + express["handed_over"] >= 20, express
        assert express["completed"] >= 10, express
    finally:
        initiator.close()
        target.close()
    assert a.alive() and b.alive()


def test_metrics_paths_and_bad_scrapers(pair: tuple[DaemonProc, DaemonProc, str]) -> None:
    a, _, metrics = pair
    assert http_get(metrics, "/nope")[0] == 404
    status, text = http_get(metrics, "/")
    assert status == 200 and "p2pxfer_rail_bytes_total" in text
    host, port = metrics.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SCRAPE_TIMEOUT) as s:
        s.sendall(b"BREW /coffee HTCPCP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 400")
    for _ in range(3):  # connections reset mid-request
        s = socket.create_connection((host, int(port)), timeout=SCRAPE_TIMEOUT)
        s.sendall(b"GET /met")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    assert http_get(metrics)[0] == 200
    assert a.alive(), a.log_tail()


def test_a_kv_push_counts_as_a_transfer(pair: tuple[DaemonProc, DaemonProc, str]) -> None:
    """A KV push goes through the write path's bookkeeping: it is counted in
    the write metrics (and in ``transfers_in_flight`` while it runs), as a
    plain write is."""
    from p2pxfer.client import SyncClient
    from p2pxfer.kv import KVLayout

    a, b, metrics = pair
    layout = KVLayout(num_layers=4, num_blocks=16, block_bytes=4096)

    def pushed() -> float:
        return sum(v for lb, v in scrape(metrics).get("p2pxfer_write_seconds_count", [])
                   if lb["outcome"] == "ok")

    with SyncClient(b.socket) as decode, SyncClient(a.socket) as prefill:
        decode.kv_pool("kv", layout)
        src = prefill.kv_pool("kv-src", layout, receive=False)
        before = pushed()
        prefill.kv_push("node-b", "kv", src, [1, 2, 3], [4, 5, 6], request=1)
        assert pushed() == before + 1
        assert prefill.status()["transfers_in_flight"] == 0


def test_kv_pool_bytes_by_kind_and_path(pair: tuple[DaemonProc, DaemonProc, str]) -> None:
    """``p2pxfer_kv_pool_bytes{kind,path}``: a client's host pool counts as
    host; the device rows (staged, direct: ``tests/gpu``) are there, at 0."""
    a, _, metrics = pair
    layout = KVLayout(2, 16, 4096)

    def pools() -> dict[tuple[str, str], float]:
        return {(lb["kind"], lb["path"]): v
                for lb, v in scrape(metrics)["p2pxfer_kv_pool_bytes"]}

    assert pools() == {("host", "host"): 0.0, ("cuda", "staged"): 0.0, ("cuda", "direct"): 0.0}
    with p2pxfer.SyncClient(a.socket) as client:
        client.kv_pool("metrics-kv", layout)
        assert pools() == {("host", "host"): float(layout.nbytes), ("cuda", "staged"): 0.0,
                           ("cuda", "direct"): 0.0}
