"""Client device (GPU) memory opened in the daemon: the direct path through
the daemon, where its provider registers CUDA memory (``FI_HMEM``).

A client hands the daemon a CUDA IPC handle of the allocation that holds its
device memory (``share_device``: the handle, the memory's offset and size in
the allocation, the GPU's UUID). The daemon opens it (``cuIpcOpenMemHandle``:
the same memory at an address of its own) and registers that with its engine
as device memory, exactly as an in-process engine registers a CUDA tensor:
peers then write into the client's GPU memory and pushes read from it, with
no host copy on either side. ``DeviceShare`` stands where a memfd's
``SharedMap`` stands (a ``mem`` id of the session: export it, push from it,
lay a KV pool over it); ``DeviceExportMap`` where an export's ``ExportMap``.

Why a CUDA IPC handle, not a dma-buf fd: the daemon's provider is what moves
device memory, and shm (the one provider that does without an RDMA NIC)
moves it with CUDA calls in the registering process, at an address of that
process; a dma-buf fd maps nothing there. An IPC handle gives the daemon
that address; an RDMA NIC registers it as well (as a dma-buf of the daemon's
mapping, or by address). A handle is a capability of the CUDA driver's: a
process that holds one can open that memory itself, so opening it for the
client grants it nothing it did not have.

Unlike a memfd's pages, device memory cannot be swapped for private pages
when an export goes: its keys close at once (``retire`` says so), and the
allocation stays open here until the last share of it is released.

Two shares of one allocation (a caching allocator's tensors in one segment)
open it once: ``IpcMaps`` counts them. Everything here runs on the daemon's
trio thread, except ``copy_device``, which runs on a worker thread while the
trio thread waits for it. What must not live here: the driver calls
themselves (``p2pxfer.cuda``), the registration (``p2pxfer.engine``), the
session's bookkeeping (``_sessions``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from p2pxfer.cuda import IPC_HANDLE_BYTES, UUID_BYTES, CudaDriver, driver
from p2pxfer.devmem import DeviceMemory
from p2pxfer.errors import (
    DeviceError,
    FabricError,
    InvalidArgument,
    RegistrationError,
    ScatterError,
)
from p2pxfer.pages import address_of
from p2pxfer.scatter import ScatterList

if TYPE_CHECKING:
    from p2pxfer.engine import Engine

__all__ = ["DeviceExportMap", "DeviceShare", "IpcMaps", "check_share", "copy_device", "gpu_of",
           "is_device", "takes_device_memory"]



@dataclass(eq=False)
class _Opened:
    """One allocation opened here: its mapping, registered whole with the
    engine (``memory``), and how many shares lie in it."""

    memory: DeviceMemory
    users: int = 0


class IpcMaps:
    """The allocations opened from clients' IPC handles, each once, counted,
    and registered with the engine once, whole: shares of one allocation
    may overlap, and the engine's registrations are by address range (a
    share deregistering its own range would take another's with it)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._open: dict[tuple[bytes, int], _Opened] = {}

    def open(self, drv: CudaDriver, handle: bytes, device: int) -> DeviceMemory:
        """The allocation ``handle`` names, mapped and registered (once)."""
        key = (handle, device)
        entry = self._open.get(key)
        if entry is None:
            address, size = drv.ipc_open(handle, device)
            memory = DeviceMemory(address, size, device, None)
            try:
                self._engine.register(memory, writable=True)
            except (RegistrationError, FabricError) as exc:
                drv.ipc_close(address, device)
                raise DeviceError(f"share_device: {size} bytes of device memory could not be "
                                  f"registered: {exc}") from exc
            except BaseException:
                drv.ipc_close(address, device)
                raise
            entry = self._open[key] = _Opened(memory)
        entry.users += 1
        return entry.memory

    def close(self, drv: CudaDriver, handle: bytes, device: int) -> None:
        """One share of the allocation less; the last deregisters and unmaps it."""
        key = (handle, device)
        entry = self._open[key]
        entry.users -= 1
        if entry.users == 0:
            del self._open[key]
            try:
                self._engine.deregister(entry.memory)
            finally:
                drv.ipc_close(entry.memory.address, device)

    def __len__(self) -> int:
        return len(self._open)


class DeviceShare:
    """A client's device memory, opened here from its IPC handle (the
    ``SharedMap`` of device memory): ``map`` is it, within the allocation
    ``IpcMaps`` registered. ``busy`` counts the same-daemon copies reading
    or writing it now: it is not given back under them."""

    kind = "cuda"

    def __init__(self, maps: IpcMaps, mem_id: int, handle: bytes, offset: int, size: int,
                 device: int, owner: int | None = None) -> None:
        check_share(handle, offset, size)
        self._drv = driver()
        self.device = device
        self._maps, self._handle = maps, handle
        whole = maps.open(self._drv, handle, self.device)
        if offset + size > whole.nbytes:
            maps.close(self._drv, handle, self.device)
            raise ScatterError(f"share_device: [{offset}, {offset + size}) is outside the "
                               f"allocation of {whole.nbytes} bytes the handle names")
        self.id = mem_id
        self.size = size
        self.owner = owner
        self.address = whole.address + offset
        self.map = DeviceMemory(self.address, size, self.device, self)
        self.busy = 0
        self._closed = False

    def view(self, offset: int, length: int | None = None) -> DeviceMemory:
        end = self.size if length is None else offset + length
        if offset < 0 or end > self.size or end <= offset:
            raise ScatterError(f"[{offset}, {end}) is outside memory {self.id} of "
                               f"{self.size} bytes")
        return DeviceMemory(self.address + offset, end - offset, self.device, self)

    def export_map(self, offset: int, length: int) -> DeviceExportMap:
        return DeviceExportMap(self.view(offset, length))

    def close(self) -> None:
        """Give the allocation back (its last share deregisters and unmaps it)."""
        if not self._closed:
            self._closed = True
            self._maps.close(self._drv, self._handle, self.device)


def check_share(handle: bytes, offset: int, size: int, uuid: bytes | None = None) -> None:
    """A ``share_device`` request's fields, as far as they can be judged
    without the driver (``InvalidArgument``)."""
    if uuid is not None and len(uuid) != UUID_BYTES:
        raise InvalidArgument(f"share_device: gpu must be a {UUID_BYTES}-byte UUID, got "
                              f"{len(uuid)} bytes")
    if len(handle) != IPC_HANDLE_BYTES:
        raise InvalidArgument(f"share_device: handle must be {IPC_HANDLE_BYTES} bytes, got "
                              f"{len(handle)}")
    if offset < 0 or size <= 0:
        raise InvalidArgument(f"share_device: offset must be >= 0 and size > 0, got "
                              f"{offset} and {size}")


async def gpu_of(uuid: bytes) -> int:
    """This process's ordinal of the GPU ``uuid`` names, its context made.
    On a worker thread: the first use loads the driver and makes the
    context, which takes the loop's time otherwise (tenths of a second)."""
    def find() -> int:
        drv = driver()
        device = drv.device_of(uuid)
        drv.use(device)
        return device

    return await trio.to_thread.run_sync(find)


class DeviceExportMap:
    """An export's range of a ``DeviceShare``: registered as is. Nothing can
    take its place when the export goes, so ``retire`` answers False and
    its keys close at once (``Exports.remove``)."""

    size = 0  # maps no host memory
    #: its local registration is the allocation's (``IpcMaps``), not its own
    registered_apart = False

    def __init__(self, view: DeviceMemory) -> None:
        self.view = view

    def retire(self) -> bool:
        return False

    def discard(self) -> None:
        pass  # nothing was mapped


def takes_device_memory(engine: Engine) -> bool:
    """Device memory registers as is on every rail of ``engine``: it was
    opened with ``EngineConfig.hmem`` and its provider offered FI_HMEM."""
    return all(rail.hmem for shard in engine.shards for rail in shard.memory.rails)


def is_device(view: Any) -> bool:
    return isinstance(view, DeviceMemory)


_streams: dict[int, int] = {}  # device -> the stream same-daemon copies run on
_streams_lock = threading.Lock()


def copy_device(dst: Any, src: Any, sl: ScatterList) -> int:
    """Copy ``sl`` from ``src`` into ``dst`` where either is device memory
    (a same-daemon write or push: ``_local``), as one batch of async copies
    (adjacent pieces merged, one C call) on a stream of the daemon's, and
    wait for it. Blocks: run it on a worker thread. The pieces copied."""
    drv = driver()
    device = (dst if is_device(dst) else src).device
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = drv.stream(device)
    drv.copy(stream, device, _address(dst), _address(src), sl.src, sl.dst, sl.length)
    drv.stream_sync(stream, device)
    return len(sl)


def _address(view: Any) -> int:
    return int(view.address) if is_device(view) else address_of(memoryview(view))

