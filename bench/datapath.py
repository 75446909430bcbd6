"""Data-path benchmark: the Python write path against the raw C loop, same run.

Two processes per provider: a target that exports a 1 GiB region and keeps
its CQ progressed, and an initiator that writes each pattern alternately
through ``p2p_baseline_write`` (posting and completion counting all in C) and
through ``Transport.write`` (the Python API). Machines here are shared and
noisy, so every number is reported next to its same-run baseline, as a ratio.

    python bench/datapath.py --json bench/results/datapath.json
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from _common import emit, parser

GIB = 1 << 30
STOP_IMM = 0xFFFF_FFFF


def patterns(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    page = 64 << 10
    slots = GIB // page
    src = rng.choice(slots, 4096, replace=False).astype(np.int64) * page
    dst = rng.choice(slots, 4096, replace=False).astype(np.int64) * page
    mib = 1 << 20
    idx = np.arange(GIB // mib, dtype=np.int64) * mib
    return {
        "4096x64KiB-random": (src, dst, np.full(4096, page, np.int64)),
        "1024x1MiB": (idx, rng.permutation(idx), np.full(len(idx), mib, np.int64)),
        "1x1GiB": (np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([GIB], np.int64)),
    }


def python_time_per_call(t: Any, fn: Any, repeat: int) -> float:
    """Median time one write spends outside the C calls that post and poll:
    everything Python adds (validation glue, layout, bookkeeping)."""
    poller = t.poller
    in_c = [0.0]

    def timed(method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                in_c[0] += time.perf_counter() - t0
        return wrapper

    poller.post, poller.progress = timed(poller.post), timed(poller.progress)
    try:
        out = []
        for _ in range(repeat):
            in_c[0] = 0.0
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0 - in_c[0])
        return statistics.median(out)
    finally:
        del poller.post, poller.progress


def node_for(provider: str) -> str | None:
    return "127.0.0.1" if provider.startswith("tcp") else None


def target(provider: str, conn: Any) -> None:
    from p2pxfer import Transport

    with Transport.open(provider, node=node_for(provider)) as t:
        buf = np.zeros(GIB, np.uint8)
        conn.send(t.export(buf, "bench").to_bytes())
        t.wait_imm(STOP_IMM, 1)  # progresses (and counts) everything until told to stop


def initiator(provider: str, desc_bytes: bytes, repeat: int) -> list[dict[str, Any]]:
    from p2pxfer import RegionDescriptor, ScatterList, Transport
    from p2pxfer.fabric import baseline_write

    rng = np.random.default_rng(7)
    out = []
    with Transport.open(provider, node=node_for(provider)) as t:
        desc = RegionDescriptor.from_bytes(desc_bytes)
        src = np.ones(GIB, np.uint8)
        region = t.register(src)
        rail, rd = t.rails[0], desc.rails[0]
        dest = rail.peer(rd.address)
        for name, (so, do, ln) in patterns(rng).items():
            sl = ScatterList(so, do, ln)

            def c_loop(sl: ScatterList = sl) -> None:
                baseline_write(rail, dest, sl.src, sl.dst, sl.length, region.address,
                               region.mrs[0].desc, rd.base, rd.key, 1)

            def py_path(sl: ScatterList = sl) -> None:
                t.write(region, desc, sl, imm=1)

            c_loop(), py_path()  # warm-up: connections, page faults
            times: dict[str, list[float]] = {"c": [], "py": []}
            for _ in range(repeat):
                for key, fn in (("c", c_loop), ("py", py_path)):
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            python_ms = python_time_per_call(t, lambda sl=sl: py_path(sl), repeat) * 1e3
            nbytes = int(ln.sum())
            c_s, py_s = statistics.median(times["c"]), statistics.median(times["py"])
            out.append({
                "provider": provider, "pattern": name, "pieces": len(ln), "bytes": nbytes,
                "baseline_seconds": c_s, "seconds": py_s,
                "baseline_gbps": nbytes / c_s / 1e9, "gbps": nbytes / py_s / 1e9,
                "ratio": c_s / py_s, "python_overhead_ms": (py_s - c_s) * 1e3,
                "python_ms_per_call": python_ms,
                "repeat": repeat,
            })
        t.write(region, desc, ScatterList.contiguous(1), imm=STOP_IMM)
    return out


def run_provider(provider: str, repeat: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(provider, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError(f"{provider}: target did not start")
        return initiator(provider, parent.recv(), repeat)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    ap = parser(__doc__, repeat=5)
    args = ap.parse_args()
    results = []
    for provider in args.providers.split(","):
        results += run_provider(provider, args.repeat)
    return emit("datapath", results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
