"""The flagship KV push on a quiet and on a busy machine.

Two daemons (``tcp;ofi_rxm`` on loopback, or ``shm``), a decode pool of
``--layers`` x ``--blocks`` blocks of ``--block-kib`` KiB, and ``--pushes``
pushes of ``--per-push`` *random* blocks (scattered: they do not coalesce),
each followed by ``wait_layers`` of its last layer and a byte-for-byte check
of every block: first with the machine as it is, then beside two CPU hogs
(``python3 -c "while True: pass"``), as a serving host busy with other work
would be. Reported per load: pushes completed, p50 / p99 / max seconds per
push (``kv_push`` call to the last layer seen by decode), GB/s at the median.
A push that fails or does not complete within ``--deadline`` is counted as
failed, with its error.

    python bench/kv_push_busy.py --json bench/results/kv-push-busy.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import p2pxfer
from p2pxfer.bench import write_document
from p2pxfer.kv import KVLayout
from p2pxfer.testing import LOOPBACK, free_port, start_daemon


def one_load(args: argparse.Namespace, sock_a: str, sock_b: str, hogs: int,
             seed: int) -> dict[str, Any]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(hogs)]
    rng = np.random.default_rng(seed)
    lay = KVLayout(args.layers, args.blocks, args.block_kib << 10)
    times: list[float] = []
    errors: list[str] = []
    try:
        with p2pxfer.SyncClient(sock_a) as a, p2pxfer.SyncClient(sock_b) as b:
            dst = b.kv_pool(f"kv-{hogs}", lay)
            src = a.kv_pool(f"src-{hogs}", lay, receive=False)
            src.array[:] = rng.integers(0, 256, src.array.size, dtype=np.uint8)
            view_src = src.array[:lay.nbytes].reshape(lay.num_layers, lay.num_blocks, -1)
            view_dst = dst.array[:lay.nbytes].reshape(lay.num_layers, lay.num_blocks, -1)
            for r in range(args.pushes):
                sb = rng.choice(lay.num_blocks, args.per_push, replace=False).astype(np.int64)
                db = rng.choice(lay.num_blocks, args.per_push, replace=False).astype(np.int64)
                t0 = time.perf_counter()
                try:
                    a.kv_push("b", f"kv-{hogs}", src, sb, db, request=r + 1,
                              deadline=args.deadline)
                    b.wait_layers(dst, r + 1, lay.num_layers - 1, timeout=args.deadline)
                except p2pxfer.P2PXferError as exc:
                    errors.append(f"push {r + 1}: {type(exc).__name__}: {exc}"[:300])
                    continue
                took = time.perf_counter() - t0
                if not np.array_equal(view_dst[:, db], view_src[:, sb]):
                    errors.append(f"push {r + 1}: bytes differ")
                    continue
                times.append(took)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    nbytes = args.layers * args.per_push * (args.block_kib << 10)
    q = np.quantile(times, [0.5, 0.99]).tolist() if times else [None, None]
    return {"benchmark": "kv-push-busy", "provider": args.provider, "cpu_hogs": hogs,
            "pushes": args.pushes, "completed": len(times), "failed": len(errors),
            "errors": errors[:5], "p50_s": q[0], "p99_s": q[1],
            "max_s": max(times) if times else None,
            "gbps_at_p50": nbytes / q[0] / 1e9 if times else None,
            "shape": f"{args.layers} layers x {args.per_push} random of {args.blocks} blocks "
                     f"x {args.block_kib} KiB"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="tcp;ofi_rxm")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--block-kib", type=int, default=16)
    p.add_argument("--per-push", type=int, default=64)
    p.add_argument("--pushes", type=int, default=100)
    p.add_argument("--deadline", type=float, default=8.0)
    p.add_argument("--json", help="write the JSON document here")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kv-busy-"))
    pa, pb = free_port(), free_port()
    a = start_daemon(workdir, "a", provider=args.provider, control_port=pa,
                     peers=[{"name": "b", "address": f"{LOOPBACK}:{pb}"}],
                     write_timeout_s=args.deadline)
    try:
        b = start_daemon(workdir, "b", provider=args.provider, control_port=pb,
                         peers=[{"name": "a", "address": f"{LOOPBACK}:{pa}"}],
                         write_timeout_s=args.deadline)
        try:
            results = [one_load(args, a.socket, b.socket, hogs, seed)
                       for seed, hogs in enumerate((0, 2))]
        finally:
            b.stop()
    finally:
        a.stop()
    sys.stdout.write(write_document("kv-push-busy", results, args.json))


if __name__ == "__main__":
    main()
