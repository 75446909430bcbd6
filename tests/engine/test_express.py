"""The express path (``engine/_express.py``) on real providers: a small write
on a quiet shard, posted and polled for by the trio thread without a
transfer's objects, and the moment it has to become a regular transfer
(budget spent, a piece failed, a completion the poller thread read first).

Two engines in this process over ``tcp;ofi_rxm`` on 127.0.0.1 and ``shm``;
every byte written is checked, every immediate counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from conftest import engine_pair as pair
from conftest import run_child
from p2pxfer.engine import EngineStats
from p2pxfer.errors import TransferError, UnregisteredMemory
from p2pxfer.fabric import CompletionError, Completions
from p2pxfer.scatter import ScatterList

PROVIDERS = ["tcp;ofi_rxm", "shm"]
STEP = 20.0
SIZE = 1 << 20


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pages(rng: np.random.Generator, n: int, page: int = 4096) -> ScatterList:
    """``n`` random pages of ``page`` bytes from and to random slots."""
    slots = SIZE // page
    return ScatterList(rng.choice(slots, n, replace=False).astype(np.int64) * page,
                       rng.choice(slots, n, replace=False).astype(np.int64) * page,
                       np.full(n, page, np.int64))


def apply(image: np.ndarray, src: np.ndarray, sl: ScatterList) -> None:
    for s, d, n in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(), strict=True):
        image[d:d + n] = src[s:s + n]


async def write_loop(provider: str, seed: int, writes: int, most: int,
                     **config: Any) -> EngineStats:
    """``writes`` writes of 1..``most`` random pages one at a time, each
    counted at the target and the whole region checked; the writer's
    statistics after."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, SIZE, dtype=np.uint8)
    region, want = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    async with pair(provider, **config) as (a, b):
        desc = b.export(region, "r")
        a.register(src)
        total = 0
        with trio.fail_after(STEP):
            for k in range(writes):
                sl = pages(rng, 1 + k % most)
                total += await a.write(src, desc, sl, imm=seed)
                apply(want, src, sl)
            await b.wait_imm(seed, total)
        st = a.statistics()
    assert st.completed == writes and st.failed == 0
    assert sum(n.completed for n in st.nics) == sum(n.pieces for n in st.nics) == total
    assert [n.inflight for n in st.nics] == [0] * len(st.nics)
    assert st.in_flight == (0,)
    np.testing.assert_array_equal(region, want)
    return st


async def test_small_writes_on_a_quiet_shard_complete_express(provider: str) -> None:
    st = await write_loop(provider, 1, 40, 64)
    assert st.express >= 35  # the first may connect on the regular path


async def test_an_express_write_past_its_budget_finishes_as_a_regular_one(
        provider: str) -> None:
    """A 1 ns budget: nearly every write becomes a regular transfer with its
    posts and completions so far carried over; none may hang, none may be
    counted twice."""
    st = await write_loop(provider, 2, 200, 8, inline_poll_ns=1, inline_poll_max_ns=0)
    assert st.express_handed_over > 0


async def test_a_write_behind_another_in_flight_takes_the_regular_path(provider: str) -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, SIZE, dtype=np.uint8)
    region = np.zeros(SIZE, np.uint8)
    async with pair(provider) as (a, b):
        desc = b.export(region, "r")
        a.register(src)
        with trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(4096), imm=1)
            express = a.statistics().express
            # The target reads nothing until the short write is posted, and
            # the long one ends only once the target acknowledged its
            # notification: it is surely in flight then, however the
            # machine's load falls.
            for shard in b.shards:
                shard._poller.hold(True)  # test-only reach: a mute target
            try:
                long = await a.submit(src, desc, ScatterList.contiguous(SIZE // 2), imm=2,
                                      notify=True)
                short = ScatterList.contiguous(4096, SIZE // 2, SIZE // 2)
                assert not long.done
                got: list[int] = []
                async with trio.open_nursery() as nursery:
                    async def short_write() -> None:
                        got.append(await a.write(src, desc, short, imm=3))

                    nursery.start_soon(short_write)
                    # Decided and posted as the task starts; the target may
                    # read again once it waits for its completion.
                    await trio.testing.wait_all_tasks_blocked()
                    for shard in b.shards:
                        shard._poller.hold(False)
            finally:
                for shard in b.shards:
                    shard._poller.hold(False)
            assert got == [1]
            await long.wait()
            for imm in (1, 2, 3):  # landed (a completion means sent, not placed)
                await b.wait_imm(imm, 1)
        assert a.statistics().express == express  # neither went express
        np.testing.assert_array_equal(region[:SIZE // 2 + 4096], src[:SIZE // 2 + 4096])


async def test_a_failed_express_write_raises_and_leaves_nothing_in_flight() -> None:
    """Delivery-complete writes into a region the target unexported fail
    piece by piece (tcp; shm never answers them): the error entry ends the
    express poll, the write becomes a regular one and fails as such."""
    src = np.ones(SIZE, np.uint8)
    async with pair("tcp;ofi_rxm", delivery_complete=True) as (a, b):
        a.register(src)
        desc = b.export(np.zeros(SIZE, np.uint8), "r")
        with trio.fail_after(STEP):
            await a.write(src, desc, ScatterList.contiguous(4096))
        b.unexport("r")
        handed = a.statistics().express_handed_over
        with trio.fail_after(STEP), pytest.raises(TransferError):
            await a.write(src, desc, pages(np.random.default_rng(4), 16))
        st = a.statistics()
        assert st.express_handed_over > handed and st.failed == 1
        assert sum(n.errors for n in st.nics) > 0
        assert [n.inflight for n in st.nics] == [0] * len(st.nics)


async def test_a_cancelled_express_write_posts_nothing(provider: str) -> None:
    src = np.ones(SIZE, np.uint8)
    region = np.zeros(SIZE, np.uint8)
    async with pair(provider) as (a, b):
        a.register(src)
        desc = b.export(region, "r")
        with trio.CancelScope() as cs:
            cs.cancel()
            await a.write(src, desc, ScatterList.contiguous(4096), imm=5)
        st = a.statistics()
        assert st.completed == st.express == 0
        assert sum(n.pieces for n in st.nics) == 0
        assert not region.any()


async def test_completions_the_poller_thread_reads_first_are_kept() -> None:
    """The poller thread can be inside a CQ read as the hold goes up and take
    an express write's completion (or its error): ``_absorb`` keeps them for
    the write, which counts them once it is handed over."""
    async with pair("tcp;ofi_rxm") as (a, _):
        shard = a.shards[0]
        ex = shard.express
        ex.tid = 12345
        one = np.array
        c = Completions(one([0], np.int32), one([12345], np.uint64), one([0], np.uint64),
                        one([0], np.uint64), one([3], np.int64), one([3 * 4096], np.int64))
        with shard._lock:
            shard._absorb(c)
            assert ex.stolen == 3
            err = CompletionError(0, 12345, 0, 5, "Input/output error")
            shard.piece_error(err)
            assert ex.stolen_error is err
            other = CompletionError(0, 777, 0, 5, "Input/output error")
            shard.piece_error(other)  # nobody's: dropped, as before
            assert ex.stolen_error is err
        ex.tid = -1


async def test_express_plans_follow_what_changes_under_them(provider: str) -> None:
    """A plan (registration, route, peer) is kept per source array and
    destination; a write must still see the source deregistered, a
    registration made anew, and a peer address the rail dropped (a
    teardown moves the AV's epoch: the peer is inserted again, with its
    doorbell on shm)."""
    src = np.arange(SIZE, dtype=np.uint64).view(np.uint8)[:SIZE].copy()
    region = np.zeros(SIZE, np.uint8)
    sl = ScatterList.contiguous(4096)
    async with pair(provider) as (a, b):
        desc = b.export(region, "r")
        a.register(src)
        with trio.fail_after(STEP):
            # A write that outlives its inline budget (a collection, a thread
            # not scheduled: a busy machine) is handed over and not counted:
            # write until two went the express way.
            written = 0
            for _ in range(50):
                await a.write(src, desc, sl, imm=1)
                written += 1
                if a.statistics().express >= 2:
                    break
            express = a.statistics().express
            assert express >= 2
            a.deregister(src)
            with pytest.raises(UnregisteredMemory):
                await a.write(src, desc, sl, imm=1)
            src[:4096] = 7
            a.register(src)
            await a.write(src, desc, sl, imm=1)
            await b.wait_imm(1, written + 1)
            assert (region[:4096] == 7).all()
            rail = a.shards[0]._group.rails[0]  # test-only reach: a teardown
            epoch = rail.av.epoch
            rail.disconnect(desc.rails[0].address)
            # tcp: the peer left the AV, the plan looks it up again; shm
            # keeps it (``Rail.disconnect``).
            assert (rail.av.epoch != epoch) == (provider != "shm")
            src[:4096] = 9
            for _ in range(50):
                await a.write(src, desc, sl, imm=1)
                await b.wait_imm(1, 1)
                if a.statistics().express >= express + 1:
                    break
            assert (region[:4096] == 9).all()
        assert a.statistics().express >= express + 1


async def test_express_plans_hold_nothing_alive_and_count_as_uses() -> None:
    """A plan holds its array and registration weakly; a write through a
    plan is a use of the registration (the least recently used one is
    evicted, not the one written all along); a source that cannot be kept
    (a bytearray) still goes the express way."""
    import gc
    import weakref

    sl = ScatterList.contiguous(4096)
    async with pair("tcp;ofi_rxm", cache_entries=2) as (a, b):
        desc = b.export(np.zeros(SIZE, np.uint8), "r")
        with trio.fail_after(STEP):
            hot, other, third = (np.full(SIZE, i, np.uint8) for i in (1, 2, 3))
            a.register(hot)
            await a.write(hot, desc, sl, imm=1)
            a.register(other)  # entries: hot, other
            await a.write(hot, desc, sl, imm=1)  # through its plan: hot is the last used
            a.register(third)  # evicts the least recently used: other
            await a.write(hot, desc, sl, imm=1)
            with pytest.raises(UnregisteredMemory):
                await a.write(other, desc, sl, imm=1)

            gone = np.ones(SIZE, np.uint8)
            a.register(gone)
            await a.write(gone, desc, sl, imm=1)
            ref = weakref.ref(gone)
            a.deregister(gone)
            del gone
            gc.collect()
            assert ref() is None, "an express plan kept a deregistered buffer alive"

            raw = bytearray(b"\x05" * 8192)
            a.register(raw)
            express = a.statistics().express
            written = 0
            for _ in range(50):  # until one went the express way (a busy
                # machine hands some over: ``test_express_plans_follow...``)
                await a.write(raw, desc, sl, imm=1)
                written += 1
                if a.statistics().express > express:
                    break
            assert a.statistics().express == express + 1
            await b.wait_imm(1, 4 + written)


def write_again_to_a_peer_gone_before_the_first(results: Any) -> None:
    """Child: a writes to c (c's address is the first a's rail inserts),
    then twice to b, which closed before a's first write to it."""
    from p2pxfer import BlockingEngine
    from p2pxfer.errors import P2PXferError

    got = []
    try:
        with BlockingEngine.open("shm") as a, BlockingEngine.open("shm") as c:
            src = np.ones(4096, np.uint8)
            a.register(src)
            c_region = np.zeros(1 << 20, np.uint8)
            a.write(src, c.export(c_region, "c"), ScatterList.contiguous(4096), imm=1)
            c.wait_imm(1, 1)
            b = BlockingEngine.open("shm")
            try:
                desc = b.export(np.zeros(4096, np.uint8), "b")
            finally:
                b.close()
            for _ in range(2):
                try:
                    a.write(src, desc, ScatterList.contiguous(4096), imm=2, timeout=30)
                    got.append("no error")
                except P2PXferError as exc:
                    got.append(f"{type(exc).__name__}: {exc}")
            landed = int(np.count_nonzero(c_region))
            results.put((got, landed))
    except BaseException:
        import traceback

        results.put((got, traceback.format_exc()))


def run_in_child(target: Any) -> Any:
    """``target(results)`` in a spawned process: what it put, once its exit
    code was checked."""
    import multiprocessing as mp

    code, got = run_child(mp.get_context("spawn"), target)
    assert code == 0, f"the child died with exit code {code}: {got}"
    return got


def test_a_write_retried_to_a_shm_peer_that_was_never_reached_raises_again() -> None:
    """A failed first look-up of a peer leaves the plan to look again: the
    retry raises too, and posts nothing anywhere (not to the rail's first
    peer, whose address a plan that took the failed look-up's epoch would
    have posted to)."""
    got, landed = run_in_child(write_again_to_a_peer_gone_before_the_first)
    assert len(got) == 2, got
    for g in got:
        assert g.startswith("PeerUnreachable") and "is gone" in g, got
    assert landed == 4096, f"the other peer's region changed: {landed} bytes set"


def write_after_the_peer_closed(results: Any) -> None:
    """Child (shm crashes a process that posts to a peer whose segment is
    gone): express writes to a peer, the peer closes, one more write."""
    from p2pxfer import BlockingEngine
    from p2pxfer.errors import P2PXferError

    try:
        with BlockingEngine.open("shm") as a:
            src = np.ones(4096, np.uint8)
            a.register(src)
            b = BlockingEngine.open("shm")
            try:
                desc = b.export(np.zeros(4096, np.uint8), "r")
                for _ in range(50):  # until two went the express way (a busy
                    # machine hands some over: ``test_express_plans_follow...``)
                    a.write(src, desc, ScatterList.contiguous(4096), imm=1)
                    if a.statistics().express >= 2:
                        break
                express = a.statistics().express
            finally:
                b.close()
            try:
                a.write(src, desc, ScatterList.contiguous(4096), imm=1, timeout=30)
            except P2PXferError as exc:
                results.put((express, f"{type(exc).__name__}: {exc}"))
            else:
                results.put((express, "no error"))
    except BaseException:
        import traceback

        results.put((0, traceback.format_exc()))


def test_an_express_write_to_a_shm_peer_that_closed_raises() -> None:
    """The peer's segment is looked at on every express write, plan or no
    plan: gone, the write raises ``PeerUnreachable`` naming it, and the
    writer lives on."""
    express, got = run_in_child(write_after_the_peer_closed)
    assert express >= 2, got
    assert got.startswith("PeerUnreachable") and "is gone" in got, got


def _serve_a_region(desc_q: Any, go_q: Any) -> None:
    """Child: export a region over shm, hand its descriptor over, close once told."""
    from p2pxfer import BlockingEngine

    with BlockingEngine.open("shm") as b:
        desc_q.put(b.export(np.zeros(SIZE, np.uint8), "r").to_bytes())
        go_q.get(timeout=60)


def test_an_express_write_to_a_shm_peer_process_that_closed_raises() -> None:
    """A peer in another process closes its engine and exits between two
    express writes: the next one raises ``PeerUnreachable`` (a 4 KiB shm
    write into the closed peer's queue would complete as if it had landed),
    and the segment's descriptor the plan held is closed once the peer was
    found gone. (A peer killed outright leaves its segment: membership's to
    find.)"""
    import contextlib
    import multiprocessing as mp
    import os

    from p2pxfer import BlockingEngine
    from p2pxfer.errors import PeerUnreachable
    from p2pxfer.memory import RegionDescriptor

    ctx = mp.get_context("spawn")
    desc_q, go_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_serve_a_region, args=(desc_q, go_q))
    child.start()
    try:
        desc = RegionDescriptor.from_bytes(desc_q.get(timeout=60))
        segment = os.path.realpath("/dev/shm/" + desc.rails[0].address.rstrip(b"\0")
                                   .decode().removeprefix("fi_shm://"))

        def held() -> int:
            links = []
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):  # the listing's own fd is gone
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
            return sum(link.startswith(segment) for link in links)

        with BlockingEngine.open("shm") as a:
            src = np.ones(4096, np.uint8)
            a.register(src)
            for _ in range(50):
                a.write(src, desc, ScatterList.contiguous(4096), imm=1)
                if a.statistics().express >= 2:
                    break
            assert a.statistics().express >= 2
            assert held() == 1
            go_q.put(True)
            child.join(60)
            assert child.exitcode == 0
            for _ in range(2):  # the plan looks again, and raises again
                with pytest.raises(PeerUnreachable, match="is gone"):
                    a.write(src, desc, ScatterList.contiguous(4096), imm=1, timeout=10)
            assert held() == 0
    finally:
        child.kill()
        child.join()
