"""Scenarios beyond the scatter-write test, each ours against the C reference.

- ``dry_run``: the engine's own cost per page (validation, striping,
  bookkeeping, the thread hand-off; no provider calls);
- ``latency``: one write of one piece at a time, ours (``Engine.write`` into a
  bench server) against the C-to-C reference's single write and a C ping-pong
  round trip (one write each way, both ends busy-polling in C);
- ``idle``: CPU of an open engine with no traffic;
- ``kv``: ``push_pages`` of whole layers against the C-to-C reference writing
  the same expanded pieces, time to first layer, and the CPU to describe and
  submit a 112,000-page request (dry run);
- ``control_rtt``: a no-op request (``peers``) through a running daemon, from
  trio, asyncio and blocking clients against raw-socket baselines (``_rtt``).
- ``same-daemon`` (``_local``): a write between two clients of one daemon
  (its copy fast path) against memcpy of the same bytes.

Each returns JSON-ready records (``run_scenario`` runs one under trio). Our
side always runs through the engine (or a client and its daemon); targets run
in their own processes on this host. What must not live here: option parsing,
rendering, fabric calls (``_reference`` has the C reference).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from typing import Any

import numpy as np
import trio

from p2pxfer._kv_core import LayerSend, push_layers
from p2pxfer.engine import Engine, EngineConfig, open_engine
from p2pxfer.kv import (
    KVLayout,
    KVPool,
    KVPoolDescriptor,
    encode_imm,
    expand_pages,
    plan_push,
    push_pages,
)
from p2pxfer.loopback import loopback_node
from p2pxfer.memory import RegionDescriptor
from p2pxfer.plan import find_profile, predict_kv
from p2pxfer.scatter import ScatterList

from ._local import same_daemon
from ._measure import Reference
from ._options import BenchConfigError, format_size
from ._reference import (
    ReferenceInitiator,
    ReferenceTarget,
    close_rails,
    open_rails,
    process_cpu_seconds,
)
from ._rtt import measure_control_rtt
from ._run import loopback_server, unwrap_group
from ._server import ServerConfig, connect_server, pick_interfaces

__all__ = ["SCENARIOS", "c_to_c", "control_rtt", "dry_run", "idle", "kv", "latency",
           "run_scenario"]

Record = dict[str, Any]
TIMEOUT = 60.0


def _us(xs: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e6


@asynccontextmanager
async def _setup(provider: str, size: int, *, reference: bool = True,
                 target_backoff_ns: int = ServerConfig.backoff_max_ns
                 ) -> AsyncIterator[tuple[Engine, np.ndarray, RegionDescriptor, int,
                                          Reference | None]]:
    """Our engine and a ``size``-byte source, a bench server's region (our
    target, its process id), and the C-to-C reference over the same provider.
    ``target_backoff_ns``: the target's longest nap (by default the bench
    server's short one)."""
    node = loopback_node(provider)
    names = pick_interfaces(provider, node, 1, None)
    async with AsyncExitStack() as stack:
        port, pid = await stack.enter_async_context(
            loopback_server(backoff_max_ns=target_backoff_ns))
        link = await stack.enter_async_context(connect_server("127.0.0.1", port,
                                                              timeout=TIMEOUT))
        dst = await stack.enter_async_context(link.region(provider, size, 1))
        engine = await stack.enter_async_context(open_engine(EngineConfig(
            provider=provider, node=node, interfaces=names)))
        src = np.full(size, 0xA5, np.uint8)
        engine.register(src)
        base = stack.enter_context(c_to_c(provider, src, size)) if reference else None
        yield engine, src, dst, pid, base


@contextmanager
def c_to_c(provider: str, src: np.ndarray, size: int) -> Iterator[Reference]:
    """The C reference alone (a C initiator writing from ``src`` into a
    busy-polling C target of ``size`` bytes in its own process), for benches
    that measure our side elsewhere (``bench/kv_daemon.py``)."""
    node = loopback_node(provider)
    names = pick_interfaces(provider, node, 1, None)
    with ExitStack() as stack:
        target = stack.enter_context(ReferenceTarget(provider, node, names, size))
        rails = open_rails(provider, node, names)
        stack.callback(close_rails, rails)
        ini = ReferenceInitiator(rails, src, target.descriptor)
        stack.callback(ini.close)
        yield Reference(ini, target)


async def dry_run(provider: str, pages: int = 4096, page_size: int = 64 << 10,
                  repeat: int = 20) -> list[Record]:
    """Nanoseconds of engine work per page, no provider calls."""
    rng = np.random.default_rng(3)
    sl = ScatterList(rng.permutation(pages).astype(np.int64) * page_size,
                     rng.permutation(pages).astype(np.int64) * page_size,
                     np.full(pages, page_size, np.int64))
    async with open_engine(EngineConfig(provider=provider, node=loopback_node(provider))) as e:
        buf = np.zeros(pages * page_size, np.uint8)
        dst = e.export(buf, "dry-run")
        await e.write(buf, dst, sl, dry_run=True)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await e.write(buf, dst, sl, dry_run=True)
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return [{"provider": provider, "pattern": f"dry-run {pages}x{format_size(page_size)}",
             "pages": pages, "seconds": s, "ns_per_page": s / pages * 1e9,
             "pages_per_s": pages / s}]


async def latency(provider: str, sizes: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20),
                  iters: int = 400, gaps_ms: tuple[float, ...] = (),
                  gap_iters: int = 50) -> list[Record]:
    """One write of one piece at a time: ours and the C reference's write
    (post to local completion), and the C ping-pong round trip. For each of
    ``gaps_ms``, also each size written once after the target idled that
    long, ``gap_iters`` times (``_after_idle``), into a target that naps as a
    daemon's does: what the first write of a burst meets."""
    out: list[Record] = []
    if gaps_ms:
        # A target that naps as a daemon's does (the bench server's naps are
        # short on purpose): what the first write of a burst meets.
        async with _setup(provider, max(sizes),
                          target_backoff_ns=EngineConfig.backoff_max_ns) as (
                engine, src, dst, _pid, base):
            assert base is not None
            for gap in gaps_ms:
                for size in sizes:
                    out.append(await _after_idle(provider, engine, src, dst, base, size, gap,
                                                 gap_iters))
    async with _setup(provider, max(sizes)) as (engine, src, dst, _pid, base):
        assert base is not None
        for size in sizes:
            sl = ScatterList.contiguous(size)
            plan = base.plan(sl)
            await engine.write(src, dst, sl, imm=1)
            base.block([plan] * 10, 1, TIMEOUT)  # connect, warm up
            ours = []
            for _ in range(iters):
                t0 = time.perf_counter()
                await engine.write(src, dst, sl, imm=1)
                ours.append(time.perf_counter() - t0)
            _, ref, _ = base.block([plan] * iters, 1, TIMEOUT)
            assert base.target is not None
            into_c = await _into_c_target(engine, src, base.target, sl, iters)
            base.target.pong(size, iters, base.ini.descriptor(), TIMEOUT)
            rtt = base.ini.pingpong(size, iters, TIMEOUT) / 1e9
            base.target.pong_done(TIMEOUT)
            p50, c50, r50 = _us(ours, 50), _us(ref, 50), _us(rtt, 50)
            i50 = _us(into_c, 50)
            out.append({"provider": provider, "pattern": f"one {format_size(size)} write",
                        "bytes": size, "iterations": iters, "p50_us": p50,
                        "p99_us": _us(ours, 99), "baseline_p50_us": c50,
                        "baseline_p99_us": _us(ref, 99), "pingpong_rtt_p50_us": r50,
                        "ratio": p50 / c50, "ratio_to_pingpong": p50 / r50,
                        "into_c_target_p50_us": i50, "into_c_target_ratio": i50 / c50,
                        "reference": "c-to-c"})
    return out


async def _into_c_target(engine: Engine, src: np.ndarray, target: ReferenceTarget,
                         sl: ScatterList, iters: int) -> list[float]:
    """``iters`` of our single writes into the busy-polling C target (after
    one untimed): beside ours into our target and C into C, it says which
    end a gap comes from."""
    target.expect([iters + 1], TIMEOUT * (iters + 1))
    await engine.write(src, target.descriptor, sl, imm=1)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await engine.write(src, target.descriptor, sl, imm=1)
        times.append(time.perf_counter() - t0)
    target.collect(TIMEOUT * (iters + 1))
    return times


async def _after_idle(provider: str, engine: Engine, src: np.ndarray, dst: RegionDescriptor,
                      base: Reference, size: int, gap_ms: float, iters: int) -> Record:
    """``iters`` single writes of ``size`` bytes, each after ``gap_ms`` of
    nothing to its target: ours, then the C reference's (its target
    busy-polls through the gaps)."""
    sl = ScatterList.contiguous(size)
    plan = base.plan(sl)
    await engine.write(src, dst, sl, imm=1)
    base.block([plan], 1, TIMEOUT)
    ours = []
    for _ in range(iters):
        await trio.sleep(gap_ms / 1e3)
        t0 = time.perf_counter()
        await engine.write(src, dst, sl, imm=1)
        ours.append(time.perf_counter() - t0)
    ref = base.block([plan] * iters, 1, TIMEOUT * iters, gap_s=gap_ms / 1e3)[1]
    p50, c50 = _us(ours, 50), _us(ref, 50)
    return {"provider": provider, "pattern": f"one {format_size(size)} write after "
            f"{gap_ms:g} ms idle", "bytes": size, "iterations": iters, "gap_ms": gap_ms,
            "p50_us": p50, "p99_us": _us(ours, 99), "baseline_p50_us": c50,
            "baseline_p99_us": _us(ref, 99), "ratio": p50 / c50, "reference": "c-to-c"}


async def idle(provider: str, seconds: float = 10.0) -> list[Record]:
    """Fraction of a core an open engine with no traffic uses."""
    async with open_engine(EngineConfig(provider=provider, node=loopback_node(provider))):
        await trio.sleep(0.5)
        cpu0, t0 = process_cpu_seconds(), time.monotonic()
        await trio.sleep(seconds)
        busy = (process_cpu_seconds() - cpu0) / (time.monotonic() - t0)
    return [{"provider": provider, "pattern": "idle engine", "seconds": seconds,
             "cpu_fraction_of_core": busy}]


async def _kv_push(provider: str, layers: int, blocks: int, block_bytes: int,
                   repeat: int) -> Record:
    layout = KVLayout(layers, blocks, block_bytes)
    rng = np.random.default_rng(5)
    # Every block, in random order on both sides: little to coalesce.
    sb = rng.permutation(blocks).astype(np.int64)
    db = rng.permutation(blocks).astype(np.int64)
    so, do, ln, _ = expand_pages(layout, layout, sb, db, range(layers))
    flat = ScatterList(so, do, ln)
    async with _setup(provider, layout.nbytes) as (engine, src, region, pid, base):
        assert base is not None
        pool = KVPool(engine, "bench-src", layout, buffer=src)
        dst = KVPoolDescriptor(region, layout)
        plan = base.plan(flat)
        await push_pages(engine, pool, dst, sb, db, request_id=1)
        base.block([plan], 7, TIMEOUT)
        ours, ttfl, ref = [], [], []
        cpu = {"ours": 0.0, "ours_target": 0.0, "ref": 0.0, "ref_target": 0.0}
        for i in range(repeat):
            c0, t0 = process_cpu_seconds(), process_cpu_seconds(pid)
            r = await push_pages(engine, pool, dst, sb, db, request_id=2 + i)
            cpu["ours"] += process_cpu_seconds() - c0
            cpu["ours_target"] += process_cpu_seconds(pid) - t0
            ours.append(r.seconds)
            ttfl.append(r.first_layer_seconds)
            c0 = process_cpu_seconds()
            _, dts, tcpu = base.block([plan], 7, TIMEOUT)
            cpu["ref"] += process_cpu_seconds() - c0
            cpu["ref_target"] += tcpu or 0.0
            ref.append(dts[0])
    gb = flat.nbytes * repeat / 1e9
    o, c = statistics.median(ours), statistics.median(ref)
    profile = find_profile(provider)
    return {"provider": provider,
            "pattern": f"kv {layers}x{blocks} of {format_size(block_bytes)} blocks",
            "pages": len(flat), "bytes": flat.nbytes, "seconds": o, "baseline_seconds": c,
            "gbps": flat.nbytes / o / 1e9, "baseline_gbps": flat.nbytes / c / 1e9,
            "ratio": c / o, "time_to_first_layer_ms": statistics.median(ttfl) * 1e3,
            "cpu_s_per_gb": (cpu["ours"] + cpu["ours_target"]) / gb,
            "baseline_cpu_s_per_gb": (cpu["ref"] + cpu["ref_target"]) / gb,
            "reference": "c-to-c", "repeat": repeat,
            # what ``p2pxfer plan`` predicted for one push (None: no profile saved)
            "predicted_seconds": None if profile is None else predict_kv(
                profile, layout, sb, db).seconds}


async def _kv_describe(provider: str, layers: int = 32, blocks: int = 1750,
                       repeat: int = 5) -> Record:
    """CPU to expand and submit a layers x 2 planes x ``blocks`` request (dry run)."""
    layout = KVLayout(layers, max(4096, blocks), 4096, planes=2)
    rng = np.random.default_rng(9)
    sb = rng.choice(layout.num_blocks, blocks, replace=False).astype(np.int64)
    db = rng.choice(layout.num_blocks, blocks, replace=False).astype(np.int64)
    async with open_engine(EngineConfig(provider=provider, node=loopback_node(provider))) as e:
        pool = KVPool(e, "src", layout)
        dst = pool.describe()
        samples = []
        npages = 0

        async def submit(layer: int, sl: ScatterList) -> LayerSend:
            return await e.submit(pool.buffer, dst.region, sl, imm=encode_imm(1, layer),
                                  notify=True, dry_run=True)

        for _ in range(repeat):
            c0, w0 = process_cpu_seconds(), time.perf_counter()
            # As ``push_pages`` plans and posts, every transfer a dry run.
            plan = plan_push(layout, layout, sb, db, range(layers), src_size=layout.nbytes,
                             dst_size=layout.nbytes)
            await push_layers(plan, submit)
            samples.append((process_cpu_seconds() - c0, time.perf_counter() - w0))
            npages = int(plan.counts.sum())
    cpu, wall = (statistics.median(x) for x in zip(*samples, strict=True))
    return {"provider": provider, "pattern": f"describe+post {npages} pages (dry run)",
            "pages": npages, "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3}


async def kv(provider: str, layers: int = 32, blocks: int = 1024,
             block_sizes: tuple[int, ...] = (16 << 10, 64 << 10), repeat: int = 5,
             describe_blocks: int = 1750) -> list[Record]:
    out = [await _kv_push(provider, layers, blocks, bb, repeat) for bb in block_sizes]
    out.append(await _kv_describe(provider, layers, describe_blocks))
    return out


async def control_rtt(socket: str, n: int = 500, rounds: int = 5,
                      kind: str = "peers") -> list[Record]:
    """Round trips of a no-op request (``peers``) through the daemon at
    ``socket``: trio, asyncio and blocking clients against raw sockets in the
    same run (``_rtt``). In a worker thread: each path runs its own loop."""
    return await trio.to_thread.run_sync(measure_control_rtt, socket, n, rounds, kind)


SCENARIOS: dict[str, Callable[..., Awaitable[list[Record]]]] = {
    "dry-run": dry_run, "latency": latency, "idle": idle, "kv": kv, "control-rtt": control_rtt,
    "same-daemon": same_daemon,
}


def run_scenario(name: str, **kwargs: Any) -> list[Record]:
    """Run scenario ``name`` (blocking; its own trio loop). Raises one plain
    error, never a group."""
    if name not in SCENARIOS:
        raise BenchConfigError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
    fn = SCENARIOS[name]
    try:
        return trio.run(lambda: fn(**kwargs))
    except BaseExceptionGroup as group:
        raise unwrap_group(group) from None
