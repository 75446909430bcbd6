"""``p2pxfer bench --device cuda``: KV pushes of device memory through the
staged path against the host path and plain CUDA copies of the same blocks,
measured in the same run, round by round.

Rows (GB/s of KV bytes moved, and first-layer latency where there are
layers):

- ``host``: host pool -> host pool (the fabric alone);
- ``staged``: device pool -> device pool (device -> mirror, fabric,
  mirror -> device; the receiver's copies to its device included);
- ``d2h copy``, ``h2d copy``: the same scattered blocks copied between a
  device pool and its pinned mirror (``DeviceStage``), no fabric;
- ``d2d copy``: the same blocks device -> device, one CUDA copy per run of
  blocks (the plain device copy);
- ``registration``: seconds per GiB to set up a device pool's staging
  (pinning its mirror: a miss) and a second one over memory already pinned
  (a hit), and to export the mirror on the fabric.

Two engines in this process on ``provider`` (loopback for IP providers).
The ratio the issue asks for is ``staged / min(host, d2h, h2d)``. What must
not live here: option parsing (``p2pxfer.cli``), CUDA calls other than
through ``p2pxfer.devmem``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import trio

from p2pxfer.devmem import DeviceMemory, DeviceStage, driver
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.kv import KVPool, push_pages
from p2pxfer.kv_plan import KVLayout, expand_pages
from p2pxfer.loopback import loopback_node

__all__ = ["device_bench"]

Record = dict[str, Any]
GIB = 1 << 30


def _rate(nbytes: int, seconds: list[float]) -> Record:
    med = statistics.median(seconds)
    return {"nbytes": nbytes, "seconds": med, "gbps": nbytes / med / 1e9,
            "rounds": len(seconds)}


async def device_bench(provider: str = "shm", block_bytes: int = 64 << 10, layers: int = 8,
                       blocks: int = 256, pool_blocks: int = 512, rounds: int = 5,
                       warmup: int = 1, device: int = 0, seed: int = 3) -> list[Record]:
    drv = driver()
    lay = KVLayout(layers, pool_blocks, block_bytes, planes=2)
    rng = np.random.default_rng(seed)
    sb = np.sort(rng.choice(pool_blocks, blocks, replace=False)).astype(np.int64)
    db = rng.permutation(pool_blocks)[:blocks].astype(np.int64)
    nbytes = blocks * lay.planes * layers * block_bytes
    allocs = [drv.alloc(lay.nbytes, device) for _ in range(2)]
    src_dev, dst_dev = (DeviceMemory(a, lay.nbytes, device, None) for a in allocs)
    out: list[Record] = []
    base = {"provider": provider, "block_bytes": block_bytes, "layers": layers,
            "blocks": blocks, "device": device}
    try:
        cfg = EngineConfig(provider=provider, node=loopback_node(provider))
        async with open_engine(cfg) as a, open_engine(cfg) as b:
            t0 = time.perf_counter()
            s_dev = KVPool(a, "bench-dev-src", lay, buffer=src_dev)
            setup_miss = time.perf_counter() - t0
            d_dev = KVPool(b, "bench-dev-dst", lay, buffer=dst_dev)
            s_host = KVPool(a, "bench-host-src", lay)
            d_host = KVPool(b, "bench-host-dst", lay)
            s_host.array[:] = 0x5A
            assert s_dev.stage is not None and d_dev.stage is not None
            t0 = time.perf_counter()
            hit = DeviceStage(src_dev, s_dev.array, lay)  # its mirror is pinned already
            setup_hit = time.perf_counter() - t0
            hit.close()
            t0 = time.perf_counter()
            a.export(s_host.array, "bench-export-probe")
            export_s = time.perf_counter() - t0
            a.unexport("bench-export-probe")
            gib = lay.nbytes / GIB
            out.append({**base, "row": "registration", "pool_bytes": lay.nbytes,
                        "staging_miss_s_per_gib": setup_miss / gib,
                        "staging_hit_s_per_gib": setup_hit / gib,
                        "export_s_per_gib": export_s / gib})

            timings: dict[str, list[float]] = {k: [] for k in
                                               ("host", "staged", "d2h", "h2d", "d2d")}
            first: dict[str, list[float]] = {"host": [], "staged": []}
            req = 0
            s_stage, d_stage = s_dev.stage, d_dev.stage
            lays = list(range(layers))
            off, doff, length, _ = expand_pages(lay, lay, sb, db, lays)
            stream = drv.stream(device)
            try:
                for r in range(warmup + rounds):
                    keep = r >= warmup
                    for name, src, dst, wait_blocks in (("host", s_host, d_host, None),
                                                        ("staged", s_dev, d_dev, db)):
                        req += 1
                        t0 = time.perf_counter()
                        res = await push_pages(a, src, dst.describe(), sb, db, request_id=req)
                        await dst.wait_layers(req, layers - 1, blocks=wait_blocks)
                        if keep:
                            timings[name].append(time.perf_counter() - t0)
                            first[name].append(res.first_layer_seconds)
                        dst.forget(req)
                    for name, stage, fn in (("d2h", s_stage, s_stage.to_host),
                                            ("h2d", d_stage, d_stage.to_device)):
                        t0 = time.perf_counter()
                        events = fn(sb, lays)
                        stage.sync(events[-1])
                        stage.release(events)
                        if keep:
                            timings[name].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    drv.copy(stream, device, dst_dev.address, src_dev.address, off, doff, length)
                    drv.stream_sync(stream, device)
                    if keep:
                        timings["d2d"].append(time.perf_counter() - t0)
            finally:
                drv.stream_destroy(stream, device)
            rows = {k: _rate(nbytes, v) for k, v in timings.items()}
            floor = min(rows["host"]["gbps"], rows["d2h"]["gbps"], rows["h2d"]["gbps"])
            for name, row in rows.items():
                rec = {**base, "row": name if name in ("host", "staged") else f"{name} copy",
                       **row}
                if name in first:
                    rec["first_layer_ms"] = statistics.median(first[name]) * 1e3
                    rec["per_layer_ms"] = row["seconds"] / layers * 1e3
                if name == "staged":
                    rec["ratio_vs_min_host_copy"] = row["gbps"] / floor
                out.append(rec)
            for pool in (s_dev, d_dev, s_host, d_host):
                pool.close()
    finally:
        for address in allocs:
            drv.free(address, device)
    return out


def run(provider: str, block_bytes: int, rounds: int) -> list[Record]:
    return trio.run(lambda: device_bench(provider, block_bytes, rounds=rounds))
