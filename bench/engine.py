"""Engine benchmark: ``engine.write`` against the raw C loop in the same run.

Measures, over a real provider to a target in a second process:
- throughput of 4096 x 64 KiB random pages (engine vs ``p2p_baseline_write``);
- the engine's own cost per page (``dry_run``: validation, striping,
  bookkeeping, the thread hand-off; no provider calls) in pages/s;
- the posting rate of tiny 8-byte pieces (65536 per write), engine vs C loop;
- latency of one 4 KiB write until its completion is seen in trio, against the
  C loop's post-to-completion time for the same write and against a raw C
  ping-pong round trip over the same provider;
- idle CPU of an open engine with no traffic.

    python bench/engine.py --json bench/results/engine.json
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from typing import Any

import numpy as np
import trio

from _common import emit, parser

MIB = 1 << 20


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def median_time(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def amedian_time(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def c_pingpong_rtt(provider: str, iters: int = 2000) -> float:
    """Round-trip time of 4 KiB writes with immediates between two endpoints,
    both loops in C and busy-polling (one per thread, GIL released)."""
    from p2pxfer import Transport
    from p2pxfer.fabric import baseline_pingpong
    from p2pxfer.loopback import loopback_node

    node = loopback_node(provider)
    with Transport.open(provider, node=node) as a, Transport.open(provider, node=node) as b:
        bufs = (np.ones(1 << 20, np.uint8), np.ones(1 << 20, np.uint8))
        descs = (a.export(bufs[0], "a"), b.export(bufs[1], "b"))
        regions = (a.cache.require(bufs[0]), b.cache.require(bufs[1]))
        out: list[float] = []

        def side(k: int) -> None:
            t, peer = (a, descs[1]) if k == 0 else (b, descs[0])
            rail, pr = t.rails[0], peer.rails[0]
            out.append(baseline_pingpong(rail, rail.peer(pr.address), regions[k].address,
                                         regions[k].mrs[0].desc, pr.base, pr.key, 4096,
                                         iters, k == 0))

        th = threading.Thread(target=side, args=(1,))
        th.start()
        side(0)
        th.join()
        return max(out)


def run(provider: str, repeat: int, idle_s: float) -> list[dict[str, Any]]:
    from p2pxfer import ScatterList, Transport
    from p2pxfer.engine import EngineConfig, open_engine
    from p2pxfer.fabric import baseline_write
    from p2pxfer.loopback import LoopbackTarget, loopback_node

    region_size = 1 << 30
    page = 64 << 10
    rng = np.random.default_rng(3)
    slots = region_size // page
    pages = ScatterList(rng.choice(slots, 4096, replace=False).astype(np.int64) * page,
                        rng.choice(slots, 4096, replace=False).astype(np.int64) * page,
                        np.full(4096, page, np.int64))
    # Enough tiny pieces that the posting rate, not the fixed cost of one call,
    # decides the time.
    n_tiny = 65536
    tiny = ScatterList(np.arange(n_tiny, dtype=np.int64) * 8,
                       np.arange(n_tiny, dtype=np.int64) * 8, np.full(n_tiny, 8, np.int64))
    one = ScatterList.contiguous(4096)
    src = np.ones(region_size, np.uint8)
    node = loopback_node(provider)
    results: list[dict[str, Any]] = []

    def add(name: str, **fields: Any) -> None:
        results.append({"provider": provider, "pattern": name, **fields})

    rtt = c_pingpong_rtt(provider)
    with LoopbackTarget(provider, region_size) as target, \
            Transport.open(provider, node=node) as t:
        d = target.descriptor
        region = t.register(src)
        rail, rd = t.rails[0], d.rails[0]
        dest = rail.peer(rd.address)

        def c_loop(sl: ScatterList) -> None:
            baseline_write(rail, dest, sl.src, sl.dst, sl.length, region.address,
                           region.mrs[0].desc, rd.base, rd.key, 1)

        async def main() -> None:
            async with open_engine(EngineConfig(provider=provider, node=node)) as engine:
                engine.register(src)
                for sl in (pages, tiny, one):
                    c_loop(sl)
                    await engine.write(src, d, sl, imm=1)
                for name, sl in (("4096x64KiB-random", pages), (f"{n_tiny}x8B", tiny)):
                    c_s, e_s = [], []
                    for _ in range(repeat):
                        c_s.append(median_time(lambda sl=sl: c_loop(sl), 1))
                        e_s.append(await amedian_time(
                            lambda sl=sl: engine.write(src, d, sl, imm=1), 1))
                    c, e = statistics.median(c_s), statistics.median(e_s)
                    add(name, pages=len(sl), bytes=sl.nbytes, baseline_seconds=c, seconds=e,
                        baseline_gbps=sl.nbytes / c / 1e9, gbps=sl.nbytes / e / 1e9,
                        baseline_pages_per_s=len(sl) / c, pages_per_s=len(sl) / e,
                        ratio=c / e)
                dry = await amedian_time(lambda: engine.write(src, d, pages, dry_run=True),
                                         repeat * 4)
                add("dry-run-4096-pages", pages=4096, seconds=dry,
                    ns_per_page=dry / 4096 * 1e9, pages_per_s=4096 / dry)
                c_lat = median_time(lambda: c_loop(one), 400)
                e_lat = await amedian_time(lambda: engine.write(src, d, one, imm=1), 400)
                add("latency-4KiB", baseline_p50_us=c_lat * 1e6, p50_us=e_lat * 1e6,
                    ratio=e_lat / c_lat, pingpong_rtt_us=rtt * 1e6,
                    ratio_to_pingpong=e_lat / rtt)
                await trio.sleep(0.5)
                cpu0, t0 = cpu_seconds(), time.monotonic()
                await trio.sleep(idle_s)
                busy = (cpu_seconds() - cpu0) / (time.monotonic() - t0)
                add("idle", seconds=idle_s, cpu_fraction_of_core=busy)

        trio.run(main)
    return results


def main() -> int:
    ap = parser(__doc__, repeat=5)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    args = ap.parse_args()
    results = []
    for provider in args.providers.split(","):
        results += run(provider, args.repeat, args.idle_seconds)
    return emit("engine", results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
