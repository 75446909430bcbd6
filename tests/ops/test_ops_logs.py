"""Logs for operators: JSON lines on request, repeats rate-limited, failures
that name the peer, region and client, a warning for every slow path."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

import p2pxfer
from daemon_helpers import LOOPBACK, free_port, start_daemon
from p2pxfer.errors import P2PXferError
from p2pxfer.log import MAX_FIELD_CHARS, RateLimiter, cut_long_values
from p2pxfer.scatter import ScatterList


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def passes(limiter: RateLimiter, method: str = "info", **fields: Any) -> dict[str, Any] | None:
    try:
        return dict(limiter(None, method, {"event": "peer.retry", **fields}))
    except structlog.DropEvent:
        return None


def test_rate_limit_holds_repeats_back() -> None:
    clock = Clock()
    limiter = RateLimiter(burst=3, window=10.0, clock=clock)
    assert all(passes(limiter, peer="b") for _ in range(3))
    assert [passes(limiter, peer="b") for _ in range(4)] == [None] * 4
    # another subject, and errors, are never held back by b's repeats
    assert passes(limiter, peer="c") is not None
    assert passes(limiter, "error", peer="b") is not None
    assert passes(limiter, "debug", peer="b") is not None
    assert passes(limiter, "warning", peer="b") is not None  # its own count
    clock.now += 10.0
    line = passes(limiter, peer="b")
    assert line is not None and line["suppressed"] == 4
    line = passes(limiter, peer="b")
    assert line is not None and "suppressed" not in line


def test_hostile_text_is_cut_and_a_flood_from_one_host_is_one_subject() -> None:
    """A client's megabyte region name becomes a line of about a kilobyte
    (and so does the rate limiter's key); lines about connections from one
    host are held back together, whatever their source ports."""
    event = cut_long_values(None, "info", {"event": "request.failed", "region": "r" * (1 << 20),
                                           "raw": b"\0" * 5000, "peer": "b"})
    assert len(event["region"]) < MAX_FIELD_CHARS + 40 and "1048576 characters" in event["region"]
    assert len(event["raw"]) < MAX_FIELD_CHARS + 40 and event["peer"] == "b"
    clock = Clock()
    limiter = RateLimiter(burst=2, window=10.0, clock=clock)
    lines = [passes(limiter, remote=f"10.0.0.9:{40000 + i}") for i in range(6)]
    assert sum(line is not None for line in lines) == 2
    assert passes(limiter, remote="10.0.0.8:40000") is not None


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_json_logs_and_failures_named(tmp_path: Path) -> None:
    port_a, dead = free_port(), f"{LOOPBACK}:{free_port()}"
    a = start_daemon(tmp_path, "node-a", control_port=port_a, log_format="json",
                     peers=[{"name": "node-gone", "address": dead}])
    try:
        with p2pxfer.SyncClient(a.socket) as client:
            src = client.alloc(1 << 16)
            for _ in range(2):
                with pytest.raises(P2PXferError):
                    client.write("node-gone", "kv-lost", ScatterList.contiguous(1 << 12),
                                 src=src)
    finally:
        a.stop()
    lines = json_lines(a.log)  # every line is JSON, or this raises
    events = [x["event"] for x in lines]
    assert "daemon.ready" in events and "daemon.slow_path" in events
    assert all({"level", "timestamp", "event"} <= set(x) for x in lines)
    failed = [x for x in lines if x["event"] == "request.failed"]
    assert len(failed) == 2
    for x in failed:
        assert x["peer"] == "node-gone" and x["region"] == "kv-lost"
        assert x["client"].startswith("pid:") and x["code"] == "peer_unreachable"
        assert dead in x["error"]


def test_shm_backoff_is_a_slow_path(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "shm-node", provider="shm")
    try:
        notes = d.status()["notes"]
    finally:
        d.stop()
    assert any("has no completion wait fd" in n for n in notes), notes
    assert "no completion wait fd" in d.log.read_text()


def test_transfer_failure_names_peer_region_client(tmp_path: Path) -> None:
    """node-a wrote once into node-b's region (its descriptor cached), then
    node-b's daemon is killed: the next write fails in the fabric, and node-a
    logs transfer.failed with the peer, the region and the client."""
    port_a, port_b = free_port(), free_port()
    a = start_daemon(tmp_path, "node-a", control_port=port_a, log_format="json",
                     peers=[{"name": "node-b", "address": f"{LOOPBACK}:{port_b}"}])
    b = start_daemon(tmp_path, "node-b", control_port=port_b)
    try:
        with p2pxfer.SyncClient(b.socket) as target, p2pxfer.SyncClient(a.socket) as client:
            target.export("kv-doomed", target.alloc(1 << 16))
            src = client.alloc(1 << 16)
            client.write("node-b", "kv-doomed", ScatterList.contiguous(1 << 12), src=src)
            b.proc.kill()
            b.proc.wait(10)
            # A plain tcp write completes once its bytes are in the socket:
            # one posted before node-a's provider has read the dead peer's
            # FIN (a busy host) is taken by the half-closed socket and
            # "completes". The peer's reset then fails the next ones.
            deadline = time.monotonic() + 30
            with pytest.raises(P2PXferError):
                while time.monotonic() < deadline:
                    client.write("node-b", "kv-doomed", ScatterList.contiguous(1 << 12),
                                 src=src)
                    time.sleep(0.05)
    finally:
        b.stop()
        a.stop()
    failed = [x for x in json_lines(a.log) if x["event"] == "transfer.failed"]
    assert failed, a.log_tail()
    assert failed[0]["peer"] == "node-b" and failed[0]["region"] == "kv-doomed"
    assert failed[0]["client"].startswith("pid:") and failed[0]["level"] == "warning"
