"""Cancellation crosses the socket: a cancelled (or timed-out) client call
tells the daemon, which stops serving it before the call returns.

Two daemons (node-a, node-b: tcp on loopback, each other's peer) in their own
processes, trio clients here. Repros of issue 13, item 3:

(a) ``wait_imm(77, 1)`` times out on the client; one piece with imm 77
    arrives; a second ``wait_imm(77, 1)`` must return (the abandoned waiter
    must not have taken it).
(b) a 64 MiB write cancelled after a few ms, its source refilled with another
    pattern at once: nothing of the new pattern may reach the target (the
    daemon no longer reads the buffer once the call has returned), and the
    write's immediates must not all arrive (it did not complete).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

import p2pxfer
from daemon_helpers import LOOPBACK, DaemonProc, free_port, start_daemon
from p2pxfer.errors import WaitTimeout
from p2pxfer.scatter import ScatterList

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    workdir = tmp_path_factory.mktemp("cancel")
    port_a, port_b = free_port(), free_port()
    daemons: list[DaemonProc] = []
    try:
        daemons.append(start_daemon(workdir, "node-a", control_port=port_a, peers=[
            {"name": "node-b", "address": f"{LOOPBACK}:{port_b}"}]))
        daemons.append(start_daemon(workdir, "node-b", control_port=port_b, peers=[
            {"name": "node-a", "address": f"{LOOPBACK}:{port_a}"}]))
        yield daemons[0], daemons[1]
    finally:
        for d in daemons:
            d.stop()
    for d in daemons:
        assert "request.crashed" not in d.log.read_text(), d.log_tail()


async def test_abandoned_wait_imm_takes_nothing(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """Repro (a), with the caller's own cancel scope and with ``timeout=``."""
    a, b = pair
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(b.socket) as target, p2pxfer.connect(a.socket) as writer:
            dst = await target.alloc(1 << 16, "cancel-a")
            await target.export("cancel-a", dst)
            src = await writer.alloc(4096, "cancel-a-src")
            src.array[:] = 7
            one = ScatterList(np.array([0]), np.array([0]), np.array([4096]))
            for imm, abandon in ((77, "scope"), (78, "timeout")):
                if abandon == "scope":
                    with trio.move_on_after(0.2) as scope:
                        await target.wait_imm(imm, 1)
                    assert scope.cancelled_caught
                else:
                    with pytest.raises(WaitTimeout):
                        await target.wait_imm(imm, 1, timeout=0.2)
                assert await writer.write("node-b", "cancel-a", one, src=src, imm=imm) == 1
                with trio.fail_after(10):
                    await target.wait_imm(imm, 1)
            st = await target.status()
            assert st["transfers_in_flight"] == 0


async def test_cancelled_write_stops_reading_the_buffer(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    """Repro (b): a cancelled 64 MiB write returns only once node-a no longer
    reads its source; refilling the source then changes nothing at the target."""
    a, b = pair
    size, piece = 64 << 20, 16 << 10
    n = size // piece
    offsets = np.arange(n, dtype=np.int64) * piece
    scatter = ScatterList(offsets, offsets, np.full(n, piece, np.int64))
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(b.socket) as target, p2pxfer.connect(a.socket) as writer:
            dst = await target.alloc(size, "cancel-b")
            await target.export("cancel-b", dst)
            src = await writer.alloc(size, "cancel-b-src")
            src.array[:] = 0xAA
            with trio.move_on_after(0.005) as scope:
                await writer.write("node-b", "cancel-b", scatter, src=src, imm=91)
            assert scope.cancelled_caught, "the write finished before it could be cancelled"
            src.array[:] = 0xBB  # the call returned: the buffer is ours again
            # Whatever node-a had posted lands; nothing more is posted.
            with pytest.raises(WaitTimeout):
                await target.wait_imm(91, n, timeout=1.0)
            got = dst.array
            assert not np.any(got == 0xBB), (
                f"{int(np.count_nonzero(got == 0xBB))} bytes of the refilled buffer "
                "reached the target after the cancelled write returned")
            landed = int(np.count_nonzero(got == 0xAA))
            assert landed % piece == 0 and landed < size, landed
            # The daemon serves on: a whole write of the new pattern lands.
            assert await writer.write("node-b", "cancel-b", scatter, src=src, imm=92) == n
            await target.wait_imm(92, n, timeout=20)
            assert np.all(dst.array == 0xBB)
            assert (await writer.status())["transfers_in_flight"] == 0


def test_sync_client_wait_imm_timeout(pair: tuple[DaemonProc, DaemonProc],
                                      tmp_path: Path) -> None:
    """The blocking facade: a timed-out wait leaves no waiter behind either."""
    a, b = pair
    with p2pxfer.SyncClient(b.socket) as target, p2pxfer.SyncClient(a.socket) as writer:
        dst = target.alloc(4096, "cancel-sync")
        target.export("cancel-sync", dst)
        src = writer.alloc(4096, "cancel-sync-src")
        with pytest.raises(WaitTimeout):
            target.wait_imm(55, 1, timeout=0.1)
        one = ScatterList(np.array([0]), np.array([0]), np.array([4096]))
        writer.write("node-b", "cancel-sync", one, src=src, imm=55)
        target.wait_imm(55, 1, timeout=10)
