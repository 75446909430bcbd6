"""KV push through the daemons, against an in-process engine and the C loop
on the same pages.

Two daemons (a: prefill, b: decode) run as separate processes on loopback.
A decode client's pool (``--layers`` x ``--blocks`` x ``--block-kib`` KiB) is
on daemon b; a prefill client's source pool on daemon a pushes every block
into it (random block tables) with ``Client.kv_push``; then an in-process
engine here pushes the same pages (the source pool's shared memory, mapped
here too) into the same pool's region with ``kv.push_pages``; then the C
reference (a C initiator posting the very same pieces, every layer in one
call, into a busy-polling C target in its own process). ``--push-blocks N``
pushes N random blocks of the pool each time (the shape a serving engine
sends: 64 blocks of 16 KiB x 32 layers) instead of all of them.

Reported: seconds per push (client-observed, median) and the ratio, with
what ``p2pxfer plan`` predicted for the push where a profile was saved; time to
first layer (``kv_push`` call -> decode's ``wait_layers(request, 0)``
returning); CPU of describing and posting a 112,000-piece request (32 layers
x 3,500 blocks): the client's, plus the sending daemon's cost before the
provider (``plan_push`` and the engine's ``submit`` with ``dry_run``), plus
the sending daemon's whole CPU for a real push of 64-byte blocks; and the
control round trip of a no-op request.

    python bench/kv_daemon.py --json bench/results/kv_daemon.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from p2pxfer.bench import write_document


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(tmp: Path, provider: str, args: Any) -> list[dict[str, Any]]:
    from p2pxfer import connect
    from p2pxfer._kv_core import LayerSend, push_layers
    from p2pxfer.bench._scenarios import c_to_c
    from p2pxfer.engine import EngineConfig, open_engine
    from p2pxfer.kv import KVLayout, KVPool, KVPoolDescriptor, plan_push, push_pages
    from p2pxfer.kv_plan import expand_pages
    from p2pxfer.loopback import loopback_node
    from p2pxfer.plan import find_profile, predict_kv
    from p2pxfer.scatter import ScatterList
    from p2pxfer.testing import free_port, start_daemon

    pa, pb = free_port(), free_port()
    a = start_daemon(tmp, "a", provider=provider, control_port=pa, log_level="WARNING",
                     peers=[{"name": "b", "address": f"127.0.0.1:{pb}"}])
    b = start_daemon(tmp, "b", provider=provider, control_port=pb, log_level="WARNING",
                     peers=[{"name": "a", "address": f"127.0.0.1:{pa}"}])
    out: list[dict[str, Any]] = []
    lay = KVLayout(args.layers, args.blocks, args.block_kib << 10)
    rng = np.random.default_rng(3)
    try:
        async with connect(b.socket) as decode, connect(a.socket) as prefill, \
                open_engine(EngineConfig(provider=provider,
                                         node=loopback_node(provider))) as eng:
            dst = await decode.kv_pool("bench-kv", lay)
            src = await prefill.kv_pool("bench-src", lay, receive=False)
            src.array[:] = 1
            # The very same source pages (the prefill pool's memfd, mapped here
            # too): anonymous numpy memory would get transparent huge pages,
            # which shared memory does not, and the copy would not compare.
            local = KVPool(eng, "bench-local", lay, buffer=src.mem)
            target = KVPoolDescriptor(dst.descriptor, lay)  # type: ignore[arg-type]
            daemon_s, engine_s, c_s, ttfl, plan_s = [], [], [], [], []
            profile = find_profile(provider)
            n = args.push_blocks or lay.num_blocks
            with c_to_c(provider, src.array, lay.nbytes) as base:
                for i in range(args.repeat + 1):  # the first of each warms up
                    sb = rng.choice(lay.num_blocks, n, replace=False)
                    db = rng.choice(lay.num_blocks, n, replace=False)
                    t0 = time.perf_counter()
                    first: list[float] = []

                    async def first_layer(req: int = i, t: float = t0, box: list[float] = first
                                          ) -> None:
                        await dst.wait_layers(req, 0, timeout=60)
                        box.append(time.perf_counter() - t)

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(first_layer)
                        push = await prefill.kv_push("b", "bench-kv", src, sb, db, request=i)
                        await push.wait()
                        daemon_s.append(time.perf_counter() - t0)
                    await dst.wait_layers(i, lay.num_layers - 1, timeout=60)
                    ttfl.append(first[0])
                    await dst.forget(i)
                    t0 = time.perf_counter()
                    await push_pages(eng, local, target, sb, db, request_id=i)
                    engine_s.append(time.perf_counter() - t0)
                    so, do, ln, _ = expand_pages(lay, lay, sb, db, range(lay.num_layers))
                    c_s.append(base.block([base.plan(ScatterList(so, do, ln))], 7, 60)[1][0])
                    if profile is not None:
                        # both pools are daemons' shared memory
                        plan_s.append(predict_kv(profile, lay, sb, db, shared=True).seconds)
            nbytes = lay.num_layers * n * lay.block_bytes
            d, e = statistics.median(daemon_s[1:]), statistics.median(engine_s[1:])
            c = statistics.median(c_s[1:])
            out.append({"provider": provider, "pattern": f"KV push {lay.num_layers} layers x "
                        f"{n} random blocks of {lay.num_blocks} x {args.block_kib} KiB",
                        "daemon_s": d, "engine_s": e, "c_s": c, "daemon_GBps": nbytes / d / 1e9,
                        "engine_GBps": nbytes / e / 1e9, "c_GBps": nbytes / c / 1e9,
                        "ratio_daemon_over_engine": e / d, "ratio_daemon_over_c": c / d,
                        "ttfl_ms_median": statistics.median(ttfl[1:]) * 1e3,
                        # ``p2pxfer plan``'s prediction of one push (None: no profile)
                        "predicted_s": statistics.median(plan_s[1:]) if plan_s else None})

            # Describe + post of 112,000 pieces (32 layers x 3,500 blocks).
            small = KVLayout(32, 3500, 64)
            s_small = await prefill.kv_pool("bench-small-src", small, receive=False)
            await decode.kv_pool("bench-small", small)
            sb, db = rng.permutation(3500), rng.permutation(3500)
            lay_list = list(range(32))
            t_cpu = time.process_time()
            plan = plan_push(small, small, sb, db, lay_list, src_size=small.nbytes,
                             dst_size=small.nbytes)
            buf = np.zeros(small.nbytes, np.uint8)
            eng.register(buf)

            async def submit(layer: int, sl: ScatterList) -> LayerSend:
                return await eng.submit(buf, dst.descriptor,  # type: ignore[arg-type]
                                        sl, imm=layer, notify=True, dry_run=True)

            await push_layers(plan, submit)  # as the daemon posts, every transfer a dry run
            describe_cpu = time.process_time() - t_cpu
            cpu_a0, t_cpu = cpu_of(a.proc.pid), time.process_time()
            push = await prefill.kv_push("b", "bench-small", s_small, sb, db, request=1)
            await push.wait()
            client_cpu = time.process_time() - t_cpu
            daemon_cpu = cpu_of(a.proc.pid) - cpu_a0
            out.append({"provider": provider, "pattern": "describe + post 112,000 pieces "
                        "(32 layers x 3,500 blocks of 64 B)",
                        "daemon_before_provider_cpu_ms": describe_cpu * 1e3,
                        "client_cpu_ms": client_cpu * 1e3,
                        "sending_daemon_cpu_ms_whole_push": daemon_cpu * 1e3,
                        "pieces": int(plan.counts.sum())})

            rtt = []
            for _ in range(args.rtt):
                t0 = time.perf_counter()
                await prefill.peers()
                rtt.append(time.perf_counter() - t0)
            out.append({"provider": provider, "pattern": "control round trip (peers)",
                        "p50_us": statistics.median(rtt) * 1e6,
                        "p99_us": float(np.percentile(rtt, 99) * 1e6)})
    finally:
        a.stop()
        b.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--providers", default="tcp;ofi_rxm,shm")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write results here as JSON")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--push-blocks", type=int, default=0,
                    help="random blocks per push (0: every block of the pool)")
    ap.add_argument("--rtt", type=int, default=2000)
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    for provider in args.providers.split(","):
        with tempfile.TemporaryDirectory(prefix="p2pxfer-kvbench-") as tmp:
            results += trio.run(measure, Path(tmp), provider, args)
    sys.stdout.write(write_document("kv_daemon", results, args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
