"""Device (GPU) memory as KV pools: the staged path (device -> pinned host
mirror -> fabric -> mirror -> device) in process and through two daemons,
for every kind of device memory p2pxfer accepts, every byte checked.

Skipped, with the reason, where no CUDA device is at hand (``gpu`` marker);
``docs/gpu.md`` says how to run them on an accelerator machine."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
from device_arrays import KINDS, DriverArray, cuda_or_skip, make

import p2pxfer
from conftest import PROVIDERS, engine_pair
from daemon_helpers import daemon_pair
from p2pxfer.devmem import DeviceStage, device_memory, driver, memory_kind
from p2pxfer.errors import InvalidArgument, UsageError
from p2pxfer.kv import KVPool, push_pages
from p2pxfer.kv_plan import KVLayout, expand_pages

pytestmark = pytest.mark.gpu

U8 = npt.NDArray[np.uint8]
STEP = 30.0
LAYOUT = KVLayout(4, 64, 16384, planes=2)  # 16 KiB blocks: 8 MiB


def expected(src: U8, dst: U8, lay: KVLayout, sb: Any, db: Any) -> U8:
    """``dst`` after blocks ``sb`` of ``src`` were pushed into ``db``."""
    out = dst.copy()
    so, do, ln, _ = expand_pages(lay, lay, np.asarray(sb, np.int64), np.asarray(db, np.int64),
                                 range(lay.num_layers))
    for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
        out[d:d + n] = src[s:s + n]
    return out


def assert_landed(dst: Any, src: U8, lay: KVLayout, sb: Any, db: Any) -> None:
    """The device memory of ``dst`` (zero before) holds blocks ``sb`` of
    ``src`` at ``db``, and nothing else."""
    got = dst.read()
    want = expected(src, np.zeros(lay.nbytes, np.uint8), lay, sb, db)
    assert np.array_equal(got, want), f"{int((got != want).sum())} bytes differ"


def scattered(rng: np.random.Generator, n: int, lay: KVLayout) -> tuple[Any, Any]:
    """Block tables as a serving engine has them: a run of neighbours, then
    scattered blocks."""
    run = np.arange(3, 3 + n // 2)
    sb = np.concatenate([run, rng.choice(np.arange(run[-1] + 2, lay.num_blocks), n - n // 2,
                                         replace=False)])
    db = rng.permutation(lay.num_blocks)[:n]
    return sb, db


@pytest.mark.parametrize("kind", KINDS)
def test_device_memory_of_each_kind(kind: str) -> None:
    arr = make(kind, 4096)
    try:
        found = device_memory(arr.obj)
        assert found is not None and found.nbytes == 4096 and found.device == 0
        assert memory_kind(arr.obj) == "cuda"
        assert memory_kind(np.zeros(16, np.uint8)) == "host"
        assert device_memory(bytearray(16)) is None
    finally:
        arr.close()


def test_staged_copies_round_trip() -> None:
    """DeviceStage alone: blocks device -> mirror -> other blocks of another
    device pool, with scattered and adjacent blocks."""
    cuda_or_skip()
    lay = KVLayout(3, 32, 8192)
    rng = np.random.default_rng(1)
    a, b = DriverArray(lay.nbytes), DriverArray(lay.nbytes)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    a.write(data)
    mirror = np.zeros(lay.nbytes, np.uint8)
    sa = DeviceStage(device_memory(a.obj), mirror, lay)  # type: ignore[arg-type]
    sb_ = DeviceStage(device_memory(b.obj), mirror, lay)  # type: ignore[arg-type]
    try:
        blocks = [0, 1, 2, 7, 30, 31]

        async def main() -> None:
            events = sa.to_host(blocks, [0, 1, 2])
            assert len(events) == 3
            await sa.wait(events[-1])
            sa.release(events)
            await sb_.copy_in(blocks, [0, 2])

        trio.run(main)
        got = b.read().reshape(3, 32, 8192)
        want = data.reshape(3, 32, 8192)
        assert np.array_equal(got[[0, 2]][:, blocks], want[[0, 2]][:, blocks])
        assert not got[1].any()
        others = [k for k in range(32) if k not in blocks]
        assert not got[:, others].any()
        with pytest.raises(InvalidArgument, match="block ids"):
            sa.to_host([32], [0])
    finally:
        sa.close()
        sb_.close()
        a.close()
        b.close()


@pytest.mark.parametrize("provider", [p for p, _ in PROVIDERS])
@pytest.mark.parametrize("kind", KINDS)
def test_push_device_to_device_in_process(provider: str, kind: str) -> None:
    rng = np.random.default_rng(7)
    lay = LAYOUT
    src, dst = make(kind, lay.nbytes), make(kind, lay.nbytes)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    src.write(data)
    sb, db = scattered(rng, 24, lay)

    async def main() -> None:
        async with engine_pair(provider) as (a, b):
            sp = KVPool(a, "src", lay, buffer=src.obj)
            dp = KVPool(b, "dst", lay, buffer=dst.obj)
            assert (sp.kind, dp.kind) == ("cuda", "cuda")
            with trio.fail_after(STEP):
                with pytest.raises(InvalidArgument, match="blocks="):
                    await dp.wait_layers(5, lay.num_layers - 1)
                r = await push_pages(a, sp, dp.describe(), sb, db, request_id=5)
                assert r.nbytes == 24 * lay.block_bytes * lay.planes * lay.num_layers
                await dp.wait_layers(5, lay.num_layers - 1, blocks=db)
            sp.close()
            dp.close()

    try:
        trio.run(main)
        assert_landed(dst, data, lay, sb, db)
    finally:
        src.close()
        dst.close()


def test_push_between_host_and_device_in_process() -> None:
    """GPU -> host and host -> GPU: a device pool and a host pool of the
    same layout push into each other."""
    rng = np.random.default_rng(9)
    lay = LAYOUT
    dev, dev2 = make("driver", lay.nbytes), make("driver", lay.nbytes)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    host_data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    dev.write(data)
    sb, db = scattered(rng, 16, lay)

    async def main() -> U8:
        async with engine_pair("shm") as (a, b):
            dp = KVPool(a, "dev", lay, buffer=dev.obj)
            dp2 = KVPool(a, "dev2", lay, buffer=dev2.obj)
            hp = KVPool(b, "host", lay)
            with trio.fail_after(STEP):
                await push_pages(a, dp, hp.describe(), sb, db, request_id=1)
                await hp.wait_layers(1, lay.num_layers - 1)
            landed = hp.array.copy()
            hp.array[:] = host_data
            with trio.fail_after(STEP):
                await push_pages(b, hp, dp2.describe(), db, sb, request_id=2)
                await dp2.wait_layers(2, lay.num_layers - 1, blocks=sb)
            for p in (dp, dp2, hp):
                p.close()
            return landed

    try:
        landed = trio.run(main)
        zeros = np.zeros(lay.nbytes, np.uint8)
        assert np.array_equal(landed, expected(data, zeros, lay, sb, db))
        assert np.array_equal(dev2.read(), expected(host_data, zeros, lay, db, sb))
    finally:
        dev.close()
        dev2.close()


# -- through two daemons: the client does the device copies ------------------------


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cuda_or_skip()
    with daemon_pair(tmp_path_factory.mktemp("gpud")) as pair:
        yield pair
    for d in pair:
        assert "request.crashed" not in d.log.read_text(), d.log_tail()


async def daemon_round(daemons: Any, kind: str, request: int, src: Any, dst: Any,
                       check: Callable[[Any], None] = lambda pool: None) -> None:
    """Device pool -> device pool through the daemons, staged or direct as
    they can (``check`` sees each pool); every byte checked on the device."""
    a, b = daemons
    rng = np.random.default_rng(request)
    lay = LAYOUT
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    src.write(data)
    sb, db = scattered(rng, 24, lay)
    try:
        async with p2pxfer.connect(b.socket) as decode, p2pxfer.connect(a.socket) as prefill:
            name = f"gpu-{kind}-{request}"
            dpool = await decode.kv_pool(name, lay, device=dst.obj)
            spool = await prefill.kv_pool(name + "-src", lay, receive=False, device=src.obj)
            assert (dpool.kind, spool.kind) == ("cuda", "cuda")
            for pool in (dpool, spool):
                check(pool)
            st = await decode.status()
            path = "direct" if dpool.direct else "staged"
            assert {"name": name, "kind": "cuda", "path": path}.items() <= next(
                p for p in st["kv_pools"] if p["name"] == name).items()
            region = next(r for r in st["regions"] if r["name"] == name)
            assert region["kind"] == ("cuda" if dpool.direct else "host")  # what peers write
            if dpool.direct:  # the device memory itself: no host array, no copies
                with pytest.raises(UsageError, match="no host array"):
                    _ = dpool.array
            else:
                with pytest.raises(InvalidArgument, match="blocks="):
                    await dpool.wait_layers(request, 0)
            push = await prefill.kv_push("node-b", name, spool, sb, db, request=request)
            await dpool.wait_layers(request, lay.num_layers - 1, blocks=db, timeout=STEP)
            result = await push.wait(timeout=STEP)
            assert result.layers == tuple(range(lay.num_layers))
            assert result.nbytes == 24 * lay.planes * lay.block_bytes * lay.num_layers
        assert_landed(dst, data, lay, sb, db)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("kind", KINDS)
def test_push_device_to_device_through_daemons(daemons: Any, kind: str) -> None:
    # Made here, not in trio: a skip raised inside trio loses its reason.
    arrays = make(kind, LAYOUT.nbytes), make(kind, LAYOUT.nbytes)
    trio.run(daemon_round, daemons, kind, 11 + KINDS.index(kind), *arrays)


def test_push_through_daemons_from_asyncio(daemons: Any) -> None:
    arrays = make("driver", LAYOUT.nbytes), make("driver", LAYOUT.nbytes)
    asyncio.run(daemon_round(daemons, "driver", 21, *arrays))


def test_push_through_daemons_blocking(daemons: Any) -> None:
    blocking_round(daemons, 31, "gpu-sync")


def blocking_round(daemons: Any, request: int, name: str,
                   check: Callable[[Any], None] = lambda pool: None) -> None:
    """A push of layers 0, 2 and 3 between device pools from ``SyncClient``s
    (``check`` sees each pool), waited for in two parts; layer 1 stays zero."""
    a, b = daemons
    rng = np.random.default_rng(request)
    lay = LAYOUT
    src, dst = make("driver", lay.nbytes), make("driver", lay.nbytes)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    src.write(data)
    sb, db = scattered(rng, 20, lay)
    try:
        with p2pxfer.SyncClient(b.socket) as decode, p2pxfer.SyncClient(a.socket) as prefill:
            dpool = decode.kv_pool(name, lay, device=dst.obj)
            spool = prefill.kv_pool(name + "-src", lay, receive=False, device=src.obj)
            for pool in (dpool, spool):
                check(pool)
            result = prefill.kv_push("node-b", name, spool, sb, db, request=request,
                                     layers=[0, 2, 3])
            assert result.layers == (0, 2, 3)
            decode.wait_layers(dpool, request, 3, first=2, timeout=STEP, blocks=db)
            decode.wait_layers(dpool, request, 0, timeout=STEP, blocks=db)
        got = dst.read().reshape(lay.num_layers, -1)
        want = expected(data, np.zeros(lay.nbytes, np.uint8), lay, sb, db)
        want = want.reshape(lay.num_layers, -1)
        assert np.array_equal(got[[0, 2, 3]], want[[0, 2, 3]])
        assert not got[1].any()  # never pushed
    finally:
        src.close()
        dst.close()


def test_host_pool_to_device_pool_through_daemons(daemons: Any) -> None:
    dev = make("driver", LAYOUT.nbytes)
    trio.run(host_and_device, daemons, dev)


async def host_and_device(daemons: Any, dev: Any, request: int = 41, prefix: str = "gpu",
                          check: Callable[[Any], None] = lambda pool: None) -> None:
    """Host -> GPU and GPU -> host through the daemons (``check`` sees the
    device pool)."""
    a, b = daemons
    rng = np.random.default_rng(request)
    lay = LAYOUT
    sb, db = scattered(rng, 16, lay)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    try:
        async with p2pxfer.connect(b.socket) as decode, p2pxfer.connect(a.socket) as prefill:
            dpool = await decode.kv_pool(f"{prefix}-in", lay, device=dev.obj)
            check(dpool)
            hsrc = await prefill.kv_pool(f"{prefix}-host-src", lay, receive=False)
            hsrc.array[:] = data
            push = await prefill.kv_push("node-b", f"{prefix}-in", hsrc, sb, db,
                                         request=request)
            await dpool.wait_layers(request, lay.num_layers - 1, blocks=db, timeout=STEP)
            await push.wait(timeout=STEP)
            zeros = np.zeros(lay.nbytes, np.uint8)
            assert np.array_equal(dev.read(), expected(data, zeros, lay, sb, db))
            # and back out of the device pool into a host pool
            hdst = await prefill.kv_pool(f"{prefix}-host-dst", lay)
            push = await decode.kv_push("node-a", f"{prefix}-host-dst", dpool, db, sb,
                                        request=request + 1)
            await hdst.wait_layers(request + 1, lay.num_layers - 1, timeout=STEP)
            await push.wait(timeout=STEP)
            assert np.array_equal(hdst.array, expected(dev.read(), zeros, lay, db, sb))
    finally:
        dev.close()


@pytest.mark.parametrize("provider", [p for p, _ in PROVIDERS])
def test_hmem_engine_registers_device_memory_or_stages_it(provider: str) -> None:
    """An engine asked for FI_HMEM: where the provider registers CUDA memory,
    the pool is the device memory itself (``direct``); where it refuses
    (Debian's libfabric: no CUDA), the pool is staged. Either way the bytes
    arrive, and the pool says which it is."""
    rng = np.random.default_rng(51)
    lay = LAYOUT
    src, dst = make("driver", lay.nbytes), make("driver", lay.nbytes)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    src.write(data)
    sb, db = scattered(rng, 12, lay)

    async def main() -> tuple[bool, bool]:
        async with engine_pair(provider, hmem=True) as (a, b):
            sp = KVPool(a, "src", lay, buffer=src.obj)
            dp = KVPool(b, "dst", lay, buffer=dst.obj)
            for p in (sp, dp):
                assert p.kind == "cuda" and p.direct == (p.stage is None)
            assert b.export_kinds()["dst"] == ("cuda" if dp.direct else "host")
            with trio.fail_after(STEP):
                await push_pages(a, sp, dp.describe(), sb, db, request_id=51)
                await dp.wait_layers(51, lay.num_layers - 1, blocks=db)
            sp.close()
            dp.close()
            return sp.direct, dp.direct

    try:
        directs = trio.run(main)
        assert_landed(dst, data, lay, sb, db)
        if provider == "tcp;ofi_rxm":
            assert directs == (False, False)  # tcp never registers device memory
        # Set where a libfabric built with CUDA is loaded (tests/gpu/on_device.sh
        # with a CUDA libfabric): there the direct path must be taken, not
        # fallen back from.
        if provider in os.environ.get("P2PXFER_EXPECT_HMEM", "").split(","):
            assert directs == (True, True)
    finally:
        src.close()
        dst.close()


def test_the_callers_current_context_is_left_as_it_was() -> None:
    """Every driver call pushes the device's context and pops it: a thread
    with no context current (or another one) keeps it after staged copies."""
    cuda_or_skip()
    lib = driver()._lib  # the test reads the thread's context straight from the driver
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def current() -> int:
        out = ctypes.c_void_p()
        assert lib.cuCtxGetCurrent(ctypes.byref(out)) == 0
        return int(out.value or 0)

    def in_thread() -> tuple[int, int]:
        before = current()
        lay = KVLayout(2, 8, 4096)
        arr = DriverArray(lay.nbytes)
        stage = DeviceStage(device_memory(arr.obj), np.zeros(lay.nbytes, np.uint8), lay)  # type: ignore[arg-type]
        events = stage.to_host([1, 2], [0, 1])
        stage.sync(events[-1])
        stage.release(events)
        stage.close()
        arr.close()
        return before, current()

    result: list[tuple[int, int]] = []
    t = threading.Thread(target=lambda: result.append(in_thread()))
    t.start()
    t.join()
    assert result and result[0][0] == result[0][1] == 0
