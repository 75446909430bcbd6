"""``p2pxfer bench --calibrate``: measure the shapes the cost model needs,
fit it (``p2pxfer.plan.fit``) and save the profile that ``p2pxfer plan`` and
the bench's predictions read.

The shapes, each measured by ``run_bench`` in loopback (beside the C
reference, as every bench case): one lone piece of every power of two from
4 KiB to 64 MiB (the ``single`` curve), and transfers of many random pieces
of 8 B to 4 MiB, 32-64 MiB each past the smallest (the ``stream`` curve; 8 B
pieces are the posting rate). The knots are densest around the providers'
protocol changes (shm's 4 KiB inject size, rxm's 16 KiB eager buffer). Each
point is the median time of one transfer.

What must not live here: the model (``p2pxfer.plan``), option parsing.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from p2pxfer.plan import Point, Profile, fit

from ._options import KIB, MIB, BenchOptions, sweep_sizes
from ._report import BenchResult
from ._run import run_bench

__all__ = ["CONTIGUOUS", "PAGED", "calibrate", "points_of"]

CONTIGUOUS = sweep_sizes(4 * KIB, 64 * MIB)
PAGED = ((8, 16384), (4 * KIB, 2048), (8 * KIB, 2048), (16 * KIB, 2048), (32 * KIB, 1024),
         (64 * KIB, 1024), (256 * KIB, 256), (MIB, 64), (4 * MIB, 16))
# --quick: the same kinds of shape, small (checks the machinery, ~10 s)
QUICK_CONTIGUOUS = (4 * KIB, 64 * KIB, MIB)
QUICK_PAGED = ((4 * KIB, 256), (64 * KIB, 64))


def points_of(results: list[BenchResult]) -> list[Point]:
    """A calibration point per measured case: its median transfer time."""
    return [Point(r.pages, r.bytes, r.p50_us / 1e6, r.nrails,
                  f"{r.pages}x{r.page_size}B {r.pattern}") for r in results]


def calibrate(provider: str, *, quick: bool = False, rails: int | None = None,
              interfaces: tuple[str, ...] | None = None,
              say: Callable[[str], None] = lambda text: None) -> Profile:
    """Measure ``provider`` on this host (loopback) and fit its profile."""
    contiguous = QUICK_CONTIGUOUS if quick else CONTIGUOUS
    paged = QUICK_PAGED if quick else PAGED
    auto = 16 * MIB if quick else 128 * MIB

    base = BenchOptions(mode="loopback", providers=(provider,), rails=rails,
                        interfaces=interfaces, auto_bytes=auto, memcpy_size=16 * MIB)
    say(f"{provider}: one piece of {len(contiguous)} sizes")
    results = run_bench(dataclasses.replace(base, sizes=contiguous)).results
    for page_size, pages in paged:
        say(f"{provider}: {pages} random pages of {page_size // KIB} KiB")
        results += run_bench(dataclasses.replace(base, pattern="paged", page_size=page_size,
                                                 pages=pages, order="random")).results
    cpu = [r.cpu_s_per_gb for r in results if r.cpu_s_per_gb is not None and r.bytes >= MIB]
    nics = tuple(rail.name for r in results[:1] for rail in r.rails)
    return fit(provider, points_of(results), nics=nics,
               cpu_s_per_gb=statistics.median(cpu) if cpu else None)

