"""Device-memory registration (FI_HMEM) where no GPU is needed to check it:
a rail opened without FI_HMEM refuses CUDA memory with a clear error; one
opened with it hands the registration to the provider (``fi_mr_regattr``
with iface FI_HMEM_CUDA), whose refusal (Debian's libfabric is built without
CUDA: -FI_ENOSYS) comes back as a ``FabricError`` naming the call; an
engine asked for FI_HMEM on a provider without it opens as before and moves
host memory. The GPU side is ``tests/gpu``."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from conftest import engine_pair
from p2pxfer.errors import FabricError, RegistrationError
from p2pxfer.fabric import ACCESS_REMOTE_WRITE, Rail, getinfo
from p2pxfer.fabric._binding import lib
from p2pxfer.loopback import loopback_node
from p2pxfer.scatter import ScatterList


def test_a_rail_without_hmem_refuses_device_memory() -> None:
    rail = Rail.open("tcp;ofi_rxm", node=loopback_node("tcp;ofi_rxm"))
    try:
        assert not rail.hmem
        buf = np.zeros(1 << 16, np.uint8)
        with pytest.raises(RegistrationError, match="FI_HMEM"):
            rail.register(buf.ctypes.data, buf.nbytes, ACCESS_REMOTE_WRITE, device=0)
        rail.deregister(rail.register(buf.ctypes.data, buf.nbytes, ACCESS_REMOTE_WRITE))
    finally:
        rail.close()


def test_hmem_registration_reaches_the_provider() -> None:
    """shm offers FI_HMEM; whether this libfabric can register CUDA memory
    is then the provider's answer, passed on as a FabricError (never a crash)."""
    infos = getinfo("shm", hmem=True)
    if not infos[0].hmem:
        pytest.skip("this libfabric's shm does not offer FI_HMEM")
    rail = Rail(infos[0])
    try:
        buf = np.zeros(1 << 16, np.uint8)
        try:
            mr = rail.register(buf.ctypes.data, buf.nbytes, ACCESS_REMOTE_WRITE, device=0)
        except FabricError as exc:
            assert exc.call == "fi_mr_regattr" and "CUDA memory" in str(exc)
            assert exc.code == -lib.FI_ENOSYS, exc  # built without CUDA
        else:  # a libfabric with CUDA took host memory as "device 0"
            rail.deregister(mr)
    finally:
        rail.close()


async def test_an_engine_asked_for_hmem_still_moves_host_memory() -> None:
    """tcp has no FI_HMEM: the engine opens without it and works as ever."""
    async with engine_pair("tcp;ofi_rxm", hmem=True) as (a, b):
        assert not any(r.hmem for s in a.shards for r in s.memory.rails)
        assert a.export_kinds() == {}
        dst = np.zeros(1 << 20, np.uint8)
        src = np.arange(1 << 20, dtype=np.int64).astype(np.uint8)
        desc = b.export(dst, "hmem-probe")
        assert b.export_kinds() == {"hmem-probe": "host"}
        a.register(src)
        with trio.fail_after(20):
            await a.write(src, desc, ScatterList.contiguous(src.nbytes), imm=5, notify=True)
            await b.wait_imm(5, 1)  # landed (a write's completion says only "sent")
        assert np.array_equal(dst, src)
