"""KV page-push benchmark: ``push_pages`` against the raw C loop writing the
same pieces, in one run, plus the CPU cost of describing and posting a long
request.

- 32 layers x 1024 blocks of 16 KiB and of 64 KiB per layer (random block
  tables, every block), into a pool exported by a second process: GB/s of ``push_pages``
  vs ``p2p_baseline_write`` over the same expanded pieces, and time to first
  layer.
- A 112,000-page request (32 layers x 2 planes x 1750 blocks): CPU time to
  expand the block tables and submit every layer (``dry_run``: the engine's
  whole path but the provider calls).

    python bench/kv.py --json bench/results/kv.json
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import trio

from _common import emit, parser
from p2pxfer import ScatterList, Transport
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.fabric import baseline_write
from p2pxfer.kv import KVLayout, KVPool, KVPoolDescriptor, encode_imm, expand_pages, push_pages
from p2pxfer.loopback import LoopbackTarget, loopback_node


def run(provider: str, repeat: int) -> list[dict[str, Any]]:
    node = loopback_node(provider)
    results: list[dict[str, Any]] = []
    for block_bytes in (16 << 10, 64 << 10):
        layout = KVLayout(32, 1024, block_bytes)
        rng = np.random.default_rng(5)
        # Every block, in random order on both sides: little to coalesce.
        sb = rng.permutation(1024).astype(np.int64)
        db = rng.permutation(1024).astype(np.int64)
        with LoopbackTarget(provider, layout.nbytes) as target, \
                Transport.open(provider, node=node) as t:
            dst = KVPoolDescriptor(target.descriptor, layout)
            so, do, ln, _ = expand_pages(layout, layout, sb, db, range(32))
            flat = ScatterList(so, do, ln)

            async def main(t: Transport = t, dst: KVPoolDescriptor = dst,
                           flat: ScatterList = flat, layout: KVLayout = layout,
                           sb: Any = sb, db: Any = db, kib: int = block_bytes >> 10
                           ) -> dict[str, Any]:
                async with open_engine(EngineConfig(provider=provider, node=node)) as eng:
                    pool = KVPool(eng, "src", layout)
                    pool.array.fill(7)
                    region = t.register(pool.array)
                    rail, rd = t.rails[0], dst.region.rails[0]
                    dest = rail.peer(rd.address)

                    def c_loop() -> None:
                        baseline_write(rail, dest, flat.src, flat.dst, flat.length,
                                       region.address, region.mrs[0].desc, rd.base, rd.key, 1)

                    c_loop()
                    await push_pages(eng, pool, dst, sb, db, request_id=1)
                    c_s, p_s, ttfl = [], [], []
                    for i in range(repeat):
                        t0 = time.perf_counter()
                        c_loop()
                        c_s.append(time.perf_counter() - t0)
                        r = await push_pages(eng, pool, dst, sb, db, request_id=2 + i)
                        p_s.append(r.seconds)
                        ttfl.append(r.first_layer_seconds)
                    c, p = statistics.median(c_s), statistics.median(p_s)
                    return {"provider": provider, "pattern": f"kv 32x1024 of {kib}KiB blocks",
                            "pages": len(flat), "bytes": flat.nbytes,
                            "baseline_seconds": c, "seconds": p,
                            "baseline_gbps": flat.nbytes / c / 1e9,
                            "gbps": flat.nbytes / p / 1e9, "ratio": c / p,
                            "time_to_first_layer_ms": statistics.median(ttfl) * 1e3}

            results.append(trio.run(main))
    results.append(describe_cost(provider))
    return results


def describe_cost(provider: str) -> dict[str, Any]:
    """CPU to expand and submit a 112,000-page request (dry run: no provider calls)."""
    layout = KVLayout(32, 4096, 4096, planes=2)
    n = 1750
    rng = np.random.default_rng(9)
    sb = rng.choice(4096, n, replace=False).astype(np.int64)
    db = rng.choice(4096, n, replace=False).astype(np.int64)

    async def main() -> dict[str, Any]:
        node = loopback_node(provider)
        async with open_engine(EngineConfig(provider=provider, node=node)) as eng:
            pool = KVPool(eng, "src", layout)
            dst = pool.describe()
            samples = []
            for i in range(5):
                c0, w0 = time.process_time(), time.perf_counter()
                so, do, ln, counts = expand_pages(layout, layout, sb, db, range(32))
                bounds = np.concatenate([[0], np.cumsum(counts)])
                handles = []
                for k in range(32):
                    a, b = int(bounds[k]), int(bounds[k + 1])
                    handles.append(await eng.submit(
                        pool.buffer, dst.region, ScatterList(so[a:b], do[a:b], ln[a:b]),
                        imm=encode_imm(i, k, b - a), dry_run=True))
                for h in handles:
                    await h.wait()
                samples.append((time.process_time() - c0, time.perf_counter() - w0))
            cpu, wall = (statistics.median(x) for x in zip(*samples, strict=True))
            return {"provider": provider, "pattern": "describe+post 112000 pages (dry run)",
                    "pages": int(counts.sum()), "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3}

    return trio.run(main)


def main() -> int:
    ap = parser(__doc__, repeat=5)
    args = ap.parse_args()
    results = []
    for provider in args.providers.split(","):
        results += run(provider, args.repeat)
    return emit("kv", results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
