"""Deadlines, aborts and isolation between peers, on loopback (no root).

A "stalled" peer here is an engine whose poller is held off its CQs
(``Poller.hold``): on tcp;ofi_rxm a target that does not progress takes no
more data once the socket buffers are full, and says nothing, just like a
silent host. Covered:

- a write to a stalled peer fails with ``TransferTimeout`` within its
  timeout (or ``EngineConfig.write_timeout_s``), naming acknowledged pieces;
  its connection is torn down and made anew: the next write works, and no NIC
  shows pieces in flight;
- meanwhile writes to another peer complete (no head-of-line blocking);
- a cancelled write to a stalled peer ends within ``cancel_grace_s``;
- ``Transfer.abort`` ends a write with ``TransferAborted`` and its reason;
- failed pieces leave no NIC ``inflight`` behind;
- bad timeouts are refused; ``wait_imm(timeout=)`` keeps what arrived;
- a client's ``write(timeout=)`` to a frozen peer (SIGSTOP) raises
  ``WaitTimeout`` in time;
- a ``SyncClient`` made inside a running event loop is refused (it would hang).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from conftest import engine_config, inflight, stall
from p2pxfer.client import SyncClient, connect
from p2pxfer.engine import Engine, open_engine
from p2pxfer.errors import (
    InvalidArgument,
    TransferAborted,
    TransferError,
    TransferTimeout,
    UsageError,
    WaitTimeout,
)
from p2pxfer.scatter import ScatterList
from p2pxfer.testing import LOOPBACK, DaemonProc, free_port, start_daemon

PROVIDER = "tcp;ofi_rxm"
BIG = 64 << 20  # far more than loopback's socket buffers hold
STEP = 20.0


@asynccontextmanager
async def engines(n: int, **kw: Any) -> AsyncIterator[list[Engine]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(open_engine(engine_config(PROVIDER, **kw)))
               for _ in range(n)]


async def test_a_write_to_a_stalled_peer_times_out_and_the_peer_works_again() -> None:
    src = np.random.default_rng(3).integers(0, 256, BIG, dtype=np.uint8)
    async with engines(2) as (a, b):
        a.register(src)
        target = np.zeros(BIG, np.uint8)
        desc = b.export(target, "r")
        with trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(4096), imm=1)  # connected
        stall(b, True)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout) as info:
            with trio.fail_after(STEP):
                await a.write(src, desc, ScatterList.contiguous(BIG), imm=2, timeout=1.5)
        took = time.monotonic() - t0
        assert 1.4 <= took <= 3.0, took
        err = info.value
        assert isinstance(err, TimeoutError) and isinstance(err, TransferError)
        assert err.pieces > 0 and 0 <= err.completed < err.pieces
        assert err.not_completed == err.pieces - err.completed
        assert f"{err.completed} of {err.pieces} pieces acknowledged" in str(err)
        assert a.statistics().failed == 1
        assert inflight(a) == [0] * len(inflight(a)), a.statistics().nics
        stall(b, False)
        # Torn down and connected anew: the peer takes writes again.
        with trio.fail_after(STEP):
            n = await a.write(src, desc, ScatterList.contiguous(1 << 20, dst=4096), imm=3)
            await b.wait_imm(3, n)
        assert (target[4096:4096 + (1 << 20)] == src[:1 << 20]).all()


async def test_the_configured_default_deadline_applies() -> None:
    src = np.ones(BIG, np.uint8)
    async with engines(2, write_timeout_s=1.0) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(BIG, np.uint8), "r")
        with trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(4096))
        stall(b, True)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout), trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(BIG))
        assert time.monotonic() - t0 <= 2.5
        stall(b, False)


async def test_a_stalled_peer_never_holds_up_writes_to_another() -> None:
    # Without the per-peer bound (``peer_pieces``) this fails: the stuck
    # write fills the NIC's TX queue and every other peer's writes wait.
    src = np.random.default_rng(4).integers(0, 256, BIG, dtype=np.uint8)
    async with engines(3) as (a, b, c):
        a.register(src)
        to_b = b.export(np.zeros(BIG, np.uint8), "b")
        target = np.zeros(8 << 20, np.uint8)
        to_c = c.export(target, "c")
        sl = ScatterList.contiguous(8 << 20)
        with trio.fail_after(STEP):
            await a.write(src, to_b, ScatterList.contiguous(4096))
            await a.write(src, to_c, sl)
        stall(b, True)
        # More pieces than a NIC's TX queue holds (tcp;ofi_rxm: 2048).
        many = BIG // (16 << 10)
        pages = ScatterList(np.arange(many, dtype=np.int64) << 14,
                            np.arange(many, dtype=np.int64) << 14, np.full(many, 16 << 10))
        stuck = await a.submit(src, to_b, pages, timeout=STEP)
        await trio.sleep(0.2)
        for i in range(5):
            with trio.fail_after(STEP):
                n = await a.write(src, to_c, sl, imm=10 + i)
                await c.wait_imm(10 + i, n)
        assert not stuck.done, "the stalled write finished: the test proves nothing"
        # The stuck peer holds all the NIC TX queue it may: the writes to c
        # went out beside it (a full queue would have held them to STEP).
        assert max(inflight(a)) == a.config.peer_pieces, inflight(a)
        assert (target == src[:8 << 20]).all()
        stuck.abort("test is done")
        with trio.fail_after(5), pytest.raises(TransferAborted, match="test is done"):
            await stuck.wait()
        stall(b, False)


async def test_a_cancelled_write_to_a_stalled_peer_ends_within_the_grace() -> None:
    src = np.ones(BIG, np.uint8)
    async with engines(2, cancel_grace_s=0.5) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(BIG, np.uint8), "r")
        with trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(4096))
        stall(b, True)
        t0 = time.monotonic()
        with trio.move_on_after(0.5) as scope:
            await a.write(src, desc, ScatterList.contiguous(BIG), timeout=STEP)
        assert scope.cancelled_caught
        assert time.monotonic() - t0 <= 2.5  # 0.5 s, then 0.5 s of grace, then torn down
        assert a.statistics().failed == 1
        assert inflight(a) == [0] * len(inflight(a))
        stall(b, False)


async def test_abort_fails_the_write_with_its_reason() -> None:
    src = np.ones(BIG, np.uint8)
    async with engines(2) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(BIG, np.uint8), "r")
        stall(b, True)
        tr = await a.submit(src, desc, ScatterList.contiguous(BIG))
        await trio.sleep(0.2)
        tr.abort("membership says the peer died")
        with trio.fail_after(5), pytest.raises(TransferAborted) as info:
            await tr.wait()
        assert not isinstance(info.value, TransferTimeout)
        assert "membership says the peer died" in str(info.value)
        assert "torn down" in str(info.value)
        stall(b, False)


async def test_failed_pieces_leave_nothing_in_flight() -> None:
    # With delivery-complete, a write into a region the target unexported
    # fails piece by piece at the initiator.
    src = np.ones(1 << 20, np.uint8)
    async with engines(2, delivery_complete=True) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(1 << 20, np.uint8), "r")
        with trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(4096))
        b.unexport("r")
        pages = ScatterList(np.arange(64, dtype=np.int64) * 4096,
                            np.arange(64, dtype=np.int64) * 4096, np.full(64, 4096, np.int64))
        with trio.fail_after(STEP), pytest.raises(TransferError):
            await a.write(src, desc, pages)
        nics = a.statistics().nics
        assert sum(n.errors for n in nics) > 0, nics
        assert [n.inflight for n in nics] == [0] * len(nics), nics


@pytest.mark.parametrize("bad", [0, -1, "1", True, float("nan")])
async def test_a_bad_timeout_is_refused(bad: Any) -> None:
    src = np.ones(4096, np.uint8)
    async with engines(2) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(4096, np.uint8), "r")
        with pytest.raises(InvalidArgument, match="timeout"):
            await a.write(src, desc, ScatterList.contiguous(4096), timeout=bad)
        with pytest.raises(InvalidArgument, match="timeout"):
            await a.submit(src, desc, ScatterList.contiguous(4096), timeout=bad)
        assert await a.write(src, desc, ScatterList.contiguous(4096), timeout=5) == 1


async def test_a_sync_client_inside_a_trio_loop_is_refused() -> None:
    # It used to hang forever: its calls block the loop its portal needs.
    with pytest.raises(UsageError, match="trio event loop"):
        SyncClient("/nonexistent/p2pxfer.sock")


def test_a_sync_client_inside_an_asyncio_loop_is_refused() -> None:
    async def make() -> None:
        SyncClient("/nonexistent/p2pxfer.sock")

    with pytest.raises(UsageError, match="asyncio event loop"):
        asyncio.run(make())


async def test_wait_imm_with_a_timeout_keeps_what_arrived() -> None:
    src = np.ones(4096, np.uint8)
    async with engines(2) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(4096, np.uint8), "r")
        with trio.fail_after(STEP):
            assert await a.write(src, desc, ScatterList.contiguous(4096), imm=5) == 1
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="only 1 of 2 pieces with immediate 5"):
            await b.wait_imm(5, 2, timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 <= 2.0
        assert b.imm_count(5) == 1  # still counted for a later wait
        assert b.statistics().imms_awaited == 0
        with pytest.raises(InvalidArgument, match="timeout"):
            await b.wait_imm(5, 1, timeout=-1)
        with trio.fail_after(STEP):
            await b.wait_imm(5, 1, timeout=5)


def test_a_client_write_to_a_frozen_peer_ends_with_its_timeout(tmp_path: Path) -> None:
    # node-b is SIGSTOPped: its sockets stay open and say nothing (a silent peer).
    port_a, port_b = free_port(), free_port()
    daemons: list[DaemonProc] = []
    try:
        daemons.append(start_daemon(tmp_path, "node-a", control_port=port_a, peers=[
            {"name": "node-b", "address": f"{LOOPBACK}:{port_b}"}], write_timeout_s=2.0))
        daemons.append(start_daemon(tmp_path, "node-b", control_port=port_b, peers=[
            {"name": "node-a", "address": f"{LOOPBACK}:{port_a}"}]))
        a, b = daemons

        async def main() -> None:
            async with connect(b.socket) as cb, connect(a.socket) as ca:
                dst = await cb.alloc(BIG)
                await cb.export("r", dst)
                src = await ca.alloc(BIG)
                sl = ScatterList.contiguous(BIG)
                with trio.fail_after(STEP):
                    await ca.write("node-b", "r", ScatterList.contiguous(4096), src=src)
                b.proc.send_signal(signal.SIGSTOP)
                try:
                    # No timeout of the client's: the daemon's write_timeout_s ends it.
                    t0 = time.monotonic()
                    with pytest.raises(TransferError) as failed, trio.fail_after(STEP):
                        await ca.write("node-b", "r", sl, src=src)
                    assert 1.5 <= time.monotonic() - t0 <= 5.0, failed.value
                    # The client's own timeout ends a write sooner (here one that
                    # must resolve the region again: the failed write dropped it).
                    t0 = time.monotonic()
                    with pytest.raises(WaitTimeout, match="'r' on 'node-b'"), \
                            trio.fail_after(STEP):
                        await ca.write("node-b", "r", sl, src=src, timeout=1.0)
                    assert time.monotonic() - t0 <= 3.0
                    with pytest.raises(InvalidArgument, match="timeout"):
                        await ca.write("node-b", "r", sl, src=src, timeout=0)
                finally:
                    b.proc.send_signal(signal.SIGCONT)

        trio.run(main)
    finally:
        for d in daemons:
            d.stop()
