"""``p2pxfer bench --calibrate``: measure the shapes the cost model needs,
fit it (``p2pxfer.plan.fit``) and save the profile that ``p2pxfer plan`` and
the bench's predictions read.

The shapes, each measured by ``run_bench`` in loopback (beside the C
reference, as every bench case): one lone piece of every power of two from
4 KiB to 64 MiB (the ``single`` curve), and transfers of many random pieces
of 8 B to 4 MiB, 32-64 MiB each past the smallest (the ``stream`` curve; 8 B
pieces are the posting rate). The knots are densest around the providers'
protocol changes (shm's 4 KiB inject size, rxm's 16 KiB eager buffer). Then
the serving engines' shape twice more: 2048 random 16 KiB pieces as 32
notified transfers of 64 submitted together (a KV push's layers: the cost
of each further transfer), and as one transfer between memfd buffers (a
daemon's pools: shared memory's cost over private). Each point is the
median time of one transfer (the mean of a round where transfers go
together), the lone pieces over as many rounds as the sweep takes, the
paged shapes over at least ``MIN_ROUNDS``.

What must not live here: the model (``p2pxfer.plan``), option parsing.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from p2pxfer.plan import Point, Profile, fit

from ._options import KIB, MIB, BenchOptions, format_size, sweep_sizes
from ._report import BenchResult
from ._run import run_bench

__all__ = ["CONTIGUOUS", "PAGED", "calibrate", "points_of"]

CONTIGUOUS = sweep_sizes(4 * KIB, 64 * MIB)
PAGED = ((8, 16384), (4 * KIB, 2048), (8 * KIB, 2048), (16 * KIB, 2048), (32 * KIB, 1024),
         (64 * KIB, 1024), (256 * KIB, 256), (MIB, 64), (4 * MIB, 16))
# --quick: the same kinds of shape, small (checks the machinery, ~10 s)
QUICK_CONTIGUOUS = (4 * KIB, 64 * KIB, MIB)
QUICK_PAGED = ((4 * KIB, 256), (64 * KIB, 64))
#: (page size, pages, transfers): the pages as that many transfers submitted together
BATCHED = (16 * KIB, 2048, 32)
QUICK_BATCHED = (16 * KIB, 256, 8)
#: paged shapes measured over few rounds were off by a third between runs
MIN_ROUNDS = 20


def points_of(results: list[BenchResult]) -> list[Point]:
    """A calibration point per measured case: its median transfer time, or
    where a round is many transfers together, a round's mean time."""
    out = []
    for r in results:
        n = r.concurrency
        seconds = r.p50_us / 1e6 if n == 1 else r.seconds / r.iterations
        label = (f"{r.pages}x{r.page_size}B {r.pattern}" if n == 1 else
                 f"{n}x{r.pages}x{r.page_size}B {r.pattern} together")
        out.append(Point(r.pages * n, r.bytes * n, seconds, r.nrails,
                         label + (f" {r.memory}" if r.memory != "private" else ""),
                         transfers=n, memory=r.memory))
    return out


def calibrate(provider: str, *, quick: bool = False, rails: int | None = None,
              interfaces: tuple[str, ...] | None = None,
              say: Callable[[str], None] = lambda text: None) -> Profile:
    """Measure ``provider`` on this host (loopback) and fit its profile."""
    contiguous = QUICK_CONTIGUOUS if quick else CONTIGUOUS
    paged = QUICK_PAGED if quick else PAGED
    page, pages, transfers = QUICK_BATCHED if quick else BATCHED
    auto = 16 * MIB if quick else 128 * MIB
    rounds = 3 if quick else MIN_ROUNDS

    base = BenchOptions(mode="loopback", providers=(provider,), rails=rails,
                        interfaces=interfaces, auto_bytes=auto, memcpy_size=16 * MIB)
    say(f"{provider}: one piece of {len(contiguous)} sizes")
    # As many rounds as the sweep (``p2pxfer bench --sweep``) takes: over half
    # as many, a lone 8 MiB tcp piece came out 1.7x slower than there.
    results = run_bench(dataclasses.replace(
        base, sizes=contiguous,
        auto_bytes=auto if quick else BenchOptions.auto_bytes)).results

    def pages_of(page_size: int, pages: int, **more: object) -> list[BenchResult]:
        opts = dataclasses.replace(base, pattern="paged", page_size=page_size, pages=pages,
                                   order="random", **more)  # type: ignore[arg-type]
        each = page_size * (opts.pages_per_transfer or pages) * opts.concurrency
        return run_bench(dataclasses.replace(
            opts, iterations=max(rounds, min(200, -(-auto // each))))).results

    for page_size, pages_n in paged:
        say(f"{provider}: {pages_n} random pages of {format_size(page_size)}")
        results += pages_of(page_size, pages_n)
    say(f"{provider}: {pages} random pages of {format_size(page)} as {transfers} transfers "
        f"together, and between shared memory")
    results += pages_of(page, pages, pages_per_transfer=pages // transfers,
                        concurrency=transfers)
    results += pages_of(page, pages, memory="shared")
    cpu = [r.cpu_s_per_gb for r in results if r.cpu_s_per_gb is not None and r.bytes >= MIB]
    nics = tuple(rail.name for r in results[:1] for rail in r.rails)
    return fit(provider, points_of(results), nics=nics,
               cpu_s_per_gb=statistics.median(cpu) if cpu else None)

