"""The vLLM connector's data path against the plain KV API, on the same pages.

Two daemons (a: prefill, b: decode) on loopback. A batch of ``--requests``
requests of ``--tokens`` tokens (``--block-size`` tokens per block, so 64
blocks each by default) over ``--layers`` layers of K and V, in per-layer
engine tensors (``(2, blocks, block_size, kv_heads, head)`` float16, as
vLLM allocates them on CPU), moved three ways, round after round, in turn:

- ``plain``: ``Client.kv_push`` of every request's blocks from a source
  pool to a decode pool (the same layout as the connector's staging pools),
  all requests at once, the decode taking each request's layers as they
  land (``KVPool.layers``), timed until every push has landed and been
  seen;
- ``staging``: the connector's worker half (``_worker.Worker``, what
  ``P2PXferConnector`` runs in vLLM's worker) with its default memory: the
  prefill copies each layer of each request into its staging pool
  (untimed here: vLLM does it during the forward; its CPU is reported) and
  holds the requests; the decode loads them (pull, push by the prefill's
  daemon, per-layer waits, copies into the decode's engine tensors), timed
  from ``load`` to the last request received;
- ``placed``: the connector's default (``kv_memory = "auto"``) on a CPU
  engine: each side's engine tensors are allocated as vLLM allocates them
  (one buffer, a view per layer) inside the worker's allocation context
  (vLLM's ``get_mem_pool_context``), so they are the daemon-shared pools
  (no copy on either side);
- ``...+checksum``: each with checksums on.

``--device cuda``: the engine tensors are on the GPU (staging only): the
prefill's staging is device -> pinned pool copies on the current stream,
waited for as vLLM's ``wait_for_save`` does, the decode's copies into the
engine tensors are pinned pool -> device (timed); the plain API's pools
stay in host memory, so the ratio is what GPU caches cost over host ones.

Each round runs every mode right after a plain run of its own, the modes
in an order that rotates from round to round: a mode's ratio is against
the plain runs beside it. (Run in a fixed order after one plain run, the
mode that came first looked best whichever it was: zero copy 1.06 of plain
right after it, 0.89 third, behind the checksum modes.)

Reported (medians over rounds): seconds and GB/s of each, CPU seconds
(this process and both daemons: on a busy host the fairer measure), each mode's
throughput relative to plain (its plain runs' seconds / its seconds: of the
medians, and paired, the median of each round's ratio, which a host whose
load changes between rounds skews less), the checksum's
cost (seconds with / without), and CPU milliseconds per request in vLLM's
thread: describe and post (``hold`` + ``load``), and staging
(``stage_layer`` over every layer and ``end_step``; 0 when placed), with
staging's wall time beside it (a device's copies are queued there, and
waited for by the pull server inside the timed window). The decode's
tensors are zeroed before the last round, whose bytes are then checked.

    python bench/vllm_connector.py --json bench/results/vllm_connector.json
    python bench/vllm_connector.py --device cuda --json vllm_connector-cuda.json
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

MODES = ("staging", "staging+checksum", "placed", "placed+checksum")


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_tensors(args: Any, blocks: int, seed: int | None) -> dict[str, Any]:
    """Per-layer float16 arrays as vLLM allocates its tensors, ``(2, blocks,
    block_size, kv_heads, head)``: random bits from ``seed``, else zeros."""
    shape = (2, blocks, args.block_size, args.kv_heads, args.head)
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(args.layers):
        a = np.zeros(shape, np.float16)
        if seed is not None:
            a.view(np.uint8).reshape(-1)[:] = np.frombuffer(rng.bytes(a.nbytes), np.uint8)
        out[f"model.layers.{i}.self_attn.attn"] = a
    return out


def engine_tensors(args: Any, blocks: int, seed: int | None) -> dict[str, Any]:
    """``host_tensors`` as torch tensors on ``args.device``."""
    import torch

    return {name: torch.from_numpy(a).to(args.device)
            for name, a in host_tensors(args, blocks, seed).items()}


def placed_tensors(args: Any, blocks: int, seed: int | None, context: Any) -> dict[str, Any]:
    """``host_tensors`` allocated as vLLM's worker allocates its KV cache
    (one int8 buffer, a view per layer), inside ``context``."""
    import torch

    host = host_tensors(args, blocks, seed)
    per = next(iter(host.values())).nbytes
    with context:
        buf = torch.zeros(per * len(host), dtype=torch.int8)
    out = {}
    for i, (name, a) in enumerate(host.items()):
        t = buf[i * per:(i + 1) * per].view(torch.float16).view(a.shape)
        t.copy_(torch.from_numpy(a))
        out[name] = t
    return out


def two_daemons(tmp: Path) -> tuple[Any, Any]:
    """Daemons "node-a" (prefill) and "node-b" (decode), peers on loopback."""
    from p2pxfer.testing import free_port, start_daemon

    pa, pb = free_port(), free_port()
    a = start_daemon(tmp, "node-a", control_port=pa,
                     peers=[{"name": "node-b", "address": f"127.0.0.1:{pb}"}])
    b = start_daemon(tmp, "node-b", control_port=pb,
                     peers=[{"name": "node-a", "address": f"127.0.0.1:{pa}"}])
    return a, b


def shape_args(ap: argparse.ArgumentParser) -> None:
    """The batch's shape: layers, tokens, block size, heads, requests, rounds."""
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)


def modes_of(args: Any) -> tuple[str, ...]:
    """The connector's modes that exist for ``args.device`` (GPU caches are
    staged only)."""
    return MODES if args.device == "cpu" else tuple(m for m in MODES if "placed" not in m)


async def measure(tmp: Path, args: Any) -> dict[str, Any]:
    from p2pxfer import connect
    from p2pxfer.integrations.vllm._plan import Load, Save, Send
    from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions

    per_req = -(-args.tokens // args.block_size)
    n_blocks = args.requests * per_req + 8
    a, b = two_daemons(tmp)
    rng = np.random.default_rng(1)
    src_tables = [np.arange(r * per_req, (r + 1) * per_req) for r in range(args.requests)]
    perm = rng.permutation(n_blocks)
    dst_tables = [perm[r * per_req:(r + 1) * per_req] for r in range(args.requests)]
    src = engine_tensors(args, n_blocks, 7)
    src_np = {k: v.cpu().numpy() for k, v in src.items()}
    modes = modes_of(args)

    def workers(mode: str) -> tuple[Worker, Worker]:
        common: dict[str, Any] = {"rank": 0, "block_size": args.block_size,
                                  "max_blocks": per_req + 1, "max_held": 4 * args.requests,
                                  "max_loads": 4 * args.requests,
                                  "checksum": "checksum" in mode,
                                  "memory": "auto" if "placed" in mode else "staging"}
        p = Worker(WorkerOptions(socket=a.socket, engine=f"P{mode}", send=True, receive=False,
                                 **common))
        d = Worker(WorkerOptions(socket=b.socket, engine=f"D{mode}", send=False, receive=True,
                                 **common))
        # Each pair its own engine tensors: placed ones are its pools.
        for w, seed in ((p, 7), (d, None)):
            ctx = w.allocation_context()
            w.register(engine_tensors(args, n_blocks, seed) if ctx is None else
                       placed_tensors(args, n_blocks, seed, ctx))
            assert w.memory == ("placed" if "placed" in mode else "staging"), w.memory
        return p, d

    # Blocking calls (vLLM's worker thread makes them), so not from this trio thread.
    pairs = {mode: await trio.to_thread.run_sync(workers, mode) for mode in modes}
    times: dict[str, list[float]] = {"plain": [], **{mode: [] for mode in modes}}
    cpu_s: dict[str, list[float]] = {"plain": [], **{mode: [] for mode in modes}}
    plain_before: dict[str, list[float]] = {mode: [] for mode in modes}  # its own plain runs
    post_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    stage_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    stage_wall_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    nbytes = 0
    try:
        async with connect(a.socket) as prefill, connect(b.socket) as decode:
            lay = pairs["staging"][0].layout
            assert lay is not None
            sp = await prefill.kv_pool("plain-src", lay, receive=False)
            dp = await decode.kv_pool("plain-dst", lay)
            for i, t in enumerate(src_np.values()):  # the staging layout: [layer][plane][block]
                sp.array[i * lay.layer_stride:(i + 1) * lay.layer_stride] = \
                    t.view(np.uint8).reshape(-1)

            async def landed(request: int) -> None:
                async for _ in dp.layers(request, timeout=60):
                    pass

            async def plain(run: int) -> float:
                """Push every request; the decode takes each layer as it
                lands (as a plain-API decode does)."""
                t0 = time.perf_counter()
                requests = [run * args.requests + i for i in range(args.requests)]
                async with trio.open_nursery() as nursery:
                    for r in requests:
                        nursery.start_soon(landed, r)
                    pushes = [await prefill.kv_push("node-b", "plain-dst", sp, s, d, request=r)
                              for r, s, d in zip(requests, src_tables, dst_tables, strict=True)]
                    results = [await p.wait() for p in pushes]
                for r in requests:  # as the connector's decode does before reporting
                    await dp.forget(r)
                took = time.perf_counter() - t0
                nonlocal nbytes
                nbytes = sum(r.nbytes for r in results)
                return took

            def connector(mode: str, round_: int) -> float:
                p, d = pairs[mode]
                ids = [f"r{round_}-{i}" for i in range(args.requests)]
                saves = [Save(rid, tuple(int(x) for x in s))
                         for rid, s in zip(ids, src_tables, strict=True)]
                c0, w0 = time.thread_time(), time.perf_counter()
                for name in src:
                    p.stage_layer(name, saves)
                p.end_step(saves)  # vLLM's wait_for_save (a device's copies queued)
                stage_ms[mode].append((time.thread_time() - c0) * 1000 / args.requests)
                stage_wall_ms[mode].append((time.perf_counter() - w0) * 1000 / args.requests)
                base = (round_ % 3) * args.requests + 1  # keys: free again by then
                c0 = time.thread_time()
                p.hold([Send(rid, base + i, s.blocks) for i, (rid, s) in
                        enumerate(zip(ids, saves, strict=True))])
                t0 = time.perf_counter()
                d.load([Load(f"d-{rid}", "node-a", f"P{mode}", base + i, rid, 0,
                             tuple(int(x) for x in dt))
                        for i, (rid, dt) in enumerate(zip(ids, dst_tables, strict=True))])
                post_ms[mode].append((time.thread_time() - c0) * 1000 / args.requests)
                want_d, want_p = {f"d-{r}" for r in ids}, set(ids)
                while want_d or want_p:
                    sent, received = p.finished()
                    _, got = d.finished()
                    want_p -= sent
                    want_d -= received
                    want_d -= got
                    time.sleep(0.001)  # vLLM asks once a step; finer, to time the transfer
                took = time.perf_counter() - t0
                if d.load_errors():
                    raise RuntimeError(f"{mode}: load errors in round {round_}")
                return took

            def cpu() -> float:  # this process and both daemons
                return cpu_of(os.getpid()) + cpu_of(a.proc.pid) + cpu_of(b.proc.pid)

            for r in range(args.rounds + 1):  # round 0 warms up
                if r == args.rounds:  # what the check below finds is this round's
                    for _, d in pairs.values():
                        for lt in d.layers:
                            lt.owner.zero_()
                    if args.device == "cuda":
                        import torch

                        torch.cuda.synchronize()
                turn = r % len(modes)
                for i, mode in enumerate(modes[turn:] + modes[:turn]):
                    c0 = cpu()
                    took = await plain(r * len(modes) + i)
                    used = cpu() - c0
                    c0 = cpu()
                    got = await trio.to_thread.run_sync(connector, mode, r)
                    if r:
                        times["plain"].append(took)
                        cpu_s["plain"].append(used)
                        plain_before[mode].append(took)
                        times[mode].append(got)
                        cpu_s[mode].append(cpu() - c0)
            # Every decode's engine tensors hold what the prefill's held.
            for mode in modes:
                d = pairs[mode][1]
                for name, t in src_np.items():
                    got_t = d.layers[d.index[name]].owner.cpu().numpy()
                    for s, dt in zip(src_tables, dst_tables, strict=True):
                        assert (got_t[:, dt].view(np.uint16) == t[:, s].view(np.uint16)).all()
    finally:
        for p, d in pairs.values():
            await trio.to_thread.run_sync(d.close)
            await trio.to_thread.run_sync(p.close)
        a.stop()
        b.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "provider": "tcp;ofi_rxm",  # the daemons' (two_daemons)
        "pattern": f"{args.requests} requests x {args.layers} layers x {per_req} blocks "
                   f"(K+V, {lay.block_bytes >> 10} KiB per block per plane)",
        "engine_tensors": args.device, "plain_api_pools": "cpu",
        "bytes_per_round": nbytes, "rounds": args.rounds,
        "seconds": med, "gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
        "cpu_seconds_per_round": {k: statistics.median(v) for k, v in cpu_s.items()},
        "ratio_vs_plain": {mode: statistics.median(plain_before[mode]) / med[mode]
                           for mode in modes},
        # Each run of the mode against the plain run right before it (same
        # load on a shared host), the median over rounds.
        "ratio_vs_plain_paired": {mode: statistics.median(
            p / m for p, m in zip(plain_before[mode], times[mode], strict=True))
            for mode in modes},
        "checksum_cost_ratio": {m: med[f"{m}+checksum"] / med[m]
                                for m in ("staging", "placed") if m in modes},
        "cpu_ms_per_request": {mode: {"describe_and_post": statistics.median(post_ms[mode]),
                                      "stage_all_layers": statistics.median(stage_ms[mode])}
                               for mode in modes},
        "stage_wall_ms_per_request": {mode: statistics.median(stage_wall_ms[mode])
                                      for mode in modes},
        "all_seconds": times,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shape_args(ap)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the engine tensors are (cuda: staging modes only; the "
                         "plain API's pools stay in host memory)")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pxfer-vllm-bench-") as tmp:
        result = trio.run(measure, Path(tmp), args)
    sys.stdout.write(write_document("vllm_connector", [result], args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
