"""Notify mode: one immediate per write, sent once every byte landed.

``write(..., imm=X, notify=True)``: the pieces carry no immediate, the last
piece of each rail pair's share is delivery-complete, and one small write
carries X once all are acknowledged. The receiver must count exactly one X
per write (never one per piece, never two), on tcp and shm, striped over two
target NICs too; the bytes must be there when the count arrives. Per-piece
writes keep counting pieces. Rail failures under notify writes are in
``test_failover_netns.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from test_striping import two_node_topology

from conftest import engine_config
from conftest import engine_pair as pair
from p2pxfer.engine import BlockingEngine, EngineConfig, open_engine_on
from p2pxfer.errors import InvalidArgument, TransferError
from p2pxfer.loopback import loopback_node
from p2pxfer.scatter import ScatterList

PROVIDERS = ["tcp;ofi_rxm", "shm"]
STEP = 20.0
IMM = 0xFEED_BEEF  # 32 bits, as EFA and verbs carry: passed on unchanged


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pages(n: int, size: int, stride: int) -> ScatterList:
    """``n`` pages of ``size`` bytes, packed at the source, ``stride`` apart
    at the target."""
    i = np.arange(n, dtype=np.int64)
    return ScatterList(i * size, i * stride, np.full(n, size, np.int64))


async def settle() -> None:
    """Give a stray second immediate the time to arrive, if one were sent."""
    await trio.sleep(0.2)


async def test_each_write_counts_one_immediate_once_landed(provider: str) -> None:
    src = np.random.default_rng(1).integers(0, 256, 4096 * 64, dtype=np.uint8)
    async with pair(provider, imm_bytes=4) as (a, b):
        region = np.zeros(2 * len(src), np.uint8)
        desc = b.export(region, "r")
        a.register(src)
        with trio.fail_after(STEP):
            # One small write, then a long list (the poller's, not the trio
            # thread's), then one whose single piece the engine splits.
            for sl in (ScatterList.contiguous(100), pages(64, 4096, 8192),
                       ScatterList.contiguous(len(src), dst=len(src))):
                region[:] = 0
                t = await a.submit(src, desc, sl, imm=IMM, notify=True)
                assert t.imms == 1
                assert await t.wait() == t.pieces
                await b.wait_imm(IMM, 1)
                # The count came after the bytes: they are all there now.
                want = np.zeros_like(region)
                n = sl.length
                within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
                want[np.repeat(sl.dst, n) + within] = src[np.repeat(sl.src, n) + within]
                assert np.array_equal(region, want)
            await settle()
        assert b.imm_count(IMM) == 0, "a notify write was counted more than once"
        # ``write`` returns what the receiver counts: 1.
        with trio.fail_after(STEP):
            assert await a.write(src, desc, pages(64, 4096, 8192), imm=IMM, notify=True) == 1
            await b.wait_imm(IMM, 1)
        assert a.statistics().failed == 0
        # Data pieces carry no immediate: the target saw one arrival per write.
        assert sum(n.received for n in b.statistics().nics) == 4


async def test_many_notify_writes_in_flight_count_exactly(provider: str) -> None:
    src = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    async with pair(provider) as (a, b):
        region = np.zeros(1 << 20, np.uint8)
        desc = b.export(region, "r")
        a.register(src)
        writes = 40
        with trio.fail_after(STEP):
            k = np.arange(16, dtype=np.int64)
            # Write i: 16 pages of 1 KiB from its own 16 KiB of the source, to
            # column i of 16 rows of 64 KiB.
            handles = [await a.submit(src, desc, ScatterList(
                k * 1024 + i * 16384, k * 65536 + i * 1024, np.full(16, 1024, np.int64)),
                imm=7, notify=True) for i in range(writes)]
            for t in handles:
                await t.wait()
            await b.wait_imm(7, writes)
            await settle()
        assert b.imm_count(7) == 0, "more immediates than writes arrived"
        got = region.reshape(16, 64, 1024)[:, :writes]
        want = src[:writes * 16384].reshape(writes, 16, 1024).transpose(1, 0, 2)
        assert np.array_equal(got, want)


async def test_per_piece_writes_still_count_pieces(provider: str) -> None:
    src = np.ones(64 * 4096, np.uint8)
    async with pair(provider) as (a, b):
        region = np.zeros(2 * len(src), np.uint8)
        desc = b.export(region, "r")
        a.register(src)
        with trio.fail_after(STEP):
            t = await a.submit(src, desc, pages(64, 4096, 8192), imm=9)
            assert t.imms == t.pieces == 64
            assert await t.wait() == 64
            await b.wait_imm(9, 64)
            assert await a.write(src, desc, pages(64, 4096, 8192)) == 64  # no imm
            await settle()
        assert b.imm_count(9) == 0


async def test_notify_without_an_immediate_is_refused() -> None:
    async with pair("tcp;ofi_rxm") as (a, b):
        src = np.ones(4096, np.uint8)
        desc = b.export(np.zeros(4096, np.uint8), "r")
        a.register(src)
        with pytest.raises(InvalidArgument, match="notify"):
            await a.write(src, desc, ScatterList.contiguous(4096), notify=True)
        assert a.statistics().nics[0].pieces == 0


async def test_striped_over_two_target_nics_one_immediate() -> None:
    """A write from one shard to a two-NIC target goes out as two cursors
    (one per target NIC), each with its delivery-complete tail: still one
    immediate, after both."""
    config = EngineConfig(provider="tcp;ofi_rxm", node="127.0.0.1")
    async with open_engine_on(two_node_topology(), config) as a, \
            open_engine_on(two_node_topology(), config) as b:
        region = np.zeros(8 << 20, np.uint8)
        desc = b.export(region, "two")
        src = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
        a.register(src, numa_node=0)
        for round_ in range(3):
            region[:] = 0
            with trio.fail_after(STEP):
                t = await a.submit(src, desc, ScatterList.contiguous(4 << 20, dst=1 << 20),
                                   imm=IMM, notify=True)
                await t.wait()
                await b.wait_imm(IMM, 1)
            assert np.array_equal(region[1 << 20:5 << 20], src), round_
            assert t.pieces >= 8
        await settle()
        assert b.imm_count(IMM) == 0
        received = [n.received for n in b.statistics().nics]
        assert sum(received) == 3, f"one arrival with an immediate per write: {received}"
        sent = [n.bytes for n in a.statistics().nics if n.shard == 0]
        assert sent == [3 * (4 << 20) + 3 * 8], "data once, plus 8 bytes per notification"


def test_blocking_engine_notify(provider: str) -> None:
    node = loopback_node(provider)
    with BlockingEngine(engine_config(provider)) as a, \
            BlockingEngine(EngineConfig(provider=provider, node=node)) as b:
        src = np.arange(1 << 16, dtype=np.uint8)
        region = np.zeros(1 << 16, np.uint8)
        desc = b.export(region, "r")
        a.register(src)
        assert a.write(src, desc, pages(16, 4096, 4096), imm=5, notify=True, timeout=STEP) == 1
        b.wait_imm(5, 1, timeout=STEP)
        assert np.array_equal(region, src)


async def test_a_cancelled_notify_write_is_never_counted(provider: str) -> None:
    """A notify write that stops before its end sends no notification: the
    receiver counts nothing for it (its pieces may have landed)."""
    src = np.ones(4096 * 1024, np.uint8)
    async with pair(provider) as (a, b):
        region = np.zeros(len(src), np.uint8)
        desc = b.export(region, "r")
        a.register(src)
        cancelled = 0
        for _ in range(5):  # until a cancel lands before the write's end
            with trio.fail_after(STEP):
                t = await a.submit(src, desc, pages(1024, 4096, 4096), imm=11, notify=True)
                t.cancel()
                try:
                    await t.wait()
                    counted = 1  # the poller thread finished it first (rare)
                except TransferError as exc:
                    assert "cancelled" in str(exc)
                    counted = 0
                await settle()
            assert b.imm_count(11) == counted
            if counted:
                await b.wait_imm(11, 1)
            else:
                cancelled += 1
                break
        assert cancelled == 1
        # The next notify write to the same peer counts once, as usual.
        with trio.fail_after(STEP):
            assert await a.write(src, desc, pages(16, 4096, 4096), imm=11, notify=True) == 1
            await b.wait_imm(11, 1)
            await settle()
        assert b.imm_count(11) == 0


async def test_many_small_pieces_in_flight(provider: str) -> None:
    """Tens of thousands of 64-byte pieces in notify writes, many in flight:
    all land, one immediate each (delivery-complete on every shm piece
    stalled here: 1629 of 3500 acknowledged, then nothing until the
    deadline; now shm, like tcp, makes only each pair's tail delivery-complete)."""
    n, writes = 3500, 8
    src = np.random.default_rng(7).integers(0, 256, n * 64, dtype=np.uint8)
    async with pair(provider) as (a, b):
        region = np.zeros(2 * n * 64, np.uint8)
        desc = b.export(region, "small")
        a.register(src)
        order = np.random.default_rng(8).permutation(n).astype(np.int64)
        sl = ScatterList(np.arange(n, dtype=np.int64) * 64, order * 128,
                         np.full(n, 64, np.int64))
        with trio.fail_after(STEP):
            ts = [await a.submit(src, desc, sl, imm=IMM, notify=True) for _ in range(writes)]
            for t in ts:
                await t.wait()
            await b.wait_imm(IMM, writes)
        got = region.reshape(-1, 128)[order, :64]
        assert np.array_equal(got, src.reshape(-1, 64))
        await settle()
        assert b.imm_count(IMM) == 0


async def test_notify_early_sends_the_notification_behind_its_data_to_a_one_pair_peer() -> None:
    """``notify_early`` (KV pushes ask for it): to a peer reached over one
    rail pair at all, on a rail that places one peer's writes in order
    (tcp;ofi_rxm), the notification goes right behind the data, however
    large, instead of waiting for the data's acknowledgement. Without it a
    write over ``EAGER_NOTIFY_BYTES`` waits. Shown against a target that
    does not read: the C reference target progresses only while told to, so
    nothing can be acknowledged; once it reads, each write completes with
    exactly one immediate counted there."""
    from p2pxfer.bench._reference import ReferenceTarget
    from p2pxfer.bench._server import pick_interfaces
    from p2pxfer.engine import open_engine
    from p2pxfer.engine._failover import EAGER_NOTIFY_BYTES, landed

    tcp = "tcp;ofi_rxm"
    node = loopback_node(tcp)
    names = pick_interfaces(tcp, node, 1, None)
    size = 4 << 20
    with ReferenceTarget(tcp, node, names, size) as target:
        async with open_engine(EngineConfig(provider=tcp, node=node, interfaces=names)) as a:
            src = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
            a.register(src)
            # Connected first, while the target reads (one piece, its immediate).
            target.expect([1], STEP)
            with trio.fail_after(STEP):
                assert await a.write(src, target.descriptor, ScatterList.contiguous(64),
                                     imm=1) == 1
            await trio.to_thread.run_sync(target.collect, STEP)
            shard = a.shards[0]
            seen: list[list[bool]] = []
            notify = shard._failover.notify

            def spy(tr: object, t: object, wake_fd: int) -> None:
                b = tr.w.batch  # type: ignore[attr-defined]
                seen.append([landed(tr, i) for i in range(len(b))])  # type: ignore[arg-type]
                notify(tr, t, wake_fd)  # type: ignore[arg-type]

            shard._failover.notify = spy  # type: ignore[method-assign]
            data = pages(32, 64 << 10, 64 << 10)
            assert data.nbytes > EAGER_NOTIFY_BYTES
            # Without notify_early the notification waits for the data's
            # acknowledgement, which a target that does not read never sends.
            t = await a.submit(src, target.descriptor, data, imm=2, notify=True)
            await trio.sleep(0.3)
            assert seen == [] and not t.done
            target.expect([1], STEP)
            with trio.fail_after(STEP):
                assert await t.wait() == 32 and t.imms == 1
            await trio.to_thread.run_sync(target.collect, STEP)
            assert seen == [[True]]
            seen.clear()
            t = await a.submit(src, target.descriptor, data, imm=3, notify=True,
                               notify_early=True)
            with trio.fail_after(STEP):
                while not seen:
                    await trio.sleep(0.005)
            assert seen == [[False]], "the notification waited for its data to land"
            assert not t.done
            target.expect([1], STEP)  # the notification: the one arrival with data
            with trio.fail_after(STEP):
                assert await t.wait() == 32 and t.imms == 1
            await trio.to_thread.run_sync(target.collect, STEP)
            with pytest.raises(InvalidArgument, match="notify_early needs notify"):
                await a.submit(src, target.descriptor, data, imm=3, notify_early=True)
