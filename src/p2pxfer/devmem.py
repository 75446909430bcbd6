"""Device (GPU) memory: telling it from host memory, and the staged copies
between a device KV pool and its host mirror.

What lives here:

- :func:`device_memory`: the device memory behind a torch CUDA tensor, a
  ``__cuda_array_interface__`` object (CuPy, Numba, ...) or a DLPack
  producer, as a :class:`DeviceMemory`; None for host memory.
- :class:`DeviceStage`: the staged path. A device pool of a ``KVLayout`` has
  a host mirror of the same layout (registered with the fabric as the pool,
  pinned with ``cuMemHostRegister`` so copies run at full PCIe speed); the
  sender copies the blocks being pushed device -> mirror, one CUDA event per
  layer, and posts each layer's writes once its copy is done while later
  layers are still copying (:class:`Staged`); the receiver copies each
  layer mirror -> device as soon as it has landed. Both directions issue
  one batch per layer (``p2pxfer.pages.device_copy_batch``: adjacent blocks
  merged), never Python per block.

What must not live here: the CUDA driver calls (``p2pxfer.cuda``, whose
``CudaDriver`` and ``driver`` are re-exported here), posting or waiting for
fabric writes (the engine, the client), or any torch import at module level
(torch is optional).

Threads: a :class:`DeviceStage` belongs to the task that made it (the
engine's trio thread, or the client's event loop); the other threads are
the worker threads that wait for its CUDA events or issue its copies, and a
``Staged``'s own issuing thread. Issuing and closing exclude each other.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from p2pxfer.cuda import DEVICE_MEMORY_TYPES, CudaDriver, address_of_array, driver
from p2pxfer.errors import DeviceError, InvalidArgument
from p2pxfer.kv_plan import KVLayout, expand_pages

__all__ = ["CudaDriver", "DeviceMemory", "DeviceStage", "device_memory", "driver",
           "memory_kind", "share_fields"]

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# DLPack device types (dlpack.h).
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

    def __len__(self) -> int:  # sized as the memoryviews it stands beside
        return self.nbytes


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
        if kind is None or kind[0] not in DEVICE_MEMORY_TYPES:
            raise DeviceError(f"{type(obj).__name__} claims device memory at {address:#x}, "
                              "which CUDA does not know as such")
        found = DeviceMemory(address, math.prod(shape) * item, kind[1], obj)
    elif hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        found = _from_dlpack(obj)
    if found is not None and found.nbytes <= 0:
        raise InvalidArgument(f"cannot use an empty {type(obj).__name__}")
    return found


def share_fields(dev: DeviceMemory) -> dict[str, Any]:
    """A ``share_device`` request's fields for ``dev``: a CUDA IPC handle of
    its allocation, its offset and size there, and its GPU's UUID (the
    daemon's ordinals may differ from ours). Blocking driver calls."""
    drv = driver()
    handle, offset = drv.ipc_handle(dev.address, dev.nbytes, dev.device)
    return {"handle": handle, "offset": offset, "size": dev.nbytes, "gpu": drv.uuid(dev.device)}


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
        dev, host = self.device.address, address_of_array(self.mirror)
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
