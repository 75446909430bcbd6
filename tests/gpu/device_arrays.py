"""Device memory for the GPU tests, of each kind ``p2pxfer.devmem`` accepts:
torch CUDA tensors, ``__cuda_array_interface__`` objects (allocated with the
CUDA driver itself, so they need neither torch nor CuPy) and DLPack
producers. Each kind reads and writes its bytes through the host for the
tests' checks."""

from __future__ import annotations

import ctypes
import importlib
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pytest

from p2pxfer.devmem import driver
from p2pxfer.errors import DeviceError
from p2pxfer.testing import DriverArray

U8 = npt.NDArray[np.uint8]


class DeviceArray(Protocol):
    obj: Any  # what a pool is given

    def read(self) -> U8: ...

    def write(self, data: U8) -> None: ...


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class VmmArray(DriverArray):
    """Device memory of CUDA's virtual memory API (``cuMemCreate`` mapped
    with ``cuMemMap``), as torch's expandable segments allocate: CUDA IPC
    handles do not cover it."""

    def _alloc(self) -> int:
        lib, u64 = self.drv._lib, ctypes.c_uint64
        prop = _AllocProp(type=1, location=_Location(type=1, id=0))  # pinned, device 0
        gran = ctypes.c_size_t()
        handle, address = u64(), u64()
        with self.drv.on(0):
            self.drv.check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran),
                                                             ctypes.byref(prop), 0),
                           "cuMemGetAllocationGranularity")
            self.size = -(-self.nbytes // gran.value) * gran.value
            self.drv.check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size),
                                           ctypes.byref(prop), u64(0)), "cuMemCreate")
            self.handle = handle.value
            self.drv.check(lib.cuMemAddressReserve(ctypes.byref(address),
                                                   ctypes.c_size_t(self.size),
                                                   ctypes.c_size_t(0), u64(0), u64(0)),
                           "cuMemAddressReserve")
            self.drv.check(lib.cuMemMap(u64(address.value), ctypes.c_size_t(self.size),
                                        ctypes.c_size_t(0), u64(self.handle), u64(0)),
                           "cuMemMap")
            access = _AccessDesc(location=_Location(type=1, id=0), flags=3)  # read-write
            self.drv.check(lib.cuMemSetAccess(u64(address.value), ctypes.c_size_t(self.size),
                                              ctypes.byref(access), ctypes.c_size_t(1)),
                           "cuMemSetAccess")
        return int(address.value)

    def _free(self) -> None:
        lib, u64 = self.drv._lib, ctypes.c_uint64
        with self.drv.on(0):
            lib.cuMemUnmap(u64(self.address), ctypes.c_size_t(self.size))
            lib.cuMemRelease(u64(self.handle))
            lib.cuMemAddressFree(u64(self.address), ctypes.c_size_t(self.size))


class TorchArray:
    def __init__(self, nbytes: int, dlpack: bool = False) -> None:
        self.torch = importlib.import_module("torch")
        self.tensor = self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda")
        self.obj = _DLPackOnly(self.tensor) if dlpack else self.tensor

    def read(self) -> U8:
        self.torch.cuda.synchronize()
        return np.asarray(self.tensor.cpu().numpy(), np.uint8)

    def write(self, data: U8) -> None:
        self.tensor.copy_(self.torch.from_numpy(np.ascontiguousarray(data, np.uint8)))
        self.torch.cuda.synchronize()

    def close(self) -> None:
        del self.tensor


class _DLPackOnly:
    """Only the DLPack protocol of a tensor (what JAX or others hand over)."""

    def __init__(self, tensor: Any) -> None:
        self._t = tensor

    def __dlpack__(self, **kw: Any) -> Any:
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


KINDS = ("driver", "torch", "dlpack")


def cuda_or_skip() -> None:
    try:
        driver().use(0)
    except DeviceError as exc:
        pytest.skip(f"no CUDA device here: {exc}")


def make(kind: str, nbytes: int) -> Any:
    """A device array of ``kind`` (skips when that kind is not at hand)."""
    cuda_or_skip()
    if kind == "driver":
        return DriverArray(nbytes)
    if kind == "vmm":
        return VmmArray(nbytes)
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return TorchArray(nbytes, dlpack=kind == "dlpack")
