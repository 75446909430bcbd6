"""Our paths, as a bandwidth test drives them: the engine and the daemons.

``EnginePath`` writes through ``Engine.write`` (``len(lists)`` trio tasks at a
time; a transfer of many pieces with one notification), ``DaemonPath``
through the local daemon (``Client.write``), as users do. Both time each
transfer. What must not live here: the reference, the measuring loop,
fabric calls.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.engine import Engine
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

__all__ = ["DaemonPath", "EnginePath", "OurPath"]


class OurPath(Protocol):
    imm: bool

    async def round(self, lists: list[ScatterList], imm: int | None) -> tuple[int, list[float]]:
        """Write ``lists`` at once; (pieces, seconds per transfer)."""
        ...

    async def rail_bytes(self) -> list[tuple[str, int]]: ...


async def _all(lists: list[ScatterList], one: Any) -> tuple[int, list[float]]:
    out: list[tuple[int, float]] = []

    async def timed(sl: ScatterList) -> None:
        t0 = time.perf_counter()
        n = await one(sl)
        out.append((n, time.perf_counter() - t0))

    if len(lists) == 1:
        await timed(lists[0])
    else:
        async with trio.open_nursery() as nursery:
            for sl in lists:
                nursery.start_soon(timed, sl)
    return sum(n for n, _ in out), [s for _, s in out]


class EnginePath:
    """Writes through ``Engine.write``."""

    imm = True

    def __init__(self, engine: Engine, src: npt.NDArray[np.uint8], dst: RegionDescriptor, *,
                 notify_early: bool = False) -> None:
        self.engine, self.src, self.dst = engine, src, dst
        #: notifications sent as a KV push's layers send theirs (``notify_early``)
        self.notify_early = notify_early

    async def round(self, lists: list[ScatterList], imm: int | None) -> tuple[int, list[float]]:
        # A transfer of many pieces the way serving engines send pages (a KV
        # push, a daemon's write): one immediate, once all of it landed, and
        # its pieces grouped into the provider's multi-piece writes. A lone
        # piece carries its immediate itself.
        async def one(sl: ScatterList) -> int:
            notify = imm is not None and len(sl) > 1
            if not (notify and self.notify_early):
                return await self.engine.write(self.src, self.dst, sl, imm=imm, notify=notify)
            t = await self.engine.submit(self.src, self.dst, sl, imm=imm, notify=True,
                                         notify_early=True)
            await t.wait()
            return t.imms

        return await _all(lists, one)

    async def rail_bytes(self) -> list[tuple[str, int]]:
        return [(n.name, n.bytes) for n in self.engine.statistics().nics]


class DaemonPath:
    """Writes through the local daemon (``Client.write``) into a peer's region."""

    imm = False  # a daemon's immediates are node-wide; leave the peer's counts alone

    def __init__(self, client: Any, mem: Any, peer: str, region: str) -> None:
        self.client, self.mem, self.peer, self.region = client, mem, peer, region

    async def round(self, lists: list[ScatterList], imm: int | None) -> tuple[int, list[float]]:
        return await _all(lists, lambda sl: self.client.write(self.peer, self.region, sl,
                                                              src=self.mem))

    async def rail_bytes(self) -> list[tuple[str, int]]:
        st = await self.client.status()
        return [(str(n["name"]), int(n["bytes"])) for n in st.get("nics", [])]
