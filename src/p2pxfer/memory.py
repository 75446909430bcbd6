"""Memory that peers can write into, and the registrations that make it so.

What lives here: ``LocalRegion`` (one buffer registered on every rail); the
LRU ``RegistrationCache``; ``ExportedRegion`` (an export's own remote-write
registration over exactly its range). Buffers, spans and the
``RegionDescriptor`` a peer writes by are ``p2pxfer.buffers`` (no fabric
there; re-exported here). What must not: posting or polling (that is the
engine's shards'). A ``RegistrationCache`` belongs to the thread that made it
(the engine's trio thread).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pxfer.buffers import (
    BufferSpan,
    RailDescriptor,
    RegionDescriptor,
    SharedBuffer,
    alloc_shared,
    buffer_span,
    numa_node_of,
)
from p2pxfer.errors import (
    ReadOnlyBuffer,
    RegistrationError,
    UnregisteredMemory,
)
from p2pxfer.fabric import ACCESS_REMOTE_WRITE, ACCESS_WRITE, MemoryRegion, Rail
from p2pxfer.log import get_logger

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

log = get_logger("p2pxfer.memory")


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
                self.mrs.append(rail.register(span.address, span.nbytes, ACCESS_REMOTE_WRITE,
                                              span.device))
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

    def toucher(self, region: LocalRegion) -> Callable[[], None]:
        """A call that counts a use of ``region`` (registered here, open) as
        a lookup does, for a caller that kept it instead of looking it up."""
        return functools.partial(self._lru.move_to_end, id(region))

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
                mrs.append(rail.register(span.address, span.nbytes, access, span.device))
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
