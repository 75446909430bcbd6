"""A daemon's client tells a write's outcomes apart: each outcome a caller
must act on has its own wire code and class (``proto/PROTOCOL.md``, "Error
codes"), not one ``transfer_failed`` for all. The round trip of every code is
in ``tests/protocol``; here a real write reaches its deadline through two
daemons."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from daemon_helpers import daemon_pair
from p2pxfer.client import SyncClient
from p2pxfer.errors import PeerUnreachable, TransferAborted, TransferTimeout
from p2pxfer.scatter import ScatterList

DEADLINE_S = 5.0  # also the budget of the writes around it, on a starved machine too
BIG = 32 << 20  # far past what the sockets' buffers hold: it cannot finish unseen


def test_a_write_past_its_deadline_reaches_the_client_as_transfer_timeout(
        tmp_path: Path) -> None:
    with daemon_pair(tmp_path, write_timeout_s=DEADLINE_S) as (a, b), \
            SyncClient(b.socket) as target, SyncClient(a.socket) as writer:
        target.export("r", target.alloc(BIG, "r"))
        src = writer.alloc(BIG, "src")
        writer.write("node-b", "r", ScatterList.contiguous(4096), src=src)  # resolved, connected
        os.kill(b.proc.pid, signal.SIGSTOP)  # its provider stops taking bytes
        try:
            with pytest.raises(TransferTimeout) as got:
                writer.write("node-b", "r", ScatterList.contiguous(BIG), src=src)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        err = got.value
        assert err.code == "transfer_timeout"
        assert isinstance(err, TransferAborted) and isinstance(err, TimeoutError)
        assert not isinstance(err, PeerUnreachable)  # nothing says the peer is gone
        assert "deadline" in str(err) or "timed out" in str(err), err
        # The peer is fine once it runs again: the next write goes through.
        assert writer.write("node-b", "r", ScatterList.contiguous(4096), src=src) >= 1
