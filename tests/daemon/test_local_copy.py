"""The same-daemon fast path (issue 15, item 5): a write into a region that a
client of the same daemon exported is a copy between the two shared
mappings, not a trip through the provider.

One daemon (tcp on loopback, two copy threads, and a peer ``alias`` that is
its own control port) in its own process; clients here (trio) and in agent
processes. Checked: bytes of random scatter lists, immediate counts exactly
as the reply's ``pieces`` says (inline, threaded and split copies), the
engine's statistics untouched, the same errors as the fabric path, an
unexport or a disconnect racing a large copy (the copy stops, nothing lands
after the unexport answered), cancellation (returns once the source is no
longer read), ``local_copy = false`` sending the write through the
engine again, and a KV push into a pool of this daemon copied layer by
layer and counted as a fabric push is.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import p2pxfer
from daemon_helpers import (
    LOOPBACK,
    Agent,
    DaemonProc,
    Plan,
    RawConn,
    as_uid,
    free_port,
    start_daemon,
)
from p2pxfer.errors import InvalidArgument, ScatterError, UnknownRegion, WaitTimeout
from p2pxfer.kv_plan import KVLayout
from p2pxfer.pages import CopyStop, copy_scatter
from p2pxfer.protocol import pack_scatter
from p2pxfer.scatter import ScatterList
from p2pxfer.testing import scatter_at_random

TIMEOUT = 60.0
NODE = "solo"


@pytest.fixture(scope="module")
def solo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    port = free_port()
    d = start_daemon(tmp_path_factory.mktemp("local"), NODE, control_port=port,
                     local_copy_threads=2,
                     peers=[{"name": "alias", "address": f"{LOOPBACK}:{port}"}])
    try:
        yield d
    finally:
        d.stop()
    text = d.log.read_text()
    assert "request.crashed" not in text and "client.failed" not in text, d.log_tail()


def engine_posted(st: dict[str, Any]) -> tuple[int, int]:
    """(pieces, bytes) the engine has posted on every NIC."""
    return (sum(n["pieces"] for n in st["nics"]), sum(n["bytes"] for n in st["nics"]))


def random_list(rng: np.random.Generator, n: int, region: int, max_len: int
                ) -> ScatterList:
    """``n`` pieces of random lengths at random, non-overlapping places of a
    ``region``-byte destination; sources packed in another random order."""
    length = rng.integers(1, max_len + 1, n, dtype=np.int64)
    return ScatterList(*scatter_at_random(rng, length, region))


def expected(image: np.ndarray, source: np.ndarray, sl: ScatterList) -> np.ndarray:
    out = image.copy()
    for s, d, n in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(), strict=True):
        out[d:d + n] = source[s:s + n]
    return out


# -- the C copy ------------------------------------------------------------------------------

def test_copy_scatter_checks_every_piece_and_stops_between_pieces() -> None:
    src, dst = mmap.mmap(-1, 1 << 16), mmap.mmap(-1, 1 << 16)
    src[:8] = b"abcdefgh"
    off = np.array([0, 4], np.int64)
    two = np.array([4, 4], np.int64)
    assert copy_scatter(dst, src, off, off[::-1].copy(), two, 0, 2, CopyStop()) == 2
    assert dst[:8] == b"efghabcd"
    stop = CopyStop()
    stop.set()
    assert copy_scatter(dst, src, off, off, two, 0, 2, stop) == 0
    # A piece past the destination is refused after the ones before it landed.
    with pytest.raises(ScatterError, match="piece 1"):
        copy_scatter(dst, src, off, np.array([16, (1 << 16) - 2], np.int64), two, 0, 2,
                     CopyStop())
    assert dst[16:20] == b"abcd"
    # Within one buffer, overlapping source and destination (memmove).
    copy_scatter(src, src, np.array([0], np.int64), np.array([2], np.int64),
                 np.array([6], np.int64), 0, 1, CopyStop())
    assert src[:8] == b"ababcdef"


# -- through the daemon ------------------------------------------------------------------------

def test_two_agents_random_pages(solo: DaemonProc) -> None:
    """Two client processes of one daemon: every byte of a seeded random plan
    lands, and the target's imm count is what the writer's reply says; the
    engine posts nothing."""
    before = solo.status()
    plan = Plan(seed=15, pieces=1024, min_len=1 << 10, max_len=48 << 10, region=64 << 20)
    target, writer = Agent("trio", solo.socket, "target"), Agent("asyncio", solo.socket,
                                                                  "writer")
    try:
        assert target.ok("export", "lc-plan", plan.region) == plan.region
        pieces = writer.ok("write", NODE, "lc-plan", plan, 21)
        assert pieces >= plan.pieces
        target.ok("verify", "lc-plan", plan, 21, pieces)
    finally:
        writer.close()
        target.close()
    after = solo.status()
    assert engine_posted(after) == engine_posted(before)
    assert after["local_copy"]["writes"] == before["local_copy"]["writes"] + 1
    assert after["local_copy"]["bytes"] - before["local_copy"]["bytes"] == int(
        plan.columns()[2].sum())


@pytest.mark.parametrize("shape", ["inline", "one-thread", "split", "random"])
async def test_bytes_and_imm_counts_are_exact(solo: DaemonProc, shape: str) -> None:
    region = 32 << 20
    rng = np.random.default_rng(len(shape))
    sl = {"inline": ScatterList.contiguous(4096, 100, 5000),
          "one-thread": ScatterList.contiguous(1 << 20, 7, 1 << 20),
          "split": ScatterList.contiguous(16 << 20, 0, 3),  # cut for the two threads
          "random": random_list(rng, 3000, region, 16 << 10)}[shape]
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as owner, \
                p2pxfer.connect(solo.socket) as writer:
            name = f"lc-exact-{shape}"
            dst = await owner.alloc(region, name)
            await owner.export(name, dst)
            src = await writer.alloc(region, name + "-src")
            source = np.frombuffer(rng.bytes(region), np.uint8)
            src.array[:] = source
            before = await writer.status()
            pieces = await writer.write(NODE, name, sl, src=src, imm=33)
            assert pieces == (8 if shape == "split" else len(sl))
            # Both views (the region's, the session's) count every piece once.
            await owner.wait_imm(33, pieces, region=name, timeout=10)
            await owner.wait_imm(33, pieces, timeout=10)
            for region_view in (name, None):
                with pytest.raises(WaitTimeout):  # not one arrival more
                    await owner.wait_imm(33, 1, region=region_view, timeout=0.2)
            want = expected(np.zeros(region, np.uint8), source, sl)
            assert np.array_equal(dst.array, want)
            after = await writer.status()
            assert engine_posted(after) == engine_posted(before)
            assert after["local_copy"]["pieces"] - before["local_copy"]["pieces"] == pieces
            assert after["transfers_in_flight"] == 0


async def test_same_errors_as_the_fabric_path(solo: DaemonProc) -> None:
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as owner, \
                p2pxfer.connect(solo.socket) as writer:
            await owner.export("lc-errors", await owner.alloc(1 << 16, "lc-errors"))
            src = await writer.alloc(1 << 16, "lc-errors-src")
            before = await writer.status()
            with pytest.raises(ScatterError, match="destination"):
                await writer.write(NODE, "lc-errors", ScatterList.contiguous(4096, 0, 63 << 10),
                                   src=src)
            with pytest.raises(ScatterError, match="source"):
                await writer.write(NODE, "lc-errors",
                                   ScatterList.contiguous(4096, 61 << 10, 0), src=src)
            with pytest.raises(ScatterError):  # the source offset counts too
                await writer.write(NODE, "lc-errors", ScatterList.contiguous(4096), src=src,
                                   src_offset=62 << 10)
            with pytest.raises(UnknownRegion):
                await writer.write(NODE, "lc-nowhere", ScatterList.contiguous(4096), src=src)
            with pytest.raises(InvalidArgument):
                await writer.write(NODE, "lc-errors", ScatterList.contiguous(4096), src=src,
                                   imm=1 << 60)
            after = await writer.status()
            assert after["local_copy"]["writes"] == before["local_copy"]["writes"]
            # Refused before anything moved: the owner saw nothing.
            with pytest.raises(WaitTimeout):
                await owner.wait_imm(0, 1, timeout=0.2)


@pytest.mark.parametrize("peer", [NODE, "alias"])
async def test_a_kv_push_into_a_pool_of_this_daemon_is_a_copy(solo: DaemonProc,
                                                               peer: str) -> None:
    """A KV push into a pool that a client of this same daemon owns (named by
    this node's name or by a peer name that is this daemon) takes the
    same-daemon copy: one copy per layer, nothing posted to the engine,
    every byte of every pushed block in place and nothing else written; the
    receiver counts each layer once, exactly as for a fabric push (its waits
    complete, a layer not pushed does not, the request is over)."""
    lay = KVLayout(4, 64, 16 << 10, planes=2, order="block_major")  # 1 MiB a layer: threads
    rng = np.random.default_rng(23)
    sb = rng.choice(lay.num_blocks, 32, replace=False).astype(np.int64)
    db = rng.choice(lay.num_blocks, 32, replace=False).astype(np.int64)
    pushed = [0, 1, 3]
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as decode, \
                p2pxfer.connect(solo.socket) as prefill:
            name = f"lc-kv-{peer}"
            dst = await decode.kv_pool(name, lay)
            src = await prefill.kv_pool(name + "-src", lay, receive=False)
            src.array[:] = np.frombuffer(rng.bytes(src.array.nbytes), np.uint8)
            before = await prefill.status()
            push = await prefill.kv_push(peer, name, src, sb, db, request=3, layers=pushed)
            result = await push.wait()
            await dst.wait_layers(3, 3, first=3, timeout=10)
            await dst.wait_layers(3, 1, timeout=10)
            with pytest.raises(WaitTimeout):  # layer 2 was not pushed
                await dst.wait_layers(3, 2, timeout=0.2)
            after = await prefill.status()
            assert result.layers == tuple(pushed)
            assert result.nbytes == len(pushed) * lay.planes * len(sb) * lay.block_bytes
            assert engine_posted(after) == engine_posted(before)
            assert after["local_copy"]["writes"] - before["local_copy"]["writes"] == len(pushed)
            assert after["local_copy"]["bytes"] - before["local_copy"]["bytes"] == result.nbytes
            assert after["imms_dropped"] == before["imms_dropped"]
            assert after["transfers_in_flight"] == 0
            want = np.zeros(lay.nbytes, np.uint8)
            for layer in pushed:
                for plane in range(lay.planes):
                    for s_blk, d_blk in zip(sb.tolist(), db.tolist(), strict=True):
                        off = (layer * lay.layer_stride + plane * lay.plane_stride)
                        d_off = off + d_blk * lay.block_stride
                        s_off = off + s_blk * lay.block_stride
                        want[d_off:d_off + lay.block_bytes] = \
                            src.array[s_off:s_off + lay.block_bytes]
            assert np.array_equal(dst.array[:lay.nbytes], want)
            with pytest.raises(InvalidArgument, match="pushed already"):
                await (await prefill.kv_push(peer, name, src, sb, db, request=3,
                                             layers=[0])).wait()
            await dst.forget(3)


async def test_a_peer_name_that_is_this_daemon_copies_too(solo: DaemonProc) -> None:
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as owner, \
                p2pxfer.connect(solo.socket) as writer:
            dst = await owner.alloc(1 << 20, "lc-alias")
            await owner.export("lc-alias", dst)
            src = await writer.alloc(1 << 20, "lc-alias-src")
            src.array[:] = 0x5A
            before = await writer.status()
            assert await writer.write("alias", "lc-alias", ScatterList.contiguous(1 << 20),
                                      src=src, imm=4) == 1
            await owner.wait_imm(4, 1, timeout=10)
            assert np.all(dst.array == 0x5A)
            after = await writer.status()
            assert engine_posted(after) == engine_posted(before)
            assert after["local_copy"]["writes"] == before["local_copy"]["writes"] + 1
            # Unexported: the alias's cached descriptor is not written through.
            await owner.unexport("lc-alias")
            with pytest.raises(UnknownRegion):
                await writer.write("alias", "lc-alias", ScatterList.contiguous(4096), src=src)


LARGE = 128 << 20
PIECE = 64 << 10


def large_list() -> ScatterList:
    n = LARGE // PIECE
    rng = np.random.default_rng(8)
    return ScatterList(rng.permutation(n).astype(np.int64) * PIECE,
                       rng.permutation(n).astype(np.int64) * PIECE, np.full(n, PIECE, np.int64))


async def test_unexport_racing_a_large_copy(solo: DaemonProc) -> None:
    """The copy is stopped between pieces (the write answers unknown_region),
    or refused if it had not started; once ``unexport`` has answered, not one
    byte more lands in the owner's memory."""
    sl = large_list()
    refused = 0
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as owner, \
                p2pxfer.connect(solo.socket) as writer:
            src = await writer.alloc(LARGE, "lc-race-src")
            src.array[:] = 0xAA
            for k, delay in enumerate((0.0, 0.002, 0.005, 0.01)):
                name = f"lc-race-{k}"
                dst = await owner.alloc(LARGE, name)
                await owner.export(name, dst)
                outcome: list[Any] = []

                async def write(name: str = name, outcome: list[Any] = outcome) -> None:
                    try:
                        outcome.append(await writer.write(NODE, name, sl, src=src, imm=9))
                    except UnknownRegion as exc:
                        outcome.append(exc)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write)
                    await trio.sleep(delay)
                    await owner.unexport(name)
                    frozen = dst.array.copy()
                    await trio.sleep(0.2)
                    assert np.array_equal(dst.array, frozen), "bytes landed after unexport"
                landed = int(np.count_nonzero(dst.array == 0xAA))
                assert landed % PIECE == 0, "a piece was cut"
                if isinstance(outcome[0], UnknownRegion):
                    refused += 1
                    assert landed < LARGE
                else:
                    assert outcome[0] == len(sl) and landed == LARGE
                await owner.free(dst)
            assert refused > 0, "no unexport caught a copy"
            st = await writer.status()
            assert st["transfers_in_flight"] == 0 and st["local_copy"]["stopped"] >= 1
    assert solo.alive()


async def test_owner_disconnect_racing_a_large_copy(solo: DaemonProc) -> None:
    sl = large_list()
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as writer:
            src = await writer.alloc(LARGE, "lc-gone-src")
            src.array[:] = 0xCC

            async def write() -> None:
                # Finished first or cut short: either is fine, the daemon
                # must only never write into memory being released.
                with contextlib.suppress(UnknownRegion):
                    await writer.write(NODE, "lc-gone", sl, src=src, imm=2)

            async with trio.open_nursery() as nursery, \
                    p2pxfer.connect(solo.socket) as owner:
                await owner.export("lc-gone", await owner.alloc(LARGE, "lc-gone"))
                nursery.start_soon(write)
                await trio.sleep(0.002)
            # The region went with its owner; the daemon serves on.
            with pytest.raises(UnknownRegion):
                await writer.write(NODE, "lc-gone", sl, src=src)
            st = await writer.status()
            assert "lc-gone" not in [r["name"] for r in st["regions"]]
            assert st["transfers_in_flight"] == 0
    assert solo.alive()


async def test_cancelled_copy_stops_reading_the_buffer(solo: DaemonProc) -> None:
    """As on the fabric path: a cancelled write returns once the daemon no
    longer reads its source; what landed are whole pieces, and their
    immediates only."""
    sl = large_list()
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(solo.socket) as owner, \
                p2pxfer.connect(solo.socket) as writer:
            dst = await owner.alloc(LARGE, "lc-cancel")
            await owner.export("lc-cancel", dst)
            src = await writer.alloc(LARGE, "lc-cancel-src")
            src.array[:] = 0xAA
            with trio.move_on_after(0.003) as scope:
                await writer.write(NODE, "lc-cancel", sl, src=src, imm=91)
            assert scope.cancelled_caught, "the write finished before it could be cancelled"
            src.array[:] = 0xBB  # the call returned: the buffer is ours again
            await trio.sleep(0.2)
            got = dst.array
            assert not np.any(got == 0xBB), "the refilled source reached the target"
            landed = int(np.count_nonzero(got == 0xAA))
            assert landed % PIECE == 0 and landed < LARGE, landed
            if landed:
                await owner.wait_imm(91, landed // PIECE, timeout=5)
            with pytest.raises(WaitTimeout):
                await owner.wait_imm(91, 1, timeout=0.3)
            # The daemon serves on: the whole write of the new pattern lands.
            assert await writer.write(NODE, "lc-cancel", sl, src=src, imm=92) == len(sl)
            await owner.wait_imm(92, len(sl), timeout=10)
            assert np.all(dst.array == 0xBB)
            assert (await writer.status())["transfers_in_flight"] == 0


def test_bench_scenario_same_daemon(solo: DaemonProc) -> None:
    """The bench's ``same-daemon`` scenario: ratios to memcpy, nothing posted."""
    from p2pxfer.bench import run_scenario

    recs = run_scenario("same-daemon", socket=solo.socket, size=4 << 20, page_size=64 << 10,
                        rounds=2, warmup=1)
    assert [r["pages"] for r in recs] == [1, 64]
    assert [r["pieces"] for r in recs] == [8, 64]  # 4 MiB cut for the 2 threads
    for r in recs:
        assert r["local_copy"] and r["threads"] == 2 and r["engine_bytes_posted"] == 0
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ratio_to_memcpy"] > 0


@pytest.fixture
def nocopy(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "nocopy", local_copy=False)
    try:
        yield d
    finally:
        d.stop()


async def test_local_copy_off_goes_through_the_engine(nocopy: DaemonProc) -> None:
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(nocopy.socket) as owner, \
                p2pxfer.connect(nocopy.socket) as writer:
            dst = await owner.alloc(1 << 20, "lc-off")
            await owner.export("lc-off", dst)
            src = await writer.alloc(1 << 20, "lc-off-src")
            src.array[:] = 0x11
            before = await writer.status()
            assert before["local_copy"]["enabled"] is False
            n = await writer.write("nocopy", "lc-off", ScatterList.contiguous(1 << 20),
                                   src=src, imm=1)
            await owner.wait_imm(1, n, timeout=10)
            assert np.all(dst.array == 0x11)
            after = await writer.status()
            assert engine_posted(after)[1] - engine_posted(before)[1] == 1 << 20
            assert after["local_copy"]["writes"] == 0


NOBODY = 65534




@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_uid_cannot_copy_into_a_region() -> None:
    """uid isolation holds on the copy path, by node name and by an alias."""
    workdir = Path(tempfile.mkdtemp(prefix="p2pxfer-lc-", dir="/tmp"))
    workdir.chmod(0o755)
    port = free_port()
    d = start_daemon(workdir, "lc-iso", control_port=port, allowed_uids=[NOBODY],
                     peers=[{"name": "me", "address": f"{LOOPBACK}:{port}"}])
    try:
        with RawConn(d.socket) as owner:
            owner.hello()
            fd = os.memfd_create("lc", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 1 << 16)
            mem = owner.request({"t": "share", "id": 1, "size": 1 << 16},
                                fds=[fd])["result"]["mem"]
            os.close(fd)
            assert owner.request({"t": "export", "id": 2, "name": "roots", "mem": mem,
                                  "offset": 0, "length": 1 << 16})["t"] == "ok"
            before = d.status()["local_copy"]["writes"]

            def intruder() -> list[str]:
                with RawConn(d.socket) as c:
                    c.hello()
                    fd = os.memfd_create("lc", os.MFD_ALLOW_SEALING)
                    os.ftruncate(fd, 1 << 16)
                    mem = c.request({"t": "share", "id": 1, "size": 1 << 16},
                                    fds=[fd])["result"]["mem"]
                    scatter = pack_scatter(np.array([0]), np.array([0]), np.array([4096]))
                    return [c.request({"t": "write", "id": 2 + i, "peer": peer,
                                       "region": "roots", "mem": mem, "offset": 0,
                                       "scatter": scatter})["code"]
                            for i, peer in enumerate(("lc-iso", "me"))]

            assert as_uid(NOBODY, intruder) == ["unknown_region", "unknown_region"]
            assert d.status()["local_copy"]["writes"] == before
        assert d.alive()
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
