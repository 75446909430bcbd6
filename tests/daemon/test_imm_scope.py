"""Immediate counts are scoped (issue 13, item 4), and fit 32 bits (item 2).

Two daemons in their own processes (tcp on loopback), run once as the
provider allows and once forced to 4-byte immediates (``imm_bytes = 4``, as
EFA and verbs carry). A write's immediate names the destination region's
slot, so its pieces count for the region's owner only:

- a fresh client's ``wait_imm`` never consumes counts left by other clients
  or by departed ones (it returned at once with leftovers);
- ``wait_imm(..., region=)`` counts one region; only its owner may wait on it;
- counts of a departed session are dropped with it;
- values that do not fit beside the slot are refused, not truncated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import trio

import p2pxfer
from daemon_helpers import DaemonProc, daemon_pair
from p2pxfer.errors import InvalidArgument, UnknownRegion, WaitTimeout
from p2pxfer.scatter import ScatterList

TIMEOUT = 30.0


@pytest.fixture(scope="module", params=[0, 4], ids=["native-imm", "imm32"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    extra = {"imm_bytes": request.param} if request.param else {}
    with daemon_pair(tmp_path_factory.mktemp("imms"), **extra) as pair:
        yield pair


def pieces(n: int, size: int = 4096) -> ScatterList:
    off = np.arange(n, dtype=np.int64) * size
    return ScatterList(off, off, np.full(n, size, np.int64))


async def test_counts_belong_to_the_region_owner(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(a.socket) as writer:
            st = await writer.status()
            bits = 32 if b.keys.get("imm_bytes") == 4 else 64
            assert st["imm_bits"] == bits
            src = await writer.alloc(300 * 4096, "scope-src")
            # A client that leaves counts behind: 300 pieces with imm 3 it never waits for.
            async with p2pxfer.connect(b.socket) as leaver:
                await leaver.export("scope-left", await leaver.alloc(300 * 4096, "left"))
                assert await writer.write("node-b", "scope-left", pieces(300), src=src,
                                          imm=3) == 300
                await leaver.wait_imm(3, 1)  # the pieces have started landing
            async with p2pxfer.connect(b.socket) as fresh, \
                    p2pxfer.connect(b.socket) as other:
                # The repro: a fresh client's wait returned at once with leftovers.
                with pytest.raises(WaitTimeout):
                    await fresh.wait_imm(3, 300, timeout=0.5)
                await other.export("scope-other", await other.alloc(16 * 4096, "other"))
                await fresh.export("scope-fresh", await fresh.alloc(16 * 4096, "fresh"))
                # Pieces into other's region never count for fresh, and vice versa.
                await writer.write("node-b", "scope-other", pieces(5), src=src, imm=3)
                await writer.write("node-b", "scope-fresh", pieces(2), src=src, imm=3)
                await other.wait_imm(3, 5, timeout=10)
                await fresh.wait_imm(3, 2, timeout=10, region="scope-fresh")
                with pytest.raises(WaitTimeout):
                    await fresh.wait_imm(3, 1, timeout=0.3, region="scope-fresh")
                # Session-wide and per-region views are consumed apart.
                await fresh.wait_imm(3, 2, timeout=10)
                with pytest.raises(UnknownRegion):
                    await fresh.wait_imm(3, 1, region="scope-other")  # not its region
                # A value that does not fit beside the slot is refused, not cut.
                top = 1 << st["imm_value_bits"]
                with pytest.raises(InvalidArgument):
                    await writer.write("node-b", "scope-fresh", pieces(1), src=src, imm=top)
                with pytest.raises(InvalidArgument):
                    await fresh.wait_imm(top, 1)
                await writer.write("node-b", "scope-fresh", pieces(1), src=src, imm=top - 1)
                await fresh.wait_imm(top - 1, 1, timeout=10)


async def test_departed_session_counts_are_dropped(pair: tuple[DaemonProc, DaemonProc]
                                                   ) -> None:
    """A region exported again under the same name by a new client starts
    from nothing, even where the old one left arrivals unclaimed."""
    a, b = pair
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(a.socket) as writer:
            src = await writer.alloc(8 * 4096, "drop-src")
            async with p2pxfer.connect(b.socket) as first:
                await first.export("scope-again", await first.alloc(8 * 4096, "again1"))
                await writer.write("node-b", "scope-again", pieces(8), src=src, imm=11)
                await first.wait_imm(11, 1, timeout=10)
            async with p2pxfer.connect(b.socket) as second:
                await second.export("scope-again", await second.alloc(8 * 4096, "again2"))
                with pytest.raises(WaitTimeout):
                    await second.wait_imm(11, 1, timeout=0.5)
                await writer.write("node-b", "scope-again", pieces(4), src=src, imm=11)
                await second.wait_imm(11, 4, timeout=10, region="scope-again")


async def test_unclaimed_counts_are_bounded() -> None:
    """In-process: a session keeps at most ``limit`` distinct unclaimed
    counts, dropping the oldest (never one a waiter waits on), and a
    cancelled wait leaves the counts for the next one."""
    from p2pxfer.daemon._imms import ImmCounts

    counts = ImmCounts("test", limit=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(counts.wait, None, 1000, 5)
        await trio.sleep(0.01)
        counts.arrive("r", 1000, 2)  # waited for: kept however many come after
        for value in range(20):
            counts.arrive("r", value, 1)
        assert counts.count(None, 1000) == 2
        assert counts.count("r", 19) == 1 and counts.count("r", 0) == 0
        assert counts.dropped > 0
        counts.arrive("r", 1000, 3)  # the waiter takes its 5
        await trio.sleep(0.01)
        assert counts.count(None, 1000) == 0
    with trio.move_on_after(0.05):
        await counts.wait("r", 19, 2)
    assert counts.count("r", 19) == 1  # the cancelled wait took nothing
    await counts.wait("r", 19, 1)
    assert counts.count("r", 19) == 0


async def test_notify_writes_count_once(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """``write(..., notify=True)``: the owner counts the immediate once per
    write, after all of it landed, through the fabric and through the
    same-daemon copy alike; every byte is there when it arrives."""
    a, b = pair
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(a.socket) as writer, \
                p2pxfer.connect(b.socket) as owner, p2pxfer.connect(b.socket) as local:
            dst = await owner.alloc(256 * 4096, "notify-dst")
            await owner.export("notify", dst)
            for w, seed in ((writer, 1), (local, 2)):
                src = await w.alloc(256 * 4096, f"notify-src-{seed}")
                src.array[:] = np.random.default_rng(seed).integers(
                    0, 256, src.nbytes, dtype=np.uint8)
                assert await w.write("node-b", "notify", pieces(256), src=src, imm=9,
                                     notify=True) == 1
                await owner.wait_imm(9, 1, region="notify", timeout=10)
                assert np.array_equal(dst.array, src.array)
                with pytest.raises(WaitTimeout):  # one arrival per write, not per piece
                    await owner.wait_imm(9, 1, region="notify", timeout=0.3)
            with pytest.raises(InvalidArgument, match="notify needs an imm"):
                await writer.write("node-b", "notify", pieces(1), src=src, notify=True)


def test_notify_from_asyncio_and_blocking_callers(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """The same through an asyncio ``Client`` and a ``SyncClient``."""
    a, b = pair
    with p2pxfer.SyncClient(b.socket) as owner, p2pxfer.SyncClient(a.socket) as writer:
        dst = owner.alloc(64 * 4096, "notify-sync-dst")
        owner.export("notify-sync", dst)
        src = writer.alloc(64 * 4096, "notify-sync-src")
        src.array[:] = 7
        assert writer.write("node-b", "notify-sync", pieces(64), src=src, imm=11,
                            notify=True) == 1
        owner.wait_imm(11, 1, region="notify-sync", timeout=10)
        assert (dst.array == 7).all()

        async def on_asyncio() -> int:
            async with p2pxfer.connect(a.socket) as aw:
                asrc = await aw.alloc(64 * 4096, "notify-aio-src")
                asrc.array[:] = 8
                return await aw.write("node-b", "notify-sync", pieces(64), src=asrc, imm=11,
                                      notify=True)

        assert asyncio.run(asyncio.wait_for(on_asyncio(), TIMEOUT)) == 1
        owner.wait_imm(11, 1, region="notify-sync", timeout=10)
        assert (dst.array == 8).all()
        with pytest.raises(WaitTimeout):
            owner.wait_imm(11, 1, region="notify-sync", timeout=0.3)

