"""The memory side of a shard: its rails' registrations and exports, through
its ``RailGroup``, for the engine (trio thread): ``Shard.memory``.

What must not live here: transfers, posting or polling (``_shard.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from p2pxfer.buffers import BufferSpan
from p2pxfer.fabric import Rail
from p2pxfer.memory import CacheStats, LocalRegion, RegionDescriptor
from p2pxfer.topology import Shard as ShardTopology

from ._plan import RailGroup

__all__ = ["ShardMemory"]


class ShardMemory:
    """Registrations and exports on one shard's rails."""

    def __init__(self, group: RailGroup, topo: ShardTopology) -> None:
        self._group = group
        self.topo = topo

    @property
    def rails(self) -> tuple[Rail, ...]:
        """This shard's rails (NICs), in order."""
        return tuple(self._group.rails)

    @property
    def imm_bits(self) -> int:
        return self._group.imm_bits

    def check_imm(self, imm: object) -> None:
        self._group.check_imm(imm)

    @property
    def numa_node(self) -> int:
        return self.topo.numa_node

    def register(self, obj: Any, *, writable: bool = False) -> LocalRegion:
        return self._group.register(obj, writable=writable)

    def lookup(self, span: BufferSpan) -> LocalRegion | None:
        """This shard's registration covering ``span``, if any."""
        return self._group.cache.lookup(span.address, span.nbytes)

    def owns(self, region: LocalRegion) -> bool:
        return region.rails is self._group.rails

    def export(self, obj: Any, name: str, *, local: bool) -> RegionDescriptor:
        return self._group.export(obj, name, local=local)

    def unexport(self, name: str) -> None:
        self._group.unexport(name)

    def unexport_later(self, name: str) -> Callable[[], None]:
        return self._group.unexport_later(name)

    @property
    def keys_are_virtual(self) -> bool:
        """Every rail's provider copies late writes into the registered
        virtual addresses (``Rail.keys_are_virtual``)."""
        return all(rail.keys_are_virtual for rail in self._group.rails)

    def deregister(self, obj: Any) -> None:
        self._group.deregister(obj)

    def registrations(self) -> CacheStats:
        return self._group.cache.statistics()
