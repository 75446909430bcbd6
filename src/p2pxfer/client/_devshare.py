"""Device memory handed to the daemon as is (``share_device``), on the
client's side: the handle that keeps it alive and names it in requests, and
the request's fields. The daemon's side is ``p2pxfer.daemon._device``.
Owned by whichever thread or task made it (no state is shared)."""

from __future__ import annotations

from typing import Any

from p2pxfer.devmem import DeviceMemory, device_memory, share_fields
from p2pxfer.errors import InvalidArgument

__all__ = ["DeviceShared", "device_memory_of", "device_share"]


class DeviceShared:
    """Device memory the daemon took as is (:meth:`Client.share_device`):
    it opened the allocation from its CUDA IPC handle and registered it;
    ``mem_id`` names it in requests as an ``alloc``'s does. The memory stays
    the caller's: this keeps it alive until freed, and never frees it."""

    kind = "cuda"

    def __init__(self, device: DeviceMemory, mem_id: int) -> None:
        self.device = device
        self.mem_id = mem_id
        self.stage: Any = None  # as SharedMemory's: never a staged pool's mirror

    @property
    def nbytes(self) -> int:
        return self.device.nbytes

    def close(self) -> None:
        """Nothing to unmap here (the daemon's mapping goes with the connection)."""


def device_share(obj: Any) -> tuple[DeviceMemory, dict[str, Any]]:
    """``obj`` as device memory and its ``share_device`` fields (blocking)."""
    dev = device_memory(obj)
    if dev is None:
        raise InvalidArgument(f"share_device takes device memory (a CUDA tensor, "
                              f"__cuda_array_interface__ or DLPack object), got host memory "
                              f"({type(obj).__name__}): alloc shares host memory")
    return dev, share_fields(dev)


def device_memory_of(status: dict[str, Any]) -> bool | None:
    """A ``status`` reply's ``device_memory``; None from a daemon that
    predates ``share_device`` (it must never be sent one)."""
    found = status.get("device_memory")
    return None if found is None else bool(found)
