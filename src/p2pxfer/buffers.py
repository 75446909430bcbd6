"""Host memory and region descriptors: what both the client library and the
engine need, and nothing that touches the fabric.

What lives here: turning buffer-protocol objects (bytearray, numpy arrays,
mmap, memfd-backed shared memory) into address ranges (``buffer_span``),
memfd-backed ``SharedBuffer``, faulting pages in ahead of use
(``populate_write``, ``populate_resident``), finding the NUMA node of a page, and the
``RegionDescriptor`` a peer needs to write into a region (it round-trips
through msgpack). What must not: registration with a rail (``p2pxfer.memory``)
or anything else that loads libfabric. No shared mutable state.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import mmap
import os
import platform
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from p2pxfer.errors import DescriptorError, InvalidArgument
from p2pxfer.pages import address_of

__all__ = [
    "BufferSpan",
    "RailDescriptor",
    "RegionDescriptor",
    "SharedBuffer",
    "alloc_shared",
    "buffer_span",
    "numa_node_of",
]

DESCRIPTOR_VERSION = 1


class BufferSpan(NamedTuple):
    """Where a buffer's bytes live. ``owner`` keeps the object alive. (A
    tuple: one is made per write, and a frozen dataclass costs more.)"""

    address: int
    nbytes: int
    readonly: bool
    owner: Any
    #: the CUDA device the bytes are on; -1 for host memory
    device: int = -1


def buffer_span(obj: Any) -> BufferSpan:
    """Address range of any C-contiguous buffer-protocol object, or of device
    memory (``p2pxfer.devmem.device_memory``)."""
    try:
        view = memoryview(obj)
    except TypeError as exc:
        from p2pxfer.devmem import device_memory  # only here: loads the CUDA driver

        dev = device_memory(obj)
        if dev is not None:
            return BufferSpan(dev.address, dev.nbytes, False, dev, dev.device)
        raise InvalidArgument(
            f"cannot register {type(obj).__name__}: it does not support the buffer protocol"
        ) from exc
    if not view.c_contiguous:
        raise InvalidArgument(f"cannot register {type(obj).__name__}: buffer is not contiguous")
    if view.nbytes == 0:
        raise InvalidArgument(f"cannot register {type(obj).__name__}: buffer is empty")
    return BufferSpan(address_of(view), int(view.nbytes), bool(view.readonly), obj)


class SharedBuffer:
    """Page-aligned memory backed by a memfd, so another process (the daemon) can
    map the same pages from the fd. ``array`` is a writable ``uint8`` view."""

    def __init__(self, nbytes: int, name: str = "p2pxfer") -> None:
        if nbytes <= 0:
            raise InvalidArgument(f"cannot allocate {nbytes} bytes: size must be > 0")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            # Never shorter than now: a daemon maps it, and a write into pages
            # past the end would be SIGBUS there (the daemon checks the seal).
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            self.mmap = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, prot)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self.mmap, np.uint8)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self.mmap)

    def commit(self) -> None:
        """Allocate every page now, charged to this process (zeroed, as
        they read anyway): for memory the daemon is to map whole when it is
        registered (a KV pool), which maps only pages that exist. Blocks
        (a GiB: a fraction of a second); releases the GIL. Where the kernel
        cannot populate (older than 5.14) the pages come on first touch."""
        populate_write(buffer_span(self.mmap).address, self.nbytes)

    def close(self) -> None:
        """Close the fd and unmap; if views of the memory are still alive, the
        mapping stays until the last one goes."""
        if self.fd < 0:
            return
        del self.array
        with contextlib.suppress(BufferError):
            self.mmap.close()
        os.close(self.fd)
        self.fd = -1


#: madvise(2) advice, Linux 5.14 on; Python's mmap names it from 3.13
_MADV_POPULATE_WRITE = 23


def populate_write(address: int, nbytes: int) -> int:
    """Fault in (write) every page of ``[address, address + nbytes)`` of this
    process, allocating those not there yet: 0, or the errno where the
    kernel would not. Releases the GIL."""
    page = mmap.PAGESIZE
    start = address - address % page
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start),
                       _MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def populate_resident(obj: Any) -> int:
    """``populate_write`` over the pages of ``obj`` (a mapping of shared
    memory) that exist already (``mincore``), leaving holes alone: mapped
    here, pages another process allocated cost this one no fault on first
    touch, and none is allocated (charged) here. 0, or the errno."""
    span = buffer_span(obj)
    page = mmap.PAGESIZE
    start = span.address - span.address % page
    npages = -(-(span.address + span.nbytes - start) // page)
    resident = np.zeros(npages, np.uint8)
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(npages * page),
                       ctypes.c_void_p(resident.ctypes.data)) != 0:
        return ctypes.get_errno()
    # Runs of resident pages: [begin, end) in pages.
    edges = np.diff(np.concatenate(([0], resident & 1, [0])).astype(np.int8))
    for begin, end in zip(np.flatnonzero(edges == 1).tolist(),
                          np.flatnonzero(edges == -1).tolist(), strict=True):
        if err := populate_write(start + begin * page, (end - begin) * page):
            return err
    return 0


# move_pages(2) by syscall number: glibc has no wrapper (libnuma does, but is
# not a dependency). Other architectures report "unknown".
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}.get(platform.machine())


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def numa_node_of(address: int) -> int:
    """The NUMA node holding the page at ``address``, or -1 when that cannot be
    told (page not faulted in yet, no such syscall, not permitted). One
    ``move_pages`` query for one page: asks, moves nothing."""
    if _MOVE_PAGES is None:
        return -1
    page = ctypes.c_void_p(address & ~(mmap.PAGESIZE - 1))
    status = ctypes.c_int(-1)
    rc = _libc().syscall(ctypes.c_long(_MOVE_PAGES), ctypes.c_int(0), ctypes.c_ulong(1),
                       ctypes.byref(page), None, ctypes.byref(status), ctypes.c_int(0))
    if rc != 0 or status.value < 0:  # status < 0: -errno for that page (-ENOENT: absent)
        return -1
    return int(status.value)


def alloc_shared(nbytes: int, name: str = "p2pxfer") -> SharedBuffer:
    return SharedBuffer(nbytes, name)


@dataclass(frozen=True)
class RailDescriptor:
    """How to reach one rail of a region: endpoint address, key, remote base,
    and the NUMA node of the NIC behind it (-1: unknown, e.g. a descriptor
    from a peer that does not send it)."""

    provider: str
    address: bytes
    key: int
    base: int
    numa: int = -1


@dataclass(frozen=True)
class RegionDescriptor:
    """Everything a peer needs to write into a region; travels as msgpack."""

    name: str
    length: int
    rails: tuple[RailDescriptor, ...]
    node: str = ""
    incarnation: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": DESCRIPTOR_VERSION,
            "name": self.name,
            "node": self.node,
            "inc": self.incarnation,
            "len": self.length,
            # The NUMA node rides as a fifth element: readers that know only four
            # are the only ones that would refuse it (see from_wire).
            "rails": [[r.provider, r.address, r.key, r.base, r.numa] for r in self.rails],
        }

    def to_bytes(self) -> bytes:
        return bytes(msgpack.packb(self.to_wire(), use_bin_type=True))

    @classmethod
    def from_wire(cls, obj: Any) -> RegionDescriptor:
        def bad(why: str) -> DescriptorError:
            return DescriptorError(f"malformed region descriptor: {why}")

        if not isinstance(obj, dict):
            raise bad(f"expected a map, got {type(obj).__name__}")
        if obj.get("v") != DESCRIPTOR_VERSION:
            raise bad(f"unsupported version {obj.get('v')!r} (want {DESCRIPTOR_VERSION})")
        known = {"v", "name", "node", "inc", "len", "rails"}
        if extra := set(obj) - known:
            raise bad(f"unknown fields {sorted(map(str, extra))}")
        name, node, inc = obj.get("name"), obj.get("node", ""), obj.get("inc", 0)
        length, rails = obj.get("len"), obj.get("rails")
        if not isinstance(name, str):
            raise bad("name must be a string")
        if not isinstance(node, str):
            raise bad("node must be a string")
        if not isinstance(inc, int) or inc < 0:
            raise bad("incarnation must be an integer >= 0")
        if not isinstance(length, int) or length <= 0:
            raise bad("len must be an integer > 0")
        if not isinstance(rails, list) or not rails:
            raise bad("rails must be a non-empty list")
        out = []
        for i, r in enumerate(rails):
            if not (isinstance(r, list) and len(r) in (4, 5)):
                raise bad(f"rail {i} must be [provider, address, key, base] or [..., numa node]")
            prov, addr, key, base = r[:4]
            numa = r[4] if len(r) == 5 else -1  # older descriptors carry no node
            if not isinstance(prov, str) or not isinstance(addr, bytes) or not addr:
                raise bad(f"rail {i}: provider must be a string and address non-empty bytes")
            for what, v in (("key", key), ("base", base)):
                if not isinstance(v, int) or not 0 <= v < 1 << 64:
                    raise bad(f"rail {i}: {what} must be an unsigned 64-bit integer")
            if not isinstance(numa, int) or isinstance(numa, bool) or not -1 <= numa < 1 << 16:
                raise bad(f"rail {i}: numa node must be an integer >= -1")
            out.append(RailDescriptor(prov, addr, key, base, numa))
        return cls(name, length, tuple(out), node, inc)

    @classmethod
    def from_bytes(cls, data: bytes) -> RegionDescriptor:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as exc:
            raise DescriptorError(f"malformed region descriptor: not msgpack ({exc})") from exc
        return cls.from_wire(obj)
