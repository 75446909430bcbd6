"""Memory that peers can write into, and the registrations that make it so.

What lives here: turning buffer-protocol objects (bytearray, numpy arrays, mmap,
memfd-backed shared memory) into address ranges and finding the NUMA node of
their pages; ``LocalRegion`` (one buffer registered on every rail); the LRU
``RegistrationCache``; ``ExportedRegion`` (an export's own remote-write
registration over exactly its range); and the ``RegionDescriptor`` a peer
needs to write into a region, which round-trips through msgpack. What must
not: posting or polling (that is the engine's shards').
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import mmap
import os
import platform
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt
import structlog

from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    ReadOnlyBuffer,
    RegistrationError,
    UnregisteredMemory,
)
from p2pxfer.fabric import ACCESS_REMOTE_WRITE, ACCESS_WRITE, MemoryRegion, Rail, address_of

__all__ = [
    "CacheStats",
    "ExportedRegion",
    "LocalRegion",
    "RailDescriptor",
    "RegionDescriptor",
    "RegistrationCache",
    "SharedBuffer",
    "alloc_shared",
    "buffer_span",
    "numa_node_of",
]

log = structlog.get_logger("p2pxfer.memory")

DESCRIPTOR_VERSION = 1


class BufferSpan(NamedTuple):
    """Where a buffer's bytes live. ``owner`` keeps the object alive. (A
    tuple: one is made per write, and a frozen dataclass costs more.)"""

    address: int
    nbytes: int
    readonly: bool
    owner: Any


def buffer_span(obj: Any) -> BufferSpan:
    """Address range of any C-contiguous buffer-protocol object."""
    try:
        view = memoryview(obj)
    except TypeError as exc:
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


class LocalRegion:
    """One buffer registered on every rail of a rail group (one engine shard).

    ``writable`` regions accept remote writes (they can be exported); every
    region can be a source. ``pins`` counts users (exports, writes in flight)
    that forbid eviction.
    """

    def __init__(
        self, span: BufferSpan, rails: list[Rail], mrs: list[MemoryRegion], writable: bool
    ) -> None:
        self.span = span
        self.rails = rails
        self.mrs = mrs
        self.writable = writable
        self.pins = 0
        self.name: str | None = None
        self.closed = False
        #: NUMA node of the buffer's first page when registered (-1: unknown);
        #: the engine routes writes from it to that node's shard
        self.numa_node = -1

    @property
    def address(self) -> int:
        return self.span.address

    @property
    def length(self) -> int:
        return self.span.nbytes

    def covers(self, address: int, nbytes: int, writable: bool) -> bool:
        return (
            self.span.address <= address
            and address + nbytes <= self.span.address + self.span.nbytes
            and (self.writable or not writable)
        )

    def descriptor(self, name: str, node: str = "", incarnation: int = 0,
                   span: BufferSpan | None = None) -> RegionDescriptor:
        """Describe ``span`` (default: the whole registration) for peers. A
        span inside a larger registration shifts the remote base by its offset
        (virtual address or offset addressing alike)."""
        if not self.writable:
            raise ReadOnlyBuffer(f"region {name!r} is not registered for remote writes")
        span = span or self.span
        if not self.covers(span.address, span.nbytes, True):
            raise RegistrationError(f"{span.nbytes} bytes at {span.address:#x} are not "
                                    f"inside {self!r}")
        shift = span.address - self.address
        return RegionDescriptor(
            name, span.nbytes,
            tuple(RailDescriptor(rail.provider, rail.address, mr.key, mr.base + shift)
                  for rail, mr in zip(self.rails, self.mrs, strict=True)),
            node, incarnation,
        )

    def __repr__(self) -> str:
        return (f"LocalRegion({self.address:#x}+{self.length}, writable={self.writable}, "
                f"pins={self.pins})")


class ExportedRegion:
    """One export: a registration of its own, for remote writes only, over
    exactly ``span`` on each of ``rails``, with keys fresh to it (never shared
    with the cache's registrations or another export). :meth:`close` closes
    every MR (``fi_close``), after which a write through its descriptor is
    refused by the provider (where it checks keys: tcp does, shm does not)."""

    def __init__(self, name: str, span: BufferSpan, rails: list[Rail],
                 numa_nodes: list[int] | None = None) -> None:
        if span.readonly:
            raise ReadOnlyBuffer(
                f"cannot export a read-only {type(span.owner).__name__} as {name!r}")
        self.name = name
        self.span = span
        self.rails = rails
        self.numa_nodes = numa_nodes or [-1] * len(rails)
        self.mrs: list[MemoryRegion] = []
        try:
            for rail in rails:
                self.mrs.append(rail.register(span.address, span.nbytes, ACCESS_REMOTE_WRITE))
        except BaseException:
            self.close()
            raise
        log.debug("memory.export", region=name, address=hex(span.address), nbytes=span.nbytes)

    @property
    def closed(self) -> bool:
        return not self.mrs

    def rail_descriptors(self) -> tuple[RailDescriptor, ...]:
        if self.closed:
            raise RegistrationError(f"export {self.name!r} is closed")
        return tuple(RailDescriptor(rail.provider, rail.address, mr.key, mr.base, numa)
                     for rail, mr, numa in zip(self.rails, self.mrs, self.numa_nodes,
                                               strict=True))

    def descriptor(self, node: str = "", incarnation: int = 0) -> RegionDescriptor:
        return RegionDescriptor(self.name, self.span.nbytes, self.rail_descriptors(),
                                node, incarnation)

    def close(self) -> None:
        """Close every registration now (idempotent)."""
        mrs, self.mrs = self.mrs, []
        for rail, mr in zip(self.rails, mrs, strict=False):
            rail.deregister(mr)

    def __repr__(self) -> str:
        return (f"ExportedRegion({self.name!r}, {self.span.address:#x}+{self.span.nbytes}, "
                f"closed={self.closed})")


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    nbytes: int
    #: entries pinned now (exports, sources of writes in flight)
    pinned: int = 0


class RegistrationCache:
    """LRU of registrations keyed by address range, over a fixed set of rails.

    A lookup hits when an existing registration covers the range with enough
    access. Past ``max_entries`` or ``max_bytes``, the least recently used
    unpinned entries are deregistered; pinned ones (exported regions, sources
    of writes in flight) are never evicted.
    """

    def __init__(self, rails: list[Rail], *, max_entries: int = 1024,
                 max_bytes: int = 1 << 40) -> None:
        self.rails = rails
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lru: OrderedDict[int, LocalRegion] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def lookup(self, address: int, nbytes: int, writable: bool = False) -> LocalRegion | None:
        for key, region in reversed(self._lru.items()):
            if region.covers(address, nbytes, writable):
                self._lru.move_to_end(key)
                return region
        return None

    def register(self, obj: Any, *, writable: bool = False, pin: bool = False) -> LocalRegion:
        """The registration covering ``obj`` (registering it on a miss)."""
        span = buffer_span(obj)
        if writable and span.readonly:
            raise ReadOnlyBuffer(
                f"cannot register a read-only {type(obj).__name__} as a write target"
            )
        region = self.lookup(span.address, span.nbytes, writable)
        if region is not None:
            self._hits += 1
            region.pins += int(pin)
        else:
            self._misses += 1
            region = self._register(span, writable, int(pin))
        return region

    def require(self, obj: Any) -> LocalRegion:
        """The registration covering ``obj``; raises if it was never registered."""
        return self.require_span(buffer_span(obj))

    def require_span(self, span: BufferSpan) -> LocalRegion:
        region = self.lookup(span.address, span.nbytes)
        if region is None:
            raise UnregisteredMemory(
                f"{span.nbytes} bytes at {span.address:#x} are not registered: "
                "register the buffer first"
            )
        return region

    def _register(self, span: BufferSpan, writable: bool, pins: int) -> LocalRegion:
        access = ACCESS_WRITE | (ACCESS_REMOTE_WRITE if writable else 0)
        mrs: list[MemoryRegion] = []
        try:
            for rail in self.rails:
                mrs.append(rail.register(span.address, span.nbytes, access))
        except BaseException:
            for rail, mr in zip(self.rails, mrs, strict=False):
                rail.deregister(mr)
            raise
        region = LocalRegion(span, self.rails, mrs, writable)
        region.pins = pins
        self._lru[id(region)] = region
        self._bytes += span.nbytes
        # Never evict what we are about to hand out, even if all else is pinned.
        self._evict(keep=id(region))
        log.debug("memory.register", address=hex(span.address), nbytes=span.nbytes,
                  writable=writable)
        return region

    def _evict(self, keep: int | None = None) -> None:
        over = len(self._lru) > self.max_entries or self._bytes > self.max_bytes
        if not over:
            return
        for key in list(self._lru):
            if len(self._lru) <= self.max_entries and self._bytes <= self.max_bytes:
                break
            region = self._lru[key]
            if region.pins == 0 and key != keep:
                self._drop(key)
                self._evictions += 1

    def _drop(self, key: int) -> None:
        region = self._lru.pop(key)
        self._bytes -= region.length
        region.closed = True
        for rail, mr in zip(self.rails, region.mrs, strict=True):
            rail.deregister(mr)

    def unpin(self, region: LocalRegion) -> None:
        if region.pins <= 0:
            raise RegistrationError(f"{region!r} is not pinned")
        region.pins -= 1
        if region.pins == 0:
            self._evict()

    def release(self, region: LocalRegion) -> None:
        """Deregister now (pinned or not): for owners that know it is unused."""
        key = id(region)
        if key in self._lru:
            self._drop(key)

    def statistics(self) -> CacheStats:
        return CacheStats(self._hits, self._misses, self._evictions, len(self._lru), self._bytes,
                          sum(1 for r in self._lru.values() if r.pins))

    def close(self) -> None:
        for key in list(self._lru):
            self._drop(key)
