"""Device memory through the daemon, taken as is (``share_device``): the
client hands a CUDA IPC handle over, the daemon opens and registers the
allocation, peers write into the GPU's memory and pushes read from it, with
no host copy. Two daemons asked for FI_HMEM on shm: where their libfabric
registers CUDA memory (a libfabric built with CUDA, ``.dev/fabcuda``) the
pools are direct; where it does not (Debian's), they stage, and
``direct=True`` is refused with the daemon's reason. Every byte is checked
on the device, from trio, asyncio and blocking callers.

``P2PXFER_EXPECT_HMEM=shm`` (``tests/gpu/on_device.sh`` over a CUDA
libfabric) makes a pool that falls back to staging fail the test."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest
import trio
from device_arrays import cuda_or_skip, make
from test_device_kv import (
    LAYOUT,
    STEP,
    blocking_round,
    daemon_round,
    expected,
    host_and_device,
    scattered,
)

import p2pxfer
from daemon_helpers import daemon_pair
from p2pxfer.devmem import driver
from p2pxfer.errors import DeviceError
from p2pxfer.scatter import ScatterList

pytestmark = pytest.mark.gpu

EXPECT = "shm" in os.environ.get("P2PXFER_EXPECT_HMEM", "").split(",")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cuda_or_skip()
    with daemon_pair(tmp_path_factory.mktemp("gpudirect"), provider="shm", hmem=True) as pair:
        yield pair
    for d in pair:
        assert "request.crashed" not in d.log.read_text(), d.log_tail()


def check_path(pool: Any) -> None:
    assert pool.kind == "cuda"
    if EXPECT:
        assert pool.direct, f"pool {pool.name} was staged where the direct path was expected"


def test_direct_device_to_device_through_daemons(daemons: Any) -> None:
    arrays = make("driver", LAYOUT.nbytes), make("driver", LAYOUT.nbytes)
    trio.run(daemon_round, daemons, "driver", 61, *arrays, check_path)


def test_direct_torch_tensors_through_daemons(daemons: Any) -> None:
    arrays = make("torch", LAYOUT.nbytes), make("torch", LAYOUT.nbytes)
    trio.run(daemon_round, daemons, "torch", 62, *arrays, check_path)


def test_memory_an_ipc_handle_cannot_name_stages(daemons: Any) -> None:
    """Memory of the virtual memory API (torch's expandable segments): CUDA
    IPC handles do not cover it, so ``direct=True`` is refused naming the
    call, and the default stages it, every byte landing."""
    b = daemons[1]
    vmm = make("vmm", LAYOUT.nbytes)
    try:
        with p2pxfer.SyncClient(b.socket) as client, \
                pytest.raises(DeviceError, match=r"cuIpcGetMemHandle|cuMemGetAddressRange"):
            client.kv_pool("vmm-direct", LAYOUT, device=vmm.obj, direct=True)
    finally:
        vmm.close()
    arrays = make("vmm", LAYOUT.nbytes), make("vmm", LAYOUT.nbytes)
    trio.run(daemon_round, daemons, "vmm", 69, *arrays, staged)


def staged(pool: Any) -> None:
    assert pool.kind == "cuda" and pool.stage is not None and not pool.direct


def test_direct_from_asyncio(daemons: Any) -> None:
    arrays = make("driver", LAYOUT.nbytes), make("driver", LAYOUT.nbytes)
    asyncio.run(daemon_round(daemons, "driver", 63, *arrays, check_path))


def test_direct_blocking(daemons: Any) -> None:
    blocking_round(daemons, 64, "direct-sync", check_path)


def test_gpu_to_host_and_host_to_gpu_direct(daemons: Any) -> None:
    dev = make("driver", LAYOUT.nbytes)
    trio.run(host_and_device, daemons, dev, 65, "direct", check_path)


def test_same_daemon_copies_and_two_pools_of_one_allocation(daemons: Any) -> None:
    """Two clients of one daemon: device -> device and host -> device
    pushes are copies in the daemon (CUDA copies, no fabric); the two
    device pools lie in one allocation (one IPC handle, opened once there),
    and freeing one leaves the other working."""
    a, _ = daemons
    lay = LAYOUT
    whole = make("driver", 2 * lay.nbytes)
    rng = np.random.default_rng(67)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    sb, db = scattered(rng, 16, lay)

    class Half:
        def __init__(self, k: int) -> None:
            self.__cuda_array_interface__ = {
                "shape": (lay.nbytes,), "typestr": "|u1", "version": 3, "strides": None,
                "data": (whole.address + k * lay.nbytes, False)}

    async def main() -> None:
        zeros = np.zeros(lay.nbytes, np.uint8)
        async with p2pxfer.connect(a.socket) as two:
            dst = await two.kv_pool("same-dst", lay, device=Half(1))
            check_path(dst)
            async with p2pxfer.connect(a.socket) as one:
                src = await one.kv_pool("same-src", lay, receive=False, device=Half(0))
                check_path(src)
                push = await one.kv_push("node-a", "same-dst", src, sb, db, request=67)
                await dst.wait_layers(67, lay.num_layers - 1, blocks=db, timeout=STEP)
                await push.wait(timeout=STEP)
            assert np.array_equal(whole.read()[lay.nbytes:], expected(data, zeros, lay, sb, db))
            # The source's client went (its share of the allocation with it);
            # the allocation stays open for the other pool.
            async with p2pxfer.connect(a.socket) as three:
                host = await three.kv_pool("same-host", lay, receive=False)
                host.array[:] = 7
                push = await three.kv_push("node-a", "same-dst", host, sb, db, request=68)
                await dst.wait_layers(68, lay.num_layers - 1, blocks=db, timeout=STEP)
                await push.wait(timeout=STEP)
            sevens = np.full(lay.nbytes, 7, np.uint8)
            assert np.array_equal(whole.read()[lay.nbytes:], expected(sevens, zeros, lay, sb, db))

    full = np.zeros(2 * lay.nbytes, np.uint8)
    full[:lay.nbytes] = data
    whole.write(full)
    try:
        trio.run(main)
    finally:
        whole.close()


def test_a_forged_handle_is_refused_and_the_daemon_serves_on(daemons: Any) -> None:
    a, _ = daemons
    with p2pxfer.SyncClient(a.socket) as client:
        if not client.status()["device_memory"]:
            pytest.skip("this libfabric offers no FI_HMEM on shm")
        cuda_or_skip()
        uuid = driver().uuid(0)
        for handle in (bytes(64), os.urandom(64)):
            with pytest.raises(DeviceError):
                client._c.request("share_device", handle=handle, offset=0, size=4096, gpu=uuid)
        with pytest.raises(DeviceError, match="no GPU with UUID"):
            client._c.request("share_device", handle=os.urandom(64), offset=0, size=4096,
                              gpu=bytes(16))
        assert client.status()["clients"] >= 1


def test_direct_true_where_the_daemon_cannot(tmp_path: Any) -> None:
    """A daemon not asked for FI_HMEM: ``direct=True`` is refused with its
    reason, the default stages (and still moves every byte: test_device_kv)."""
    dev = make("driver", LAYOUT.nbytes)
    try:
        with daemon_pair(tmp_path) as (a, _), p2pxfer.SyncClient(a.socket) as client:
            with pytest.raises(DeviceError, match="config hmem = false"):
                client.kv_pool("never-direct", LAYOUT, device=dev.obj, direct=True)
            pool = client.kv_pool("staged-instead", LAYOUT, device=dev.obj)
            assert (pool.kind, pool.direct, pool.stage is not None) == ("cuda", False, True)
    finally:
        dev.close()


def test_shares_of_one_allocation_stay_registered_through_exports_and_frees(
        daemons: Any) -> None:
    """Device shares are registered by their allocation, once: exporting a
    share and unexporting it, or giving back another share of the same
    allocation (overlapping it), leaves the others usable as write
    sources; every byte checked where it landed (a host region on the peer)."""
    a, b = daemons
    whole = make("driver", 1 << 20)
    data = np.random.default_rng(70).integers(0, 256, 1 << 20, dtype=np.uint8)
    whole.write(data)

    class Part:
        def __init__(self, offset: int, nbytes: int) -> None:
            self.__cuda_array_interface__ = {
                "shape": (nbytes,), "typestr": "|u1", "version": 3, "strides": None,
                "data": (whole.address + offset, False)}

    async def main() -> None:
        async with p2pxfer.connect(b.socket) as owner, p2pxfer.connect(a.socket) as client:
            try:
                outer = await client.share_device(Part(0, 1 << 20))
            except DeviceError:
                if EXPECT:
                    raise
                return  # Debian's libfabric: the daemon refuses (test_direct_true_where...)
            dst = await owner.alloc(1 << 20)
            await owner.export("share-dst", dst)
            inner = await client.share_device(Part(1 << 18, 1 << 18))
            await client.export("share-exported", outer)
            await client.unexport("share-exported")
            await client.free(inner)  # lies inside outer: outer stays registered
            pieces = ScatterList(np.array([0, 1 << 19], np.int64),
                                 np.array([4096, 1 << 19], np.int64),
                                 np.array([1 << 16, 1 << 19], np.int64))
            await client.write("node-b", "share-dst", pieces, src=outer, imm=5, notify=True)
            got = dst.array
            assert np.array_equal(got[4096:4096 + (1 << 16)], data[:1 << 16])
            assert np.array_equal(got[1 << 19:], data[1 << 19:])
            await client.free(outer)

    try:
        trio.run(main)
    finally:
        whole.close()
