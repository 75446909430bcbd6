"""Disaggregated prefill/decode on one machine: KV pages pushed layer by layer.

Two processes, each with an in-process p2pxfer engine:

- **decode** (this process) owns a paged KV pool (``--layers`` x ``--blocks``
  blocks of ``--block-kib`` KiB per layer and plane), exports it, and sends
  its ``KVPoolDescriptor`` to prefill (msgpack bytes over a pipe). For each of
  ``--requests`` requests it picks a request id and a random block table from
  its free blocks and sends them to prefill; then it awaits the request's
  layers one by one with ``wait_layers`` (decode could start on layer 0 right
  there), verifies every byte that landed, and frees the blocks.
- **prefill** (a spawned child) owns its own pool. For each request it takes
  random source blocks, fills them with data seeded by the request (standing in
  for the model's KV), and ``push_pages`` them into decode's blocks.

Printed per request and overall: bytes, time to first layer (from prefill's
first post to layer 0 landing on decode: both processes read the same
``CLOCK_MONOTONIC``, so this only works on one machine), total time, GB/s.

    python examples/prefill_decode.py                      # tcp on 127.0.0.1
    python examples/prefill_decode.py --provider shm --requests 16
    python examples/prefill_decode.py --layers 4 --blocks 64 --block-kib 4   # tiny

The defaults (32 layers x 1,024 blocks of 16 KiB: 512 MiB per pool, 32 MiB per
request) suit a small box; raise ``--blocks-per-request`` / ``--block-kib``
for longer contexts.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.kv import ORDERS, KVLayout, KVPool, KVPoolDescriptor, push_pages

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
PROVIDERS = {"tcp": "tcp;ofi_rxm", "shm": "shm"}


# -- shared by both sides -----------------------------------------------------------


def engine_config(provider: str) -> EngineConfig:
    name = PROVIDERS[provider]
    # tcp stays on loopback; shm needs no address.
    return EngineConfig(provider=name, node="127.0.0.1" if provider == "tcp" else None)


def kv_view(pool: KVPool) -> U8:
    """The pool as a ``[layer][plane][block][byte]`` array (a view)."""
    lay = pool.layout
    nl, nb, npl, bb = lay.num_layers, lay.num_blocks, lay.planes, lay.block_bytes
    flat = pool.array[: nl * nb * npl * bb]
    if lay.order == "layer_major":
        return flat.reshape(nl, npl, nb, bb)
    if lay.order == "block_major":
        return flat.reshape(nb, nl, npl, bb).transpose(1, 2, 0, 3)
    return flat.reshape(npl, nl, nb, bb).transpose(1, 0, 2, 3)


def request_kv(seed: int, request_id: int, lay: KVLayout, n: int) -> U8:
    """The KV prefill "computes" for a request: ``[layer][plane][i][byte]`` for
    the request's ``i``-th block, a pure function of (seed, request id)."""
    size = lay.num_layers * lay.planes * n * lay.block_bytes
    data = np.frombuffer(np.random.default_rng([seed, request_id]).bytes(size), np.uint8)
    return data.reshape(lay.num_layers, lay.planes, n, lay.block_bytes)


def pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


async def receive(conn: Connection, timeout: float, what: str) -> Any:
    """One message from the peer without blocking trio; EOF means it died."""
    if not await trio.to_thread.run_sync(conn.poll, timeout):
        raise TimeoutError(f"no {what} from the peer within {timeout} s")
    try:
        data = conn.recv()
    except EOFError:
        raise ConnectionError(f"the peer went away before sending {what}") from None
    msg = msgpack.unpackb(data, raw=False)
    if isinstance(msg, dict) and msg.get("op") == "error":
        raise RuntimeError(f"the peer failed:\n{msg['traceback']}")
    return msg


# -- prefill ------------------------------------------------------------------------


def prefill_main(conn: Connection, args: dict[str, Any]) -> None:
    try:
        trio.run(prefill, conn, args)
    except BaseException:
        try:
            conn.send(pack({"op": "error", "traceback": traceback.format_exc()}))
        finally:
            raise SystemExit(1) from None


async def prefill(conn: Connection, args: dict[str, Any]) -> None:
    async with open_engine(engine_config(args["provider"])) as engine:
        msg = await receive(conn, args["timeout"], "pool descriptor")
        dst = KVPoolDescriptor.from_wire(msg["pool"])
        d = dst.layout
        lay = KVLayout(d.num_layers, args["prefill_blocks"], d.block_bytes, d.planes,
                       args["prefill_order"])
        pool = KVPool(engine, "prefill-kv", lay)
        view = kv_view(pool)
        conn.send(pack({"op": "ready"}))
        while True:
            msg = await receive(conn, args["timeout"], "request")
            if msg["op"] == "stop":
                return
            rid = msg["id"]
            db = np.frombuffer(msg["blocks"], np.int64)
            n = len(db)
            # "Compute" the request's KV into blocks of our own pool.
            sb = np.random.default_rng([args["seed"], rid, 1]).choice(
                lay.num_blocks, n, replace=False).astype(np.int64)
            kv = request_kv(args["seed"], rid, lay, n)
            for layer in range(lay.num_layers):
                view[layer][:, sb] = kv[layer]
            t_start = time.monotonic()
            with trio.fail_after(args["timeout"]):
                res = await push_pages(engine, pool, dst, sb, db, request_id=rid)
            conn.send(pack({"op": "pushed", "id": rid, "t_start": t_start,
                            "seconds": res.seconds, "first": res.first_layer_seconds,
                            "pieces": sum(res.pieces), "nbytes": res.nbytes}))


# -- decode -------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: int
    blocks: int
    nbytes: int
    pieces: int
    ttfl: float  # prefill's first post -> layer 0 landed here
    total: float  # prefill's first post -> last layer landed here
    sender_seconds: float
    verified: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total / 1e9


async def decode(conn: Connection, args: argparse.Namespace) -> list[Outcome]:
    lay = KVLayout(args.layers, args.blocks, args.block_kib << 10, args.planes, args.order)
    rng = np.random.default_rng([args.seed, 2])
    outcomes: list[Outcome] = []
    async with open_engine(engine_config(args.provider)) as engine:
        pool = KVPool(engine, "decode-kv", lay)
        view = kv_view(pool)
        conn.send(pack({"op": "pool", "pool": pool.describe().to_wire()}))
        await receive(conn, args.timeout, "ready")
        free = np.ones(lay.num_blocks, bool)
        ever_used = np.zeros(lay.num_blocks, bool)
        request_ids = rng.choice(1 << 20, args.requests, replace=False)
        for rid in map(int, request_ids):
            n = args.blocks_per_request
            db = rng.choice(np.flatnonzero(free), n, replace=False).astype(np.int64)
            free[db] = False
            ever_used[db] = True
            conn.send(pack({"op": "req", "id": rid, "blocks": db.tobytes()}))
            landed: list[float] = []
            with trio.fail_after(args.timeout):
                for layer in range(lay.num_layers):
                    # Decode could run layer `layer` right here.
                    await pool.wait_layers(rid, layer)
                    landed.append(time.monotonic())
            msg = await receive(conn, args.timeout, "push report")
            assert msg["op"] == "pushed" and msg["id"] == rid, msg
            want = request_kv(args.seed, rid, lay, n)
            ok = all(np.array_equal(view[layer][:, db], want[layer])
                     for layer in range(lay.num_layers))
            outcomes.append(Outcome(rid, n, msg["nbytes"], msg["pieces"],
                                    landed[0] - msg["t_start"], landed[-1] - msg["t_start"],
                                    msg["seconds"], ok))
            o = outcomes[-1]
            print(f"request {rid:>7}: {n} blocks, {o.nbytes / 2**20:8.1f} MiB in "
                  f"{o.pieces:>6} pieces, TTFL {o.ttfl * 1e3:7.2f} ms, total "
                  f"{o.total * 1e3:8.2f} ms, {o.gbps:6.2f} GB/s, "
                  f"{'verified' if ok else 'MISMATCH'}", flush=True)
            pool.forget(rid)
            free[db] = True
        # Blocks no request ever used must still be zero.
        untouched = np.flatnonzero(~ever_used)
        if untouched.size and view[:, :, untouched].any():
            print(f"blocks outside every request were written: "
                  f"{untouched[view[:, :, untouched].any(axis=(0, 1, 3))][:8].tolist()}")
            outcomes.append(Outcome(-1, 0, 0, 0, 0, 1, 0, False))
        conn.send(pack({"op": "stop"}))
    return outcomes


def summarize(outcomes: list[Outcome], args: argparse.Namespace) -> bool:
    real = [o for o in outcomes if o.request_id >= 0]
    ok = all(o.verified for o in outcomes)

    def line(label: str, group: list[Outcome]) -> None:
        nbytes = sum(o.nbytes for o in group)
        ttfl = [o.ttfl for o in group]
        print(f"{label}: {len(group)} requests, {nbytes / 2**20:.1f} MiB over {args.provider}, "
              f"{nbytes / sum(o.total for o in group) / 1e9:.2f} GB/s (bytes / time pushing), "
              f"TTFL median {statistics.median(ttfl) * 1e3:.2f} ms, max {max(ttfl) * 1e3:.2f} ms, "
              f"total per request median {statistics.median(o.total for o in group) * 1e3:.2f} ms")

    line("overall", real)
    if len(real) > 1:
        # The first request also pays for connection set-up and first-touch page faults.
        line("overall after the first request", real[1:])
    print(f"all {len(real)} requests verified" if ok else "VERIFICATION FAILED")
    return ok


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", choices=sorted(PROVIDERS), default="tcp")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1024, help="blocks in decode's pool")
    p.add_argument("--prefill-blocks", type=int, default=None,
                   help="blocks in prefill's pool (default: --blocks)")
    p.add_argument("--block-kib", type=int, default=16, help="KiB per block, layer and plane")
    p.add_argument("--planes", type=int, choices=(1, 2), default=1, help="2: K and V apart")
    p.add_argument("--order", choices=ORDERS, default="layer_major", help="decode's layout")
    p.add_argument("--prefill-order", choices=ORDERS, default="layer_major")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--blocks-per-request", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="bound of every wait (s)")
    args = p.parse_args(argv)
    args.prefill_blocks = args.prefill_blocks or args.blocks
    if args.blocks_per_request > min(args.blocks, args.prefill_blocks):
        p.error("--blocks-per-request exceeds a pool's blocks")
    if args.requests < 1 or args.blocks_per_request < 1:
        p.error("--requests and --blocks-per-request must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    lay_mib = args.layers * args.blocks * args.planes * (args.block_kib << 10) / 2**20
    print(f"decode pool: {args.layers} layers x {args.blocks} blocks x {args.planes} "
          f"plane(s) x {args.block_kib} KiB = {lay_mib:.0f} MiB ({args.order}); "
          f"{args.requests} requests of {args.blocks_per_request} blocks over {args.provider}",
          flush=True)
    ctx = mp.get_context("spawn")  # never fork: libfabric state must not be inherited
    here, there = ctx.Pipe()
    child = ctx.Process(target=prefill_main, name="prefill", args=(there, {
        "provider": args.provider, "prefill_blocks": args.prefill_blocks,
        "prefill_order": args.prefill_order, "seed": args.seed, "timeout": args.timeout}))
    child.start()
    there.close()  # so a dead prefill reads as EOF here
    try:
        outcomes = trio.run(decode, here, args)
        child.join(args.timeout)
        ok = summarize(outcomes, args)
    except Exception as exc:
        print(f"decode failed: {exc!r}", file=sys.stderr)
        traceback.print_exc()
        ok = False
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
    if child.exitcode != 0:
        print(f"prefill exited with {child.exitcode}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
