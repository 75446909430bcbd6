"""The CUDA driver calls p2pxfer uses: ctypes over ``libcuda.so.1`` (or
``P2PXFER_LIBCUDA``), the driver API, not the runtime: it ships with the GPU
driver, needs no CUDA toolkit or torch, and shares each device's primary
context with them. Every call is checked in one place
(:meth:`CudaDriver.check`: ``DeviceError`` with ``cuGetErrorString``) and
runs with the device's context pushed for its duration
(:meth:`CudaDriver.on`), so a caller's thread keeps its own current device.

What must not live here: what device memory a Python object is, or the
staged copies of a pool (``p2pxfer.devmem``); loops over pieces (the C
helpers behind ``p2pxfer.pages``). Stateless apart from the contexts
retained per device (under a lock): safe from any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import DeviceError
from p2pxfer.log import get_logger
from p2pxfer.pages import device_copy, device_copy_batch

__all__ = ["DEVICE_MEMORY_TYPES", "IPC_HANDLE_BYTES", "UUID_BYTES", "CudaDriver",
           "address_of_array", "driver"]

log = get_logger("p2pxfer.cuda")

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# CUDA driver API constants (cuda.h); stable across CUDA versions.
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
#: memory types (cuPointerGetAttribute) that are device memory: device, unified
DEVICE_MEMORY_TYPES = (2, 4)
_CU_MEMHOSTREGISTER_PORTABLE = 1
_CU_STREAM_NON_BLOCKING = 1
_CU_EVENT_DISABLE_TIMING = 2
_CUDA_ERROR_NOT_READY = 600
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_CU_FLUSH_RDMA_TARGET_CURRENT_CTX = 0
_CU_FLUSH_RDMA_TO_OWNER = 100
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
#: bytes of a CUDA IPC memory handle (CUipcMemHandle) and of a device UUID
IPC_HANDLE_BYTES = 64
UUID_BYTES = 16


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * UUID_BYTES)]


def address_of_array(array: Any) -> int:
    """The address of a numpy array's first byte."""
    return int(array.__array_interface__["data"][0])


class CudaDriver:
    """The CUDA driver calls p2pxfer uses. One per process (:func:`driver`);
    safe from any thread (each call first makes the context current)."""

    def __init__(self, path: str | None = None) -> None:
        path = path or os.environ.get("P2PXFER_LIBCUDA") or "libcuda.so.1"
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as exc:
            raise DeviceError(f"the CUDA driver ({path}) cannot be loaded: {exc}; device "
                              "memory needs an NVIDIA driver") from exc
        c = self._lib
        vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
        for name, args in {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
            "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
            "cuPointerGetAttribute": [vp, ctypes.c_int, u64],
            "cuMemHostRegister_v2": [vp, sz, ctypes.c_uint],
            "cuMemHostUnregister": [vp],
            "cuStreamCreate": [ctypes.POINTER(vp), ctypes.c_uint],
            "cuStreamDestroy_v2": [vp],
            "cuStreamSynchronize": [vp],
            "cuEventCreate": [ctypes.POINTER(vp), ctypes.c_uint],
            "cuEventRecord": [vp, vp],
            "cuEventQuery": [vp],
            "cuEventSynchronize": [vp],
            "cuEventDestroy_v2": [vp],
            "cuMemcpyAsync": [u64, u64, sz, vp],
            "cuMemAlloc_v2": [ctypes.POINTER(u64), sz],
            "cuMemFree_v2": [u64],
            "cuMemsetD8Async": [u64, ctypes.c_ubyte, sz, vp],
        }.items():
            fn = getattr(c, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        #: cuMemcpyAsync's address, for the C loop (p2p_device_copy)
        self.memcpy_async = int(ctypes.cast(c.cuMemcpyAsync, vp).value or 0)
        self.check(c.cuInit(0), "cuInit")
        #: CUDA 13's cuMemcpyBatchAsync (one call for a whole layer's copies)
        #: where the driver has it, else None (one cuMemcpyAsync per run)
        self.memcpy_batch = self._batch_entry()
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        # Bound on first use (``_call``): only device memory handed to another
        # process needs them, and a driver (or a test's stand-in) without
        # them serves everything else.
        self._later: dict[str, list[Any]] = {
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGetUuid": [ctypes.POINTER(_Uuid), ctypes.c_int],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(sz), u64],
            "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), u64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [u64],
        }

    def _call(self, name: str, *args: Any) -> int:
        """Driver entry point ``name`` (one of ``_later``), bound once;
        ``DeviceError`` where this driver lacks it."""
        fn = getattr(self._lib, name, None)
        if fn is None:
            raise DeviceError(f"this CUDA driver has no {name}")
        with self._lock:
            args_of = self._later.pop(name, None)
            if args_of is not None:
                fn.argtypes, fn.restype = args_of, ctypes.c_int
        return int(fn(*args))

    def _batch_entry(self) -> int | None:
        if os.environ.get("P2PXFER_CUDA_BATCH", "1") == "0":
            return None
        get = getattr(self._lib, "cuGetProcAddress_v2", None)
        version = ctypes.c_int()
        if get is None or self._lib.cuDriverGetVersion(ctypes.byref(version)) != 0 \
                or version.value < 13000:
            return None
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        get.restype = ctypes.c_int
        fn, found = ctypes.c_void_p(), ctypes.c_int()
        # Asked for by version: CUDA 12.8's cuMemcpyBatchAsync takes one
        # argument more (failIdx) than 13.0's, which is the one called.
        if get(b"cuMemcpyBatchAsync", ctypes.byref(fn), 13000, 0, ctypes.byref(found)) != 0 \
                or found.value != 0 or not fn.value:
            return None
        return int(fn.value)

    def check(self, rc: int, call: str, what: str = "") -> None:
        """Raise ``DeviceError`` for a failed driver call (the one place)."""
        if rc == 0:
            return
        text = ctypes.c_char_p()
        self._lib.cuGetErrorString(rc, ctypes.byref(text))
        detail = (text.value or b"unknown error").decode(errors="replace")
        raise DeviceError(f"{call} failed{' (' + what + ')' if what else ''}: {detail} [{rc}]")

    def _context(self, device: int) -> int:
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                dev, out = ctypes.c_int(), ctypes.c_void_p()
                self.check(self._lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet",
                           f"device {device}")
                self.check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(out), dev),
                           "cuDevicePrimaryCtxRetain")
                ctx = self._contexts[device] = int(out.value or 0)
            return ctx

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """``device``'s primary context (the one torch and CuPy use) current
        in this thread for the block, and whatever was current before
        current again after it: the caller's thread (an event loop, a
        serving engine's) keeps its own device."""
        self.check(self._lib.cuCtxPushCurrent_v2(ctypes.c_void_p(self._context(device))),
                   "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def use(self, device: int) -> None:
        """Check that ``device`` can be used (its primary context exists)."""
        with self.on(device):
            pass

    def pointer_kind(self, address: int) -> tuple[int, int] | None:
        """(memory type, device ordinal) of ``address``; None when CUDA does
        not know it (plain host memory)."""
        mtype, ordinal = ctypes.c_uint(), ctypes.c_int()
        rc = self._lib.cuPointerGetAttribute(ctypes.byref(mtype),
                                             _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
        if rc != 0:
            return None
        self.check(self._lib.cuPointerGetAttribute(
            ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address),
            "cuPointerGetAttribute")
        return int(mtype.value), int(ordinal.value)

    def host_register(self, array: U8, device: int) -> bool:
        """Pin ``array`` (page-locked, mapped for the device). False when it
        already was (then it is not ours to unpin)."""
        with self.on(device):
            rc = self._lib.cuMemHostRegister_v2(ctypes.c_void_p(address_of_array(array)),
                                                array.nbytes, _CU_MEMHOSTREGISTER_PORTABLE)
            if rc == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                return False
            self.check(rc, "cuMemHostRegister", f"{array.nbytes} bytes")
            return True

    def host_unregister(self, array: U8, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuMemHostUnregister(ctypes.c_void_p(address_of_array(array))),
                       "cuMemHostUnregister")

    def dmabuf(self, address: int, nbytes: int, device: int) -> tuple[int, int]:
        """A dma-buf fd for the whole allocation holding ``address`` (so a
        caching allocator's blocks share one), and ``address``'s offset in
        it: (fd, offset). The caller closes the fd."""
        with self.on(device):
            get_range = getattr(self._lib, "cuMemGetAddressRange_v2", None)
            get_handle = getattr(self._lib, "cuMemGetHandleForAddressRange", None)
            if get_range is None or get_handle is None:
                raise DeviceError("this CUDA driver exports no dma-bufs")
            base, size, fd = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int(-1)
            self.check(get_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
                       "cuMemGetAddressRange")
            if address + nbytes > base.value + size.value:
                raise DeviceError(f"{nbytes} bytes at {address:#x} run past their allocation")
            self.check(get_handle(ctypes.byref(fd), ctypes.c_uint64(base.value), size,
                                  _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ctypes.c_ulonglong(0)),
                       "cuMemGetHandleForAddressRange")
            return int(fd.value), address - int(base.value)

    def allocation(self, address: int, device: int) -> tuple[int, int]:
        """(start, size) of the allocation holding ``address``."""
        with self.on(device):
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            self.check(self._call("cuMemGetAddressRange_v2", ctypes.byref(base),
                                  ctypes.byref(size), address), "cuMemGetAddressRange")
            return int(base.value), int(size.value)

    def uuid(self, device: int) -> bytes:
        """``device``'s UUID: names one GPU in every process, whatever the
        ordinals ``CUDA_VISIBLE_DEVICES`` gives it there."""
        dev, out = ctypes.c_int(), _Uuid()
        self.check(self._lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet",
                   f"device {device}")
        self.check(self._call("cuDeviceGetUuid", ctypes.byref(out), dev), "cuDeviceGetUuid",
                   f"device {device}")
        return ctypes.string_at(ctypes.addressof(out), UUID_BYTES)

    def device_of(self, uuid: bytes) -> int:
        """This process's ordinal of the GPU whose UUID is ``uuid``."""
        count = ctypes.c_int()
        self.check(self._call("cuDeviceGetCount", ctypes.byref(count)), "cuDeviceGetCount")
        for ordinal in range(count.value):
            if self.uuid(ordinal) == uuid:
                return ordinal
        raise DeviceError(f"no GPU with UUID {uuid.hex()} is visible to this process "
                          f"({count.value} are)")

    def ipc_handle(self, address: int, nbytes: int, device: int) -> tuple[bytes, int]:
        """A CUDA IPC handle of the allocation holding ``address`` (another
        process opens it with :meth:`ipc_open`), and ``address``'s offset
        into it. Memory of ``cuMemAlloc`` / ``cudaMalloc`` (a caching
        allocator's segments); not of the virtual memory API
        (``cuMemCreate``, torch's expandable segments)."""
        base, size = self.allocation(address, device)
        if address + nbytes > base + size:
            raise DeviceError(f"{nbytes} bytes at {address:#x} run past their allocation")
        out = _IpcHandle()
        with self.on(device):
            self.check(self._call("cuIpcGetMemHandle", ctypes.byref(out), base),
                       "cuIpcGetMemHandle", f"the allocation at {base:#x}")
        return ctypes.string_at(ctypes.addressof(out), IPC_HANDLE_BYTES), address - base

    def ipc_open(self, handle: bytes, device: int) -> tuple[int, int]:
        """Map the allocation another process's ``handle`` names into this
        process (:meth:`ipc_close` unmaps it): (its address here, its size)."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise DeviceError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, not "
                              f"{len(handle)}")
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
        with self.on(device):
            out = ctypes.c_uint64()
            self.check(self._call("cuIpcOpenMemHandle_v2", ctypes.byref(out), h,
                                  _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        try:
            return int(out.value), self.allocation(int(out.value), device)[1]
        except BaseException:
            self.ipc_close(int(out.value), device)
            raise

    def ipc_close(self, address: int, device: int) -> None:
        with self.on(device):
            self.check(self._call("cuIpcCloseMemHandle", address), "cuIpcCloseMemHandle")

    def stream(self, device: int) -> int:
        with self.on(device):
            out = ctypes.c_void_p()
            self.check(self._lib.cuStreamCreate(ctypes.byref(out), _CU_STREAM_NON_BLOCKING),
                       "cuStreamCreate")
            return int(out.value or 0)

    def stream_destroy(self, stream: int, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuStreamDestroy_v2(ctypes.c_void_p(stream)), "cuStreamDestroy")

    def stream_sync(self, stream: int, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuStreamSynchronize(ctypes.c_void_p(stream)),
                       "cuStreamSynchronize")

    def record(self, stream: int, device: int) -> int:
        """A new event recorded on ``stream`` (destroy it with :meth:`event_done`)."""
        with self.on(device):
            out = ctypes.c_void_p()
            self.check(self._lib.cuEventCreate(ctypes.byref(out), _CU_EVENT_DISABLE_TIMING),
                       "cuEventCreate")
            rc = self._lib.cuEventRecord(out, ctypes.c_void_p(stream))
            if rc:
                self._lib.cuEventDestroy_v2(out)
                self.check(rc, "cuEventRecord")
            return int(out.value or 0)

    def event_ready(self, event: int, device: int) -> bool:
        with self.on(device):
            rc = self._lib.cuEventQuery(ctypes.c_void_p(event))
            if rc == _CUDA_ERROR_NOT_READY:
                return False
            self.check(rc, "cuEventQuery")
            return True

    def event_sync(self, event: int, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuEventSynchronize(ctypes.c_void_p(event)), "cuEventSynchronize")

    def event_done(self, event: int, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuEventDestroy_v2(ctypes.c_void_p(event)), "cuEventDestroy")

    def flush_rdma_writes(self, device: int) -> None:
        """Make writes a NIC placed in ``device``'s memory (GPUDirect RDMA)
        visible to work on it that starts after this returns; where the
        driver has no such call, nothing."""
        flush = getattr(self._lib, "cuFlushGPUDirectRDMAWrites", None)
        if flush is None:
            return
        with self.on(device):
            self.check(flush(_CU_FLUSH_RDMA_TARGET_CURRENT_CTX, _CU_FLUSH_RDMA_TO_OWNER),
                       "cuFlushGPUDirectRDMAWrites")

    def alloc(self, nbytes: int, device: int) -> int:
        with self.on(device):
            out = ctypes.c_uint64()
            self.check(self._lib.cuMemAlloc_v2(ctypes.byref(out), nbytes), "cuMemAlloc",
                       f"{nbytes} bytes")
            return int(out.value)

    def free(self, address: int, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuMemFree_v2(address), "cuMemFree")

    def copy(self, stream: int, device: int, dst: int, src: int, src_off: I64, dst_off: I64,
             length: I64) -> int:
        """Issue pieces as async copies on ``stream`` (one C call; adjacent
        pieces merged); the copies issued."""
        with self.on(device):
            n = len(length)
            if n == 0:
                return 0
            so, do, ln = (np.ascontiguousarray(a, np.int64) for a in (src_off, dst_off, length))
            if self.memcpy_batch is not None:
                rc = device_copy_batch(self.memcpy_batch, stream, dst, src, so, do, ln)
                if rc >= 0:
                    return rc
                # A driver that has the entry point but refuses the batch: the
                # copies go one by one from now on.
                log.warning("cuda.batch_refused", error=-rc)
                self.memcpy_batch = None
            rc, i = device_copy(self.memcpy_async, stream, dst, src, so, do, ln)
            if rc < 0:
                self.check(-rc, "cuMemcpyAsync",
                           f"piece {i}: {int(ln[i])} bytes, {src + int(so[i]):#x} -> "
                           f"{dst + int(do[i]):#x}")
            return rc


_driver: list[CudaDriver] = []  # the process's one, once loaded
_driver_lock = threading.Lock()


def driver() -> CudaDriver:
    """The process's ``CudaDriver`` (loaded on first use)."""
    with _driver_lock:
        if not _driver:
            _driver.append(CudaDriver())
        return _driver[0]
