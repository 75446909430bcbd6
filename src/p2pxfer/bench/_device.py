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
  (a hit), and to export the mirror on the fabric;
- with ``hmem``, two more engines opened with ``EngineConfig.hmem``:
  ``direct`` (device pool -> device pool, the device memory registered as is,
  no mirror, no copies) and ``registration direct`` (seconds per GiB to
  export device memory on the fabric: the first export of an allocation, a
  miss, and a second export of the same memory while the first stands, which
  a provider's registration cache may answer, a hit). Where the provider
  cannot register device memory, ``registration direct`` says why and there is
  no ``direct`` row.

Two engines in this process on ``provider`` (loopback for IP providers),
two more with ``hmem``, all napping at most ``BUSY_BACKOFF_NS`` where a CQ
has no wait fd: libfabric 2.x's shm skips its CMA check between two
endpoints of one process and moves every write through bounce buffers that
only the target's progress drains, so a napping target would be what this
measured (0.017 GB/s on libfabric 2.6; 1.17 does not do this). An engine
idle for 2 s still naps 16 ms (the poller's deep idle): on 2.x, each write
into it waits up to that long until its first completion (a layer's
notification) wakes it.

The ratio the issue asks for is ``staged / min(host, d2h, h2d)``. What must
not live here: option parsing (``p2pxfer.cli``), CUDA calls other than
through ``p2pxfer.devmem``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import trio

from p2pxfer.devmem import DeviceMemory, DeviceStage, driver
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.errors import FabricError, RegistrationError
from p2pxfer.kv import KVPool, push_pages
from p2pxfer.kv_plan import KVLayout, expand_pages
from p2pxfer.loopback import loopback_node

__all__ = ["device_bench"]

Record = dict[str, Any]
GIB = 1 << 30
#: the engines' polling: naps of at most this, spinning that long after activity
BUSY_BACKOFF_NS, BUSY_SPIN_NS = 20_000, 5_000_000


def _rate(nbytes: int, seconds: list[float]) -> Record:
    med = statistics.median(seconds)
    return {"nbytes": nbytes, "seconds": med, "gbps": nbytes / med / 1e9,
            "rounds": len(seconds)}


async def _direct_pools(a: Any, b: Any, lay: KVLayout, src: DeviceMemory, dst: DeviceMemory,
                        base: Record) -> tuple[Record, tuple[KVPool, KVPool] | None]:
    """The ``registration direct`` record, and the two direct pools where the
    provider registers device memory (else None, the record saying why)."""
    gib = lay.nbytes / GIB
    t0 = time.perf_counter()
    try:
        a.export(src, "bench-direct-probe")
    except (RegistrationError, FabricError) as exc:
        return {**base, "row": "registration direct", "available": False,
                "reason": str(exc)}, None
    try:
        miss = time.perf_counter() - t0
        t0 = time.perf_counter()
        a.export(src, "bench-direct-probe-2")
        hit = time.perf_counter() - t0
    finally:
        for name in ("bench-direct-probe", "bench-direct-probe-2"):
            if name in a.exported():
                a.unexport(name)
    src_pool = KVPool(a, "bench-direct-src", lay, buffer=src)
    try:
        pools = (src_pool, KVPool(b, "bench-direct-dst", lay, buffer=dst))
    except BaseException:
        src_pool.close()
        raise
    if not all(p.direct for p in pools):
        for p in pools:
            p.close()
        return {**base, "row": "registration direct", "available": False,
                "reason": "the engine exported device memory but a KV pool staged it"}, None
    return {**base, "row": "registration direct", "available": True,
            "pool_bytes": lay.nbytes, "device_export_miss_s_per_gib": miss / gib,
            "device_export_hit_s_per_gib": hit / gib}, pools


async def device_bench(provider: str = "shm", block_bytes: int = 64 << 10, layers: int = 8,
                       blocks: int = 256, pool_blocks: int = 512, rounds: int = 5,
                       warmup: int = 1, device: int = 0, seed: int = 3,
                       hmem: bool = False) -> list[Record]:
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
        cfg = EngineConfig(provider=provider, node=loopback_node(provider),
                           backoff_max_ns=BUSY_BACKOFF_NS, spin_ns=BUSY_SPIN_NS)
        async with contextlib.AsyncExitStack() as engines:
            a = await engines.enter_async_context(open_engine(cfg))
            b = await engines.enter_async_context(open_engine(cfg))
            if hmem:
                hcfg = dataclasses.replace(cfg, hmem=True)
                ah = await engines.enter_async_context(open_engine(hcfg))
                bh = await engines.enter_async_context(open_engine(hcfg))
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

            direct: tuple[KVPool, KVPool] | None = None
            if hmem:
                reg, direct = await _direct_pools(ah, bh, lay, src_dev, dst_dev, base)
                out.append(reg)
            pushes: list[tuple[str, Any, KVPool, KVPool, Any]] = [
                ("host", a, s_host, d_host, None), ("staged", a, s_dev, d_dev, db)]
            if direct is not None:
                pushes.append(("direct", ah, *direct, None))
            names = [p[0] for p in pushes]
            timings: dict[str, list[float]] = {k: [] for k in (*names, "d2h", "h2d", "d2d")}
            first: dict[str, list[float]] = {k: [] for k in names}
            req = 0
            s_stage, d_stage = s_dev.stage, d_dev.stage
            lays = list(range(layers))
            off, doff, length, _ = expand_pages(lay, lay, sb, db, lays)
            stream = drv.stream(device)
            try:
                for r in range(warmup + rounds):
                    keep = r >= warmup
                    for name, eng, src, dst, wait_blocks in pushes:
                        req += 1
                        t0 = time.perf_counter()
                        res = await push_pages(eng, src, dst.describe(), sb, db, request_id=req)
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
                rec = {**base, "row": name if name in first else f"{name} copy", **row}
                if name in first:
                    rec["first_layer_ms"] = statistics.median(first[name]) * 1e3
                    rec["per_layer_ms"] = row["seconds"] / layers * 1e3
                if name == "staged":
                    rec["ratio_vs_min_host_copy"] = row["gbps"] / floor
                if name == "direct":
                    rec["ratio_vs_host"] = row["gbps"] / rows["host"]["gbps"]
                out.append(rec)
            for pool in (s_dev, d_dev, s_host, d_host, *(direct or ())):
                pool.close()
    finally:
        for address in allocs:
            drv.free(address, device)
    return out


def run(provider: str, block_bytes: int, rounds: int, hmem: bool = False) -> list[Record]:
    return trio.run(lambda: device_bench(provider, block_bytes, rounds=rounds, hmem=hmem))
