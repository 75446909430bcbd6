"""KV pages through the daemons (issue 13, items 1 and 2).

Two daemons in separate processes (tcp on loopback; once forced to 4-byte
immediates, as EFA and verbs carry; once with the decode daemon in another
network namespace). An **asyncio** prefill client, in a process of its own,
pushes 32 layers x 1024 blocks of 16 KiB from its pool (random source blocks)
into a **trio** decode client's pool (random destination blocks) through
its daemon; decode awaits every layer in order as it lands and checks every
byte of it. Then smaller cases: K/V planes in block-major order, a subset of
layers, a blocking ``SyncClient``, bad input, deadlines, cancellation, and a
sender whose node dies (``PeerLost``, with membership).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import traceback
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

import p2pxfer
from daemon_helpers import (
    LOOPBACK,
    DaemonProc,
    RawControl,
    daemon_pair,
    free_port,
    spawn_daemon,
    start_daemon,
)
from p2pxfer.client import KVPool
from p2pxfer.errors import (
    InvalidArgument,
    P2PXferError,
    TransferAborted,
    TransferError,
    UnknownRegion,
    WaitTimeout,
)
from p2pxfer.kv import KVLayout

TIMEOUT = 120.0
U8 = npt.NDArray[np.uint8]


# -- data both sides agree on ------------------------------------------------------

def pool_view(array: U8, lay: KVLayout) -> U8:
    """A pool as ``[layer][plane][block][byte]`` (a view)."""
    nl, nb, npl, bb = lay.num_layers, lay.num_blocks, lay.planes, lay.block_bytes
    flat = array[: nl * nb * npl * bb]
    if lay.order == "layer_major":
        return flat.reshape(nl, npl, nb, bb)
    if lay.order == "block_major":
        return flat.reshape(nb, nl, npl, bb).transpose(1, 2, 0, 3)
    return flat.reshape(npl, nl, nb, bb).transpose(1, 0, 2, 3)


def request_kv(seed: int, lay: KVLayout, n: int) -> U8:
    """``[layer][plane][i][byte]`` of a request's ``i``-th block."""
    size = lay.num_layers * lay.planes * n * lay.block_bytes
    data = np.frombuffer(np.random.default_rng(seed).bytes(size), np.uint8)
    return data.reshape(lay.num_layers, lay.planes, n, lay.block_bytes)


def tables(seed: int, lay: KVLayout, n: int) -> tuple[npt.NDArray[np.int64],
                                                       npt.NDArray[np.int64]]:
    rng = np.random.default_rng([seed, 7])
    return (rng.choice(lay.num_blocks, n, replace=False).astype(np.int64),
            rng.choice(lay.num_blocks, n, replace=False).astype(np.int64))


# -- the prefill side: an asyncio client in its own process ---------------------------

def prefill_main(conn: Connection, socket: str, job: dict[str, Any]) -> None:
    try:
        conn.send(("ok", asyncio.run(_prefill(socket, job))))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


async def _prefill(socket: str, job: dict[str, Any]) -> dict[str, Any]:
    lay = KVLayout.from_wire(job["layout"])
    src_blocks, dst_blocks = tables(job["seed"], lay, job["n"])
    async with p2pxfer.connect(socket) as client:
        assert asyncio.get_running_loop() is not None
        src = await client.kv_pool("kv-prefill", lay, receive=False)
        pool_view(src.array, lay)[:, :, src_blocks] = request_kv(job["seed"], lay, job["n"])
        push = await client.kv_push(job["peer"], job["pool"], src, src_blocks, dst_blocks,
                                    request=job["request"], layers=job.get("layers"))
        result = await push.wait()
        return {"pieces": result.pieces, "nbytes": result.nbytes, "seconds": result.seconds,
                "first": result.first_layer_seconds, "layers": result.layers}


class Prefill:
    def __init__(self, socket: str, job: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, socket, job), daemon=True)
        self.proc.start()
        child.close()

    async def result(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        ready = await trio.to_thread.run_sync(self.conn.poll, timeout)
        assert ready, f"prefill gave no answer within {timeout} s"
        kind, value = self.conn.recv()
        assert kind == "ok", value
        return dict(value)

    def close(self) -> None:
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


# -- the decode side: trio, here -----------------------------------------------------

async def decode_round(decode_socket: str, prefill_socket: str, lay: KVLayout, n: int,
                       seed: int, request: int, peer: str = "node-b",
                       layers: list[int] | None = None) -> dict[str, Any]:
    """Decode's pool, prefill's push into it, every layer awaited in order
    and checked as it lands."""
    _, dst_blocks = tables(seed, lay, n)
    want = request_kv(seed, lay, n)
    expect = list(range(lay.num_layers)) if layers is None else sorted(layers)
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(decode_socket) as decode:
            pool = await decode.kv_pool(f"kv-decode-{request}", lay)
            prefill = Prefill(prefill_socket, {
                "layout": lay.to_wire(), "seed": seed, "n": n, "peer": peer,
                "pool": pool.name, "request": request, "layers": layers})
            try:
                seen = []
                view = pool_view(pool.array, lay)
                async for layer in pool.layers(request, first=expect[0], upto=expect[-1],
                                               timeout=60):
                    seen.append(layer)
                    got = view[layer][:, dst_blocks]
                    assert np.array_equal(got, want[layer]), f"layer {layer} differs"
                assert seen == expect
                untouched = np.setdiff1d(np.arange(lay.num_layers), expect)
                assert not view[untouched].any(), "a layer not pushed was written"
                result = await prefill.result()
            finally:
                prefill.close()
            assert tuple(result["layers"]) == tuple(expect)
            assert result["nbytes"] == len(expect) * lay.planes * n * lay.block_bytes
            await pool.forget(request)
            return result


@pytest.fixture(scope="module", params=[0, 4], ids=["native-imm", "imm32"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    extra = {"imm_bytes": request.param} if request.param else {}
    with daemon_pair(tmp_path_factory.mktemp("kvd"), **extra) as pair:
        yield pair
    for d in pair:
        assert "request.crashed" not in d.log.read_text(), d.log_tail()


FULL = KVLayout(32, 1024, 16 << 10)  # 32 layers x 1024 blocks of 16 KiB: 512 MiB


async def test_push_32_layers_through_daemons(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    result = await decode_round(b.socket, a.socket, FULL, 1024, seed=1, request=7)
    assert len(result["pieces"]) == 32
    st = await _status(b)
    assert st["imm_bits"] == (32 if b.keys.get("imm_bytes") == 4 else 64)


async def test_planes_block_major_and_a_layer_subset(pair: tuple[DaemonProc, DaemonProc]
                                                     ) -> None:
    a, b = pair
    lay = KVLayout(8, 256, 4096, planes=2, order="block_major")
    await decode_round(b.socket, a.socket, lay, 200, seed=2, request=1 << 40)
    await decode_round(b.socket, a.socket, lay, 64, seed=3, request=9, layers=[5, 3, 4])


async def _status(d: DaemonProc) -> dict[str, Any]:
    async with p2pxfer.connect(d.socket) as c:
        return await c.status()


async def test_bad_pushes_are_refused_before_posting(pair: tuple[DaemonProc, DaemonProc]
                                                     ) -> None:
    a, b = pair
    lay = KVLayout(4, 16, 4096)
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(b.socket) as decode, p2pxfer.connect(a.socket) as prefill:
            dst = await decode.kv_pool("kv-bad", lay)
            src = await prefill.kv_pool("kv-bad-src", lay, receive=False)
            blocks = np.arange(4)

            async def push(**kw: Any) -> None:
                args: dict[str, Any] = {"peer": "node-b", "pool": "kv-bad", "src": src,
                                        "src_blocks": blocks, "dst_blocks": blocks,
                                        "request": 1}
                args.update(kw)
                p = await prefill.kv_push(args.pop("peer"), args.pop("pool"), args.pop("src"),
                                          args.pop("src_blocks"), args.pop("dst_blocks"),
                                          **args)
                await p.wait()

            with pytest.raises(InvalidArgument, match="outside"):
                await push(dst_blocks=np.array([0, 1, 2, 16]))
            with pytest.raises(InvalidArgument, match="twice"):
                await push(dst_blocks=np.array([0, 1, 1, 2]))
            with pytest.raises(InvalidArgument, match="layers"):
                await push(layers=[4])
            with pytest.raises(UnknownRegion):
                await push(pool="kv-nope")
            other = await prefill.kv_pool("kv-bad-other", KVLayout(4, 16, 8192), receive=False)
            with pytest.raises(InvalidArgument, match="block_bytes"):
                await push(src=other)
            # Only the pool's owner waits on it.
            with pytest.raises(UnknownRegion):
                await KVPool(prefill, "kv-bad", lay, src.mem, None).wait_layers(1, 0)
            assert not dst.array.any()
            # A wait that times out (nothing pushed) leaves the daemon serving on.
            with pytest.raises(WaitTimeout):
                await dst.wait_layers(5, 3, timeout=0.2)
            await push(request=5)
            await dst.wait_layers(5, 3, timeout=20)
            # A request id is pushed once until forgotten.
            with pytest.raises(InvalidArgument, match="pushed already"):
                await push(request=5)
            await dst.forget(5)
            await push(request=5)
            await dst.wait_layers(5, 3, timeout=20)
            # Given up with refuse: pushes of it are refused until it is forgotten.
            await dst.forget(6, refuse=True)
            with pytest.raises(InvalidArgument, match="is over"):
                await push(request=6)
            with pytest.raises(UnknownRegion, match="given up"):
                await dst.wait_layers(6, 3, timeout=1)
            await dst.forget(6)
            await push(request=6)
            await dst.wait_layers(6, 3, timeout=20)


@contextlib.asynccontextmanager
async def two_pools(pair: tuple[DaemonProc, DaemonProc], name: str, lay: KVLayout,
                    src_blocks: npt.NDArray[np.int64], seed: int
                    ) -> AsyncIterator[tuple[p2pxfer.Client, p2pxfer.Client, KVPool, KVPool]]:
    """A decode client of node-b with receiving pool ``name``, a prefill
    client of node-a with a source pool whose ``src_blocks`` hold
    ``request_kv(seed)``."""
    a, b = pair
    async with p2pxfer.connect(b.socket) as decode, p2pxfer.connect(a.socket) as prefill:
        dst = await decode.kv_pool(name, lay)
        src = await prefill.kv_pool(f"{name}-src", lay, receive=False)
        pool_view(src.array, lay)[:, :, src_blocks] = request_kv(seed, lay, len(src_blocks))
        yield decode, prefill, dst, src


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (``/proc/PID/stat``)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


async def test_a_pool_is_mapped_in_its_daemon_before_its_first_push(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    """``kv_pool`` answers once every page of the pool is mapped in its
    daemon (the source's mapping, and a receiving pool's export, where
    peers' writes land): a push from pools new to the daemons costs no page
    fault per page on its way (16 MiB is 4096 pages; mapped on first touch,
    they took one fault each, and the push twice as long). The first push
    of all warms the provider's own buffers; the second pair of pools is
    the one measured."""
    lay = KVLayout(8, 128, 16 << 10)
    src_blocks, dst_blocks = tables(31, lay, 128)
    with trio.fail_after(TIMEOUT):
        for request in (1, 2):  # a warm-up, then the one measured
            async with two_pools(pair, f"kv-mapped-{request}", lay, src_blocks, 31) as (
                    _, prefill, dst, src):
                before = [minor_faults(d.proc.pid) for d in pair]
                push = await prefill.kv_push("node-b", f"kv-mapped-{request}", src, src_blocks,
                                             dst_blocks, request=request)
                await push.wait()
                await dst.wait_layers(request, lay.num_layers - 1, timeout=TIMEOUT)
                faults = [minor_faults(d.proc.pid) - n for d, n in zip(pair, before, strict=True)]
                assert np.array_equal(pool_view(dst.array, lay)[:, :, dst_blocks],
                                      request_kv(31, lay, len(src_blocks)))
        assert max(faults) < 512, f"page faults during the second push (node-a, node-b): " \
                                  f"{faults}"


async def test_a_request_given_up_answers_once_its_pushes_landed(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    """``forget(refuse=True)`` while a 128 MiB push is under way: it answers
    once the push's layers have landed (nothing changes in the pool after),
    the client's other requests going on meanwhile, and the request is
    refused from then on."""
    lay = KVLayout(16, 256, 16 << 10)
    src_blocks, dst_blocks = tables(21, lay, 256)
    with trio.fail_after(TIMEOUT):
        async with two_pools(pair, "kv-drain", lay, src_blocks, 21) as (decode, prefill, dst,
                                                                         src):
            push = await prefill.kv_push("node-b", "kv-drain", src, src_blocks, dst_blocks,
                                         request=9)
            await dst.wait_layers(9, 0, timeout=TIMEOUT)  # under way: the rest still to come
            order: list[str] = []

            async def give_up() -> None:
                await dst.forget(9, refuse=True)
                order.append("forget")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(give_up)
                await trio.sleep(0)
                await decode.status()  # the client's other requests go on meanwhile
                order.append("status")
            assert order == ["status", "forget"]
            landed = dst.array.copy()
            # The push itself may end either way (the request was given up
            # under it): what matters is that nothing of it lands from now on.
            with contextlib.suppress(P2PXferError):
                await push.wait()
            await trio.sleep(0.2)
            assert np.array_equal(dst.array, landed)
            again = await prefill.kv_push("node-b", "kv-drain", src, src_blocks[:1],
                                          dst_blocks[:1], request=9)
            with pytest.raises(InvalidArgument, match="is over"):
                await again.wait()


async def test_a_request_its_sender_abandons_ends_its_waits_at_once(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    """``kv_abandon`` after two of eight layers: the receiver's wait for the
    rest ends now with ``TransferAborted`` quoting the sender and its reason
    (the push's deadline is 60 s), a later push of the request is refused,
    and a request abandoned before anyone waits is heard by its first wait.
    A request that is over (every layer landed, or ended) stays as it was."""
    lay = KVLayout(8, 64, 8192)
    src_blocks, dst_blocks = tables(23, lay, 16)
    with trio.fail_after(TIMEOUT):
        async with two_pools(pair, "kv-abandon", lay, src_blocks, 23) as (decode, prefill, dst,
                                                                           src):
            push = await prefill.kv_push("node-b", "kv-abandon", src, src_blocks, dst_blocks,
                                         request=4, layers=[0, 1], deadline=60)
            await push.wait()
            await dst.wait_layers(4, 1, timeout=TIMEOUT)
            ended: list[float] = []

            async def rest() -> None:
                with pytest.raises(TransferAborted, match="sender node-a gave it up: aborted "
                                                          "by its user"):
                    await dst.wait_layers(4, 7, first=2, timeout=TIMEOUT)
                ended.append(trio.current_time())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(rest)
                await decode.status()  # the wait is in the daemon's hands
                t0 = trio.current_time()
                assert await prefill.kv_abandon("node-b", "kv-abandon", 4,
                                                reason="aborted by its user")
            assert ended[0] - t0 < 30, "the wait lasted until the push's deadline"
            assert not await prefill.kv_abandon("node-b", "kv-abandon", 4)  # over already
            again = await prefill.kv_push("node-b", "kv-abandon", src, src_blocks[:1],
                                          dst_blocks[:1], request=4, layers=[5])
            with pytest.raises(InvalidArgument, match="is over"):
                await again.wait()
            # Abandoned before anyone waited: the first wait hears it.
            assert await prefill.kv_abandon("node-b", "kv-abandon", 5, reason="push failed")
            with pytest.raises(TransferAborted, match="push failed"):
                await dst.wait_layers(5, 0, timeout=TIMEOUT)
            # Every layer landed: nothing to end, even when the abandon
            # overtakes the last notifications on their way to the receiver
            # (the sender's push.wait() says they landed, not that the
            # receiving daemon counted them: the abandon says what it saw).
            push = await prefill.kv_push("node-b", "kv-abandon", src, src_blocks, dst_blocks,
                                         request=6)
            await push.wait()
            assert not await prefill.kv_abandon("node-b", "kv-abandon", 6)
            await dst.wait_layers(6, 7, timeout=TIMEOUT)  # landed, not ended
            for r in (4, 5, 6):
                await dst.forget(r)
            # Once a push began, only its sender may say so (node-b is not).
            push = await prefill.kv_push("node-b", "kv-abandon", src, src_blocks, dst_blocks,
                                         request=8, layers=[0])
            await push.wait()
            with pytest.raises(InvalidArgument, match="pushes no request 8"):
                await decode.kv_abandon("node-b", "kv-abandon", 8)
            await dst.forget(8)
            with pytest.raises(UnknownRegion):
                await prefill.kv_abandon("node-b", "no-such-pool", 4)
            with pytest.raises(InvalidArgument, match="reason is 1025 characters"):
                await prefill.kv_abandon("node-b", "kv-abandon", 7, reason="x" * 1025)
            with pytest.raises(InvalidArgument, match="request must be >= 0"):
                await prefill.kv_abandon("node-b", "kv-abandon", -1)


async def test_an_abandon_stops_the_senders_pushes_first(pair: tuple[DaemonProc, DaemonProc]
                                                         ) -> None:
    """``kv_abandon`` while a 256 MiB push of the request is under way: the
    push ends ``TransferAborted`` (stopped, not left landing), the
    receiver's wait too, and nothing lands in the pool after the answer:
    the layer under way went on to its end, the layers not begun were
    dropped, so every layer is whole or untouched."""
    lay = KVLayout(32, 512, 16 << 10)
    src_blocks, dst_blocks = tables(24, lay, 512)
    with trio.fail_after(TIMEOUT):
        async with two_pools(pair, "kv-abandon-push", lay, src_blocks, 24) as (
                _, prefill, dst, src):
            push = await prefill.kv_push("node-b", "kv-abandon-push", src, src_blocks,
                                         dst_blocks, request=3)
            await dst.wait_layers(3, 0, timeout=TIMEOUT)  # under way
            assert await prefill.kv_abandon("node-b", "kv-abandon-push", 3, reason="stop")
            with pytest.raises(TransferAborted, match="abandoned"):
                await push.wait()
            landed = dst.array.copy()
            with pytest.raises(TransferAborted, match="stop"):
                await dst.wait_layers(3, 31, timeout=TIMEOUT)
            await trio.sleep(0.2)
            assert np.array_equal(dst.array, landed)
            got = pool_view(landed, lay)[:, :, dst_blocks]
            want = request_kv(24, lay, len(src_blocks))
            cut = [k for k in range(lay.num_layers)
                   if got[k].any() and not np.array_equal(got[k], want[k])]
            assert not cut, f"layers {cut} were cut short"


def test_an_abandon_from_blocking_and_asyncio_callers(pair: tuple[DaemonProc, DaemonProc]
                                                      ) -> None:
    """The same word from a ``SyncClient`` and from an asyncio caller; the
    blocking receiver's wait raises it."""
    a, b = pair
    lay = KVLayout(4, 32, 8192)

    async def abandon(request: int) -> bool:
        assert asyncio.get_running_loop() is not None
        async with p2pxfer.connect(a.socket) as c:
            return await c.kv_abandon("node-b", "kv-abandon-sync", request, reason="asyncio")

    with p2pxfer.SyncClient(b.socket) as decode, p2pxfer.SyncClient(a.socket) as prefill:
        dst = decode.kv_pool("kv-abandon-sync", lay)
        assert prefill.kv_abandon("node-b", "kv-abandon-sync", 1, reason="blocking")
        with pytest.raises(TransferAborted, match="blocking"):
            decode.wait_layers(dst, 1, 3, timeout=20)
        assert asyncio.run(abandon(2))
        with pytest.raises(TransferAborted, match="asyncio"):
            decode.wait_layers(dst, 2, 3, timeout=20)


def test_sync_client_push(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    lay = KVLayout(4, 32, 8192)
    src_blocks, dst_blocks = tables(11, lay, 20)
    want = request_kv(11, lay, 20)
    with p2pxfer.SyncClient(b.socket) as decode, p2pxfer.SyncClient(a.socket) as prefill:
        dst = decode.kv_pool("kv-sync", lay)
        src = prefill.kv_pool("kv-sync-src", lay, receive=False)
        pool_view(src.array, lay)[:, :, src_blocks] = want
        result = prefill.kv_push("node-b", "kv-sync", src, src_blocks, dst_blocks, request=3)
        assert result.layers == (0, 1, 2, 3) and result.nbytes == 4 * 20 * 8192
        decode.wait_layers(dst, 3, 3, timeout=20)
        assert np.array_equal(pool_view(dst.array, lay)[:, :, dst_blocks], want)


async def test_a_pool_over_memory_the_client_has(pair: tuple[DaemonProc, DaemonProc]
                                                ) -> None:
    """``kv_pool(memory=...)`` lays the pool over shared memory allocated
    before (an engine's own KV tensors): pushed from there and into there,
    no copy, from blocking, trio and asyncio callers. Memory that is too
    small or another client's is refused by name and stays usable."""
    a, b = pair
    lay = KVLayout(4, 32, 8192)
    src_blocks, dst_blocks = tables(12, lay, 20)
    want = request_kv(12, lay, 20)

    async def decode_into(request: int) -> U8:
        async with p2pxfer.connect(b.socket) as decode:
            mem = await decode.alloc(lay.nbytes + 4096, "kv-over-dst-mem")
            with pytest.raises(InvalidArgument, match=f"needs {lay.nbytes} bytes"):
                await decode.kv_pool("kv-over-small", lay,
                                     memory=await decode.alloc(4096, "small"))
            dst = await decode.kv_pool("kv-over-dst", lay, memory=mem)
            assert dst.mem is mem
            await trio.to_thread.run_sync(push, request)
            await dst.wait_layers(request, 3, timeout=20)
            return mem.array[:lay.nbytes].copy()

    def push(request: int) -> None:
        with p2pxfer.SyncClient(a.socket) as prefill, p2pxfer.SyncClient(a.socket) as other:
            mem = prefill.alloc(lay.nbytes, "kv-over-src-mem")
            with pytest.raises(InvalidArgument, match="this client allocated"):
                other.kv_pool("kv-over-other", lay, receive=False, memory=mem)
            pool_view(mem.array, lay)[:, :, src_blocks] = want  # written before the pool
            src = prefill.kv_pool("kv-over-src", lay, receive=False, memory=mem)
            with pytest.raises(P2PXferError, match="kv-over-src"):  # the name is taken
                prefill.kv_pool("kv-over-src", lay, receive=False, memory=mem)
            mem.array[0]  # still mapped: a failed pool leaves the caller's memory alone
            result = prefill.kv_push("node-b", "kv-over-dst", src, src_blocks, dst_blocks,
                                     request=request)
            assert result.nbytes == 4 * 20 * 8192

    got = await decode_into(5)
    assert np.array_equal(pool_view(got, lay)[:, :, dst_blocks], want)

    async def asyncio_pool() -> bool:
        async with p2pxfer.connect(a.socket) as c:
            mem = await c.alloc(lay.nbytes, "kv-over-asyncio")
            pool = await c.kv_pool("kv-over-asyncio", lay, memory=mem)
            return pool.mem is mem and pool.array.ctypes.data == mem.array.ctypes.data

    assert await trio.to_thread.run_sync(asyncio.run, asyncio_pool())


def test_a_sender_asks_whether_a_layer_was_notified(pair: tuple[DaemonProc, DaemonProc]
                                                    ) -> None:
    """``kv_arrived``: what a sender whose notification's outcome is unknown
    (its rail broke under it) asks the receiver before it sends it again.
    It answers the layer's count to a sender of the request, and nobody
    else."""
    a, b = pair
    lay = KVLayout(3, 16, 4096)
    src_blocks, dst_blocks = tables(12, lay, 5)
    with p2pxfer.SyncClient(b.socket) as decode, p2pxfer.SyncClient(a.socket) as prefill:
        dst = decode.kv_pool("kv-arrived", lay)
        src = prefill.kv_pool("kv-arrived-src", lay, receive=False)
        prefill.kv_push("node-b", "kv-arrived", src, src_blocks, dst_blocks, request=5,
                        layers=[0, 1])
        decode.wait_layers(dst, 5, 1, timeout=20)
        raw = RawControl(b.control)
        try:
            raw.hello("node-a")
            for layer, want in ((0, 1), (1, 1), (2, 0)):
                reply = raw.request({"t": "kv_arrived", "id": layer + 1, "pool": "kv-arrived",
                                     "request": 5, "layer": layer})
                assert reply is not None and reply["t"] == "ok", reply
                assert reply["result"]["arrived"] == want, (layer, reply)
            reply = raw.request({"t": "kv_arrived", "id": 9, "pool": "kv-arrived",
                                 "request": 5, "layer": 3})
            assert reply is not None and reply["code"] == "bad_request", reply
        finally:
            raw.sock.close()
        raw = RawControl(b.control)
        try:
            raw.hello("node-z")  # not a sender of request 5
            reply = raw.request({"t": "kv_arrived", "id": 1, "pool": "kv-arrived",
                                 "request": 5, "layer": 0})
            assert reply is not None and reply["code"] == "bad_request", reply
        finally:
            raw.sock.close()


async def test_deadline_ends_the_wait(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """A push cancelled right away: the decode side hears ``WaitTimeout``
    once the push's deadline passes, not never."""
    a, b = pair
    lay = KVLayout(64, 512, 16 << 10)
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(b.socket) as decode, p2pxfer.connect(a.socket) as prefill:
            dst = await decode.kv_pool("kv-deadline", lay)
            src = await prefill.kv_pool("kv-deadline-src", lay, receive=False)
            blocks = np.arange(512)
            push = await prefill.kv_push("node-b", "kv-deadline", src, blocks, blocks[::-1],
                                         request=4, deadline=3.0)
            await dst.wait_layers(4, 0, timeout=20)  # begun: the receiver knows the deadline
            with trio.move_on_after(0.001) as scope:
                await push.wait()
            assert scope.cancelled_caught, "the push finished before it could be cancelled"
            with pytest.raises(TransferError, match="cancelled"):
                await push.wait()
            t0 = trio.current_time()
            with pytest.raises(WaitTimeout):
                await dst.wait_layers(4, 63, timeout=60)
            assert trio.current_time() - t0 < 30, "the deadline did not end the wait"


def test_decode_daemon_in_another_namespace(tmp_path: Path) -> None:
    """The full push with each daemon in a network namespace of its own
    (joined by a veth pair): control and data both cross it."""
    from netns import two_hosts

    with two_hosts(1) as (ha, hb):
        port = 7700
        daemons: list[DaemonProc] = []
        try:
            for host, name, other, addr, oaddr in (
                    (ha, "node-a", "node-b", ha.addresses[0], hb.addresses[0]),
                    (hb, "node-b", "node-a", hb.addresses[0], ha.addresses[0])):
                daemons.append(spawn_daemon(tmp_path, {
                    "node": name, "socket": str(tmp_path / f"{name}.sock"),
                    "control": f"{addr}:{port}", "provider": "tcp;ofi_rxm",
                    "fabric_node": addr, "log_level": "INFO", "cluster_token": "kv-netns-token",
                    "peers": [{"name": other, "address": f"{oaddr}:{port}"}]},
                    wrap=host.exec_argv))
            trio.run(decode_round, daemons[1].socket, daemons[0].socket, FULL, 1024, 5, 8)
        finally:
            for d in daemons:
                d.stop()


async def test_dead_sender_ends_the_wait_with_peer_lost(tmp_path: Path) -> None:
    """With membership: the prefill node's daemon is SIGKILLed mid-push; the
    decode side's wait ends with ``PeerLost`` once membership rules it dead
    (long before the push's deadline), and the decode daemon serves on."""
    from p2pxfer.errors import ConnectionLost, PeerLost

    token = "kv-cluster-token"
    pa, pb = free_port(), free_port()
    keys = {"membership": "embedded", "cluster_token": token}
    b = start_daemon(tmp_path, "node-b", control_port=pb, **keys)
    a = start_daemon(tmp_path, "node-a", control_port=pa, seeds=[f"{LOOPBACK}:{pb}"], **keys)
    lay = KVLayout(256, 256, 16 << 10)  # 1 GiB: the push takes a while
    try:
        with trio.fail_after(TIMEOUT):
            while {p["name"]: p["state"] for p in (await _status(b))["peers"]} != {
                    "node-a": "alive", "node-b": "alive"}:
                await trio.sleep(0.1)
            async with p2pxfer.connect(b.socket) as decode, \
                    p2pxfer.connect(a.socket) as prefill:
                dst = await decode.kv_pool("kv-lost", lay)
                src = await prefill.kv_pool("kv-lost-src", lay, receive=False)
                blocks = np.arange(256)
                push = await prefill.kv_push("node-b", "kv-lost", src, blocks, blocks[::-1],
                                             request=1, deadline=600)
                await dst.wait_layers(1, 0, timeout=30)
                a.proc.kill()
                a.proc.wait(10)
                t0 = trio.current_time()
                with pytest.raises(PeerLost, match="node-a"):
                    await dst.wait_layers(1, 255, timeout=30)
                assert trio.current_time() - t0 < 15
                with pytest.raises(ConnectionLost):
                    await push.wait()
            assert (await _status(b))["transfers_in_flight"] == 0
    finally:
        a.stop()
        b.stop()
