"""The ``same-daemon`` scenario: a client's write into a region another client
of the same daemon exported (the daemon's fast path, a copy between the two
shared mappings), against this machine's memcpy of the same bytes between two
memfd mappings, measured in the same run, round by round.

Two clients of the daemon at ``socket`` (in this process): one exports
``size`` bytes, the other writes into it, once as one piece and once as
random pages; the memcpy is ``numpy.copyto`` between the two clients'
mappings, single-threaded. Each record says how many copy threads the daemon
uses and how many bytes its engine posted meanwhile (0 when the fast path
ran). With ``local_copy = false`` the same scenario measures the engine path
instead. What must not live here: starting daemons (the caller's), option
parsing, rendering.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ._options import format_size

__all__ = ["same_daemon"]

Record = dict[str, Any]
REGION = "bench-same-daemon"


def _posted(status: dict[str, Any]) -> int:
    return sum(int(n["bytes"]) for n in status["nics"])


async def same_daemon(socket: str, size: int = 64 << 20, page_size: int = 16 << 10,
                      rounds: int = 20, warmup: int = 3) -> list[Record]:
    """Ours (client write through the daemon, reply included) and memcpy,
    alternating, ``rounds`` each, for one ``size``-byte piece and for
    ``size // page_size`` random pages."""
    from p2pxfer.client import connect
    from p2pxfer.scatter import ScatterList

    rng = np.random.default_rng(15)
    n = size // page_size
    lists = {
        f"same-daemon write {format_size(size)}": ScatterList.contiguous(size),
        f"same-daemon write {n}x{format_size(page_size)} random pages": ScatterList(
            rng.permutation(n).astype(np.int64) * page_size,
            rng.permutation(n).astype(np.int64) * page_size, np.full(n, page_size, np.int64)),
    }
    out: list[Record] = []
    async with connect(socket) as owner, connect(socket) as writer:
        dst = await owner.alloc(size, REGION)
        await owner.export(REGION, dst)
        src = await writer.alloc(size, REGION + "-src")
        src.array[:] = 0xA5  # both sides' pages faulted in before timing
        dst.array[:] = 0
        status = await writer.status()
        node, local = str(status["node"]), status.get("local_copy", {})
        for pattern, sl in lists.items():
            for _ in range(warmup):
                await writer.write(node, REGION, sl, src=src)
                np.copyto(dst.array, src.array)
            posted0 = _posted(await writer.status())
            ours, ref = [], []
            pieces = 0
            for _ in range(rounds):
                t0 = time.perf_counter()
                pieces = await writer.write(node, REGION, sl, src=src)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                np.copyto(dst.array, src.array)
                ref.append(time.perf_counter() - t0)
            posted = _posted(await writer.status()) - posted0
            o, m = statistics.median(ours), statistics.median(ref)
            enabled = bool(local.get("enabled", False))
            out.append({
                "provider": str(status["provider"]),
                "pattern": pattern + (f", {local.get('threads')} copy threads" if enabled
                                      else ", through the engine (local_copy = false)"),
                "bytes": sl.nbytes, "pages": len(sl), "pieces": pieces, "rounds": rounds,
                "local_copy": enabled, "threads": int(local.get("threads", 0)),
                "seconds": o, "gbps": sl.nbytes / o / 1e9,
                "p50_us": o * 1e6, "p99_us": float(np.percentile(ours, 99)) * 1e6,
                "memcpy_seconds": m, "memcpy_gbps": size / m / 1e9,
                "ratio_to_memcpy": (sl.nbytes / o) / (size / m),
                "engine_bytes_posted": posted, "reference": "memcpy"})
    return out
