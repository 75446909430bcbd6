"""Push as computed against pull after the prefill, through the vLLM
connector's worker half (``_worker.Worker``) and two daemons on loopback.

A batch of ``--requests`` requests of ``--tokens`` tokens over ``--layers``
layers (per-layer host tensors, ``(2, blocks, block_size, kv_heads, head)``
float16). Each round runs a prefill forward that takes ``--layer-ms`` per
layer (a sleep: a GPU computes while the host thread waits) and saves
each layer as vLLM's ``save_kv_layer`` does, three ways in turn:

- ``forward``: the forward alone (no transfer): the lower bound;
- ``pull``: the forward, then the finished requests are held and the
  decode pulls them (vLLM's usual flow: the decode learns of the request
  from the prefill's answer), timed from the forward's start until the
  decode has every layer of every request in its tensors;
- ``push``: the decode's loads start first (a proxy that sends the request
  to both engines at once), the prefill pushes each layer as it is
  saved; timed the same way.

Reported (medians over rounds): seconds of each, the transfer alone
(``pull`` minus ``forward``), ``speedup`` (pull / push), and the share of
the shorter of forward and transfer that pushing hid
(``(pull - push) / min(forward, transfer)``: 1 is full overlap). The decode's
bytes are checked after the last round.

    python bench/vllm_push.py --json bench/results/vllm_push.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from p2pxfer.bench import write_document
from vllm_connector import host_tensors, shape_args, two_daemons


def measure(tmp: Path, args: Any) -> dict[str, Any]:
    from p2pxfer.integrations.vllm._plan import Load, Open, Save, Send
    from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions

    per_req = -(-args.tokens // args.block_size)
    n_blocks = args.requests * per_req + 8
    a, b = two_daemons(tmp)
    src_tables = [tuple(range(r * per_req, (r + 1) * per_req)) for r in range(args.requests)]
    perm = np.random.default_rng(1).permutation(n_blocks)
    dst_tables = [tuple(int(x) for x in perm[r * per_req:(r + 1) * per_req])
                  for r in range(args.requests)]
    src = host_tensors(args, n_blocks, 7)
    pairs: dict[str, tuple[Worker, Worker]] = {}
    dsts: dict[str, dict[str, Any]] = {}
    common: dict[str, Any] = {"rank": 0, "block_size": args.block_size,
                              "max_blocks": per_req + 1, "max_held": 4 * args.requests,
                              "max_loads": 4 * args.requests}
    times: dict[str, list[float]] = {"forward": [], "pull": [], "push": []}
    try:
        for mode in ("pull", "push"):
            p = Worker(WorkerOptions(socket=a.socket, engine=f"P{mode}", send=True,
                                     receive=False, **common))
            d = Worker(WorkerOptions(socket=b.socket, engine=f"D{mode}", send=False,
                                     receive=True, **common))
            pairs[mode] = (p, d)
            p.register(src)
            dsts[mode] = host_tensors(args, n_blocks, None)
            d.register(dsts[mode])

        def forward(p: Worker | None, saves: list[Save]) -> None:
            for name in src:
                time.sleep(args.layer_ms / 1000)
                if p is not None:
                    p.stage_layer(name, saves)
            if p is not None:
                p.end_step(saves)

        def wait(p: Worker, d: Worker, ids: list[str]) -> None:
            want_d, want_p = {f"d-{r}" for r in ids}, set(ids)
            while want_d or want_p:
                sent, _ = p.finished()
                _, received = d.finished()
                want_p -= sent
                want_d -= received
                time.sleep(0.001)
            if d.load_errors():
                raise RuntimeError("load errors")

        for r in range(args.rounds + 1):  # round 0 warms up
            ids = [f"r{r}-{i}" for i in range(args.requests)]
            base = (r % 3) * args.requests + 1  # keys: free again by then
            keys = range(base, base + args.requests)
            if r == args.rounds:
                for dst in dsts.values():
                    for t in dst.values():
                        t[...] = 0
            t0 = time.perf_counter()
            forward(None, [])
            got = {"forward": time.perf_counter() - t0}

            p, d = pairs["pull"]
            t0 = time.perf_counter()
            forward(p, [Save(i, s) for i, s in zip(ids, src_tables, strict=True)])
            p.hold([Send(i, k, s) for i, k, s in zip(ids, keys, src_tables, strict=True)])
            d.load([Load(f"d-{i}", "node-a", "Ppull", k, i, 0, t)
                    for i, k, t in zip(ids, keys, dst_tables, strict=True)])
            wait(p, d, ids)
            got["pull"] = time.perf_counter() - t0

            p, d = pairs["push"]
            t0 = time.perf_counter()
            d.load([Load(f"d-{i}", "node-a", "Ppush", 0, f"t-{i}", 0, t, f"t-{i}")
                    for i, t in zip(ids, dst_tables, strict=True)])
            p.open([Open(i, k, f"t-{i}") for i, k in zip(ids, keys, strict=True)])
            saves = [Save(i, s, last=True, table=s) for i, s in zip(ids, src_tables, strict=True)]
            forward(p, saves)
            p.hold([Send(i, k, s, f"t-{i}") for i, k, s in zip(ids, keys, src_tables,
                                                               strict=True)])
            wait(p, d, ids)
            got["push"] = time.perf_counter() - t0
            if r:
                for k, v in got.items():
                    times[k].append(v)
        for dst in dsts.values():  # the last round's bytes
            for name, t in src.items():
                for s, dt in zip(src_tables, dst_tables, strict=True):
                    assert (dst[name][:, list(dt)].view(np.uint16) ==
                            t[:, list(s)].view(np.uint16)).all()
    finally:
        for p, d in pairs.values():
            d.close()
            p.close()
        a.stop()
        b.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    transfer = med["pull"] - med["forward"]
    block_bytes = 2 * args.block_size * args.kv_heads * args.head * 2
    return {
        "provider": "tcp;ofi_rxm",  # the daemons' (two_daemons)
        "pattern": f"{args.requests} requests x {args.layers} layers x {per_req} blocks "
                   f"(K+V, {block_bytes >> 11} KiB per block per plane), forward "
                   f"{args.layer_ms:g} ms per layer",
        "bytes_per_round": args.requests * args.layers * per_req * block_bytes,
        "rounds": args.rounds,
        "seconds": med,
        "transfer_seconds": transfer,
        "speedup_push_vs_pull": med["pull"] / med["push"],
        "paired_speedup": statistics.median(
            pl / ps for pl, ps in zip(times["pull"], times["push"], strict=True)),
        "overlap_hidden": (med["pull"] - med["push"]) / min(med["forward"], transfer)
        if min(med["forward"], transfer) > 0 else None,
        "all_seconds": times,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shape_args(ap)
    ap.add_argument("--layer-ms", type=float, default=8.0,
                    help="the simulated forward's time per layer")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pxfer-vllm-push-") as tmp:
        result = measure(Path(tmp), args)
    sys.stdout.write(write_document("vllm_push", [result], args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
