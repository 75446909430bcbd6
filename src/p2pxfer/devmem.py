"""Device (GPU) memory: telling it from host memory, the CUDA driver calls
p2pxfer needs, and the staged copies between a device KV pool and its host
mirror.

What lives here:

- :func:`device_memory`: the device memory behind a torch CUDA tensor, a
  ``__cuda_array_interface__`` object (CuPy, Numba, ...) or a DLPack
  producer, as a :class:`DeviceMemory`; None for host memory.
- :class:`CudaDriver`: the few CUDA *driver* calls used (ctypes over
  ``libcuda.so.1``, or ``P2PXFER_LIBCUDA``), each checked in one place
  (:meth:`CudaDriver.check`, ``DeviceError`` carrying ``cuGetErrorString``).
  The driver API, not the runtime: it ships with the GPU driver, needs no
  CUDA toolkit or torch, and shares the device's primary context with them.
- :class:`DeviceStage`: the staged path. A device pool of a ``KVLayout`` has
  a host mirror of the same layout (registered with the fabric as the pool,
  pinned with ``cuMemHostRegister`` so copies run at full PCIe speed); the
  sender copies the blocks being pushed device -> mirror, one CUDA event per
  layer, and posts each layer's writes once its copy is done while later
  layers are still copying; the receiver copies each layer mirror -> device
  as soon as it has landed. Both directions use one C call per layer
  (``p2p_device_copy``: adjacent blocks merged), never Python per block.

What must not live here: posting or waiting for fabric writes (the engine,
the client), or any torch import at module level (torch is optional).

Threads: a :class:`DeviceStage` belongs to the task that made it (the
engine's trio thread, or the client's event loop); the only other threads
are the worker threads that wait for its CUDA events. CUDA's current context
is per thread, so every entry point makes the device's primary context
current in the thread it runs on (:meth:`CudaDriver.use`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from p2pxfer._pages import ffi, lib
from p2pxfer.errors import DeviceError, InvalidArgument
from p2pxfer.kv_plan import KVLayout, expand_pages
from p2pxfer.log import get_logger

__all__ = ["CudaDriver", "DeviceMemory", "DeviceStage", "device_memory", "driver",
           "memory_kind"]

log = get_logger("p2pxfer.devmem")

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# CUDA driver API constants (cuda.h); stable across CUDA versions.
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_HOST = 1
_CU_MEMORYTYPE_DEVICE = 2
_CU_MEMORYTYPE_UNIFIED = 4
_CU_MEMHOSTREGISTER_PORTABLE = 1
_CU_STREAM_NON_BLOCKING = 1
_CU_EVENT_DISABLE_TIMING = 2
_CUDA_ERROR_NOT_READY = 600
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_CU_FLUSH_RDMA_TARGET_CURRENT_CTX = 0
_CU_FLUSH_RDMA_TO_OWNER = 100
_KDL_CUDA = 2
_KDL_CUDA_HOST = 3
_KDL_CUDA_MANAGED = 13


@dataclass(frozen=True)
class DeviceMemory:
    """``nbytes`` of CUDA device memory at ``address`` on device ``device``;
    ``owner`` keeps it alive (the tensor, array or DLPack capsule)."""

    address: int
    nbytes: int
    device: int
    owner: Any
    kind: str = "cuda"


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
        self.memcpy_async = ffi.cast("void *", ctypes.cast(c.cuMemcpyAsync, vp).value)
        self.check(c.cuInit(0), "cuInit")
        #: CUDA 13's cuMemcpyBatchAsync (one call for a whole layer's copies)
        #: where the driver has it, else None (one cuMemcpyAsync per run)
        self.memcpy_batch = self._batch_entry()
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()

    def _batch_entry(self) -> Any:
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
        return ffi.cast("void *", fn.value)

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
            rc = self._lib.cuMemHostRegister_v2(ctypes.c_void_p(_address(array)), array.nbytes,
                                                _CU_MEMHOSTREGISTER_PORTABLE)
            if rc == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                return False
            self.check(rc, "cuMemHostRegister", f"{array.nbytes} bytes")
            return True

    def host_unregister(self, array: U8, device: int) -> None:
        with self.on(device):
            self.check(self._lib.cuMemHostUnregister(ctypes.c_void_p(_address(array))),
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
            ptrs = [ffi.cast("const int64_t *", a.ctypes.data) for a in (so, do, ln)]
            if self.memcpy_batch is not None:
                scratch = np.empty(3 * n, np.uint64)
                rc = lib.p2p_device_copy_batch(self.memcpy_batch, ffi.cast("void *", stream), dst,
                                               src, *ptrs, n,
                                               ffi.cast("uint64_t *", scratch.ctypes.data))
                if rc >= 0:
                    return int(rc)
                # A driver that has the entry point but refuses the batch: the
                # copies go one by one from now on.
                log.warning("devmem.batch_refused", error=-int(rc))
                self.memcpy_batch = None
            failed = ffi.new("int64_t *")
            rc = lib.p2p_device_copy(self.memcpy_async, ffi.cast("void *", stream), dst, src,
                                     *ptrs, n, failed)
            if rc < 0:
                i = int(failed[0])
                self.check(int(-rc), "cuMemcpyAsync",
                           f"piece {i}: {int(ln[i])} bytes, {src + int(so[i]):#x} -> "
                           f"{dst + int(do[i]):#x}")
            return int(rc)


_driver: list[CudaDriver] = []  # the process's one, once loaded
_driver_lock = threading.Lock()


def driver() -> CudaDriver:
    """The process's ``CudaDriver`` (loaded on first use)."""
    with _driver_lock:
        if not _driver:
            _driver.append(CudaDriver())
        return _driver[0]


def _address(array: Any) -> int:
    return int(array.__array_interface__["data"][0])


def _typestr_bytes(typestr: str) -> int:
    try:
        return int(typestr[2:])
    except ValueError as exc:
        raise InvalidArgument(f"unknown __cuda_array_interface__ typestr {typestr!r}") from exc


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, item: int) -> bool:
    if strides is None:
        return True
    expect = item
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(obj: Any) -> DeviceMemory | None:
    dev_type, dev_id = obj.__dlpack_device__()
    if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        return None  # host memory, pinned or not, goes the host way
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.argtypes, get.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
    # DLManagedTensor starts with its DLTensor. The capsule stays unconsumed
    # and is kept as the owner: its destructor frees the tensor when dropped.
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    shape = tuple(t.shape[i] for i in range(t.ndim))
    item = t.bits * t.lanes // 8
    strides = (None if not t.strides else tuple(t.strides[i] * item for i in range(t.ndim)))
    if not _c_contiguous(shape, strides, item):
        raise InvalidArgument("the DLPack tensor must be C-contiguous")
    return DeviceMemory(int(t.data or 0) + int(t.byte_offset), math.prod(shape) * item,
                        int(dev_id), capsule)


def device_memory(obj: Any) -> DeviceMemory | None:
    """The device memory ``obj`` is (a ``DeviceMemory`` passes through), or
    None when it is host memory. Raises ``InvalidArgument`` for a device
    tensor that is not contiguous or empty."""
    if isinstance(obj, DeviceMemory):
        return obj
    found: DeviceMemory | None = None
    if type(obj).__module__.startswith("torch") and hasattr(obj, "is_cuda"):
        if not obj.is_cuda:
            return None
        if not obj.is_contiguous():
            raise InvalidArgument("the CUDA tensor must be contiguous")
        found = DeviceMemory(int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()),
                             int(obj.device.index or 0), obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        shape = tuple(int(n) for n in cai["shape"])
        item = _typestr_bytes(cai["typestr"])
        strides = cai.get("strides")
        if not _c_contiguous(shape, None if strides is None else tuple(strides), item):
            raise InvalidArgument("the __cuda_array_interface__ array must be C-contiguous")
        address = int(cai["data"][0])
        kind = driver().pointer_kind(address) if address else None
        if kind is None or kind[0] not in (_CU_MEMORYTYPE_DEVICE, _CU_MEMORYTYPE_UNIFIED):
            raise DeviceError(f"{type(obj).__name__} claims device memory at {address:#x}, "
                              "which CUDA does not know as such")
        found = DeviceMemory(address, math.prod(shape) * item, kind[1], obj)
    elif hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        found = _from_dlpack(obj)
    if found is not None and found.nbytes <= 0:
        raise InvalidArgument(f"cannot use an empty {type(obj).__name__}")
    return found


def memory_kind(obj: Any) -> str:
    """``"cuda"`` for device memory, ``"host"`` otherwise."""
    found = device_memory(obj)
    return "host" if found is None else found.kind


class DeviceStage:
    """The copies between a device pool and its host mirror (both laid out
    as ``layout``; block offsets are the same on both sides)."""

    def __init__(self, device: DeviceMemory, mirror: U8, layout: KVLayout) -> None:
        if device.nbytes < layout.nbytes:
            raise InvalidArgument(f"device memory holds {device.nbytes} bytes, the layout "
                                  f"needs {layout.nbytes}")
        if mirror.nbytes < layout.nbytes:
            raise InvalidArgument(f"the host mirror holds {mirror.nbytes} bytes, the layout "
                                  f"needs {layout.nbytes}")
        self.device = device
        self.mirror = mirror
        self.layout = layout
        self._drv = driver()
        # Issuing copies and closing exclude each other: a pool closed from
        # another task mid-push must not destroy the stream or unpin the
        # mirror under copies being issued.
        self._lock = threading.Lock()
        self._pinned = self._drv.host_register(mirror, device.device)
        try:
            self._stream = self._drv.stream(device.device)
        except BaseException:
            self._unpin()
            raise
        self._closed = False

    @property
    def kind(self) -> str:
        return self.device.kind

    def _unpin(self) -> None:
        if self._pinned:
            self._pinned = False
            self._drv.host_unregister(self.mirror, self.device.device)

    def _pieces(self, blocks: Any, layers: list[int]) -> tuple[I64, I64, I64, I64]:
        ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.layout.num_blocks):
            raise InvalidArgument(f"block ids must be within 0..{self.layout.num_blocks - 1}")
        return expand_pages(self.layout, self.layout, ids, ids, layers)

    def _issue(self, blocks: Any, layers: list[int], to_host: bool) -> list[int]:
        """One event per layer, recorded after that layer's copies."""
        off, _, length, counts = self._pieces(blocks, layers)
        with self._lock:
            if self._closed:
                raise DeviceError("the device pool is closed")
            return self._issue_locked(off, length, counts, to_host)

    def _issue_locked(self, off: I64, length: I64, counts: I64, to_host: bool) -> list[int]:
        dev, host = self.device.address, _address(self.mirror)
        dst, src = (host, dev) if to_host else (dev, host)
        events: list[int] = []
        start = 0
        try:
            for count in counts.tolist():
                part = slice(start, start + count)
                self._drv.copy(self._stream, self.device.device, dst, src, off[part], off[part],
                               length[part])
                events.append(self._drv.record(self._stream, self.device.device))
                start += count
        except BaseException:
            self.release(events)
            raise
        return events

    def to_host(self, blocks: Any, layers: list[int]) -> list[int]:
        """Start copying ``blocks`` of ``layers`` device -> mirror; one event
        per layer, in order (wait with :meth:`wait`, then :meth:`release`)."""
        return self._issue(blocks, layers, to_host=True)

    def to_device(self, blocks: Any, layers: list[int]) -> list[int]:
        """Start copying ``blocks`` of ``layers`` mirror -> device."""
        return self._issue(blocks, layers, to_host=False)

    async def wait(self, event: int) -> None:
        """Until ``event``'s copies are done, without blocking the loop: a
        worker thread waits. Not cancellable: the copies end by themselves
        soon, and the event must outlive the thread waiting on it."""
        if self._drv.event_ready(event, self.device.device):
            return
        await anyio.to_thread.run_sync(self._drv.event_sync, event, self.device.device)

    def sync(self, event: int) -> None:
        """Block this thread until ``event``'s copies are done (blocking callers)."""
        self._drv.event_sync(event, self.device.device)

    def release(self, events: list[int]) -> None:
        for ev in events:
            self._drv.event_done(ev, self.device.device)
        events.clear()

    def staged(self, blocks: Any, layers: list[int]) -> Staged:
        """Start copying ``blocks`` of ``layers`` device -> mirror, layer
        after layer, in a thread of its own (see :class:`Staged`)."""
        return Staged(self, blocks, layers)

    async def copy_in(self, blocks: Any, layers: list[int]) -> None:
        """Copy ``blocks`` of ``layers`` mirror -> device and wait for it.
        The copies are issued from a worker thread: the driver's cost per
        copy (microseconds, one per run of blocks) stays off the loop."""
        events = await anyio.to_thread.run_sync(self.to_device, blocks, layers)
        try:
            if events:
                await self.wait(events[-1])  # one stream: the last covers all
        finally:
            self.release(events)

    def close(self) -> None:
        """Wait for copies under way, then drop the stream and unpin."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._drv.stream_sync(self._stream, self.device.device)
                self._drv.stream_destroy(self._stream, self.device.device)
            finally:
                self._unpin()


class Staged:
    """A sender's copies device -> mirror, issued layer after layer by a
    thread of its own, so the caller posts layer ``k`` (:meth:`ready`) while
    the copies of later layers are still being issued and run: issuing costs
    the driver microseconds per run of blocks, which would otherwise hold
    back the first post. Blocks are checked before the thread starts.
    :meth:`close` (always) stops issuing and frees the events once every
    copy issued is done."""

    def __init__(self, stage: DeviceStage, blocks: Any, layers: list[int]) -> None:
        stage._pieces(blocks, layers)  # InvalidArgument here, not in the thread
        self._stage = stage
        self._events: list[int] = []
        self._issued = [threading.Event() for _ in layers]
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(blocks, layers), daemon=True,
                                        name="p2pxfer-cuda-issue")
        self._thread.start()

    def _run(self, blocks: Any, layers: list[int]) -> None:
        try:
            for k, layer in enumerate(layers):
                if self._stop:
                    break
                self._events += self._stage.to_host(blocks, [layer])
                self._issued[k].set()
        except BaseException as exc:  # handed to whoever waits
            self._error = exc
        finally:
            for flag in self._issued:
                flag.set()

    def ready_sync(self, k: int) -> None:
        """Block until layer ``k`` (its index in ``layers``) is in the mirror."""
        self._issued[k].wait()
        if k >= len(self._events):
            raise self._error or DeviceError("the copies were stopped")
        self._stage.sync(self._events[k])

    def is_ready(self, k: int) -> bool:
        """Layer ``k`` is in the mirror now (never blocks)."""
        return (self._issued[k].is_set() and k < len(self._events)
                and self._stage._drv.event_ready(self._events[k], self._stage.device.device))

    async def ready(self, k: int) -> None:
        """Until layer ``k`` is in the mirror, without blocking the loop."""
        if not self.is_ready(k):
            await anyio.to_thread.run_sync(self.ready_sync, k)

    def ready_after(self, k: int) -> int:
        """How many layers from ``k`` on are in the mirror now, in a row
        (at least layer ``k``, which the caller waited for): they can go
        out together."""
        n = 1
        while k + n < len(self._issued) and self.is_ready(k + n):
            n += 1
        return n

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread, shielded: it joins the issuing
        thread and waits for the copies it issued, which the loop must not."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        try:
            if self._events:
                self._stage.sync(self._events[-1])  # one stream: the last covers all
        finally:
            self._stage.release(self._events)
