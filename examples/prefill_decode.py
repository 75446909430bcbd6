"""Disaggregated prefill/decode through the node daemons, on asyncio: KV pages
pushed layer by layer, the way a serving engine's KV connector would do it.

Two nodes, each with its ``p2pxfer daemon`` (started here, on this machine,
unless ``--prefill-socket`` / ``--decode-socket`` name running ones), and one
client process per node, both on **asyncio** (as vLLM and SGLang run):

- **decode** (this process) puts a paged KV pool in memory shared with its
  daemon (``Client.kv_pool``: ``--layers`` x ``--blocks`` blocks of
  ``--block-kib`` KiB per layer and plane), exported under its name. For each
  of ``--requests`` requests it picks a request id and a block table from its
  free blocks and hands them to prefill (a pipe here; your scheduler's
  messages in a server), then iterates the request's layers as they land
  (``async for layer in pool.layers(request)``: this is where decode would
  run layer ``layer``), checks every byte, and frees the blocks.
- **prefill** (a spawned process) has a source pool (``receive=False``). For
  each request it fills random blocks of it with data seeded by the request
  (standing in for the model's KV) and ``kv_push``-es them into decode's
  blocks: the daemons expand the block tables, post one transfer per layer in
  order, and count each layer's pieces on the decode node.

Printed per request and overall: bytes, time to first layer (prefill's
``kv_push`` call -> layer 0 seen by decode; both processes read the same
``CLOCK_MONOTONIC``, so only on one machine), total time, GB/s.

    .venv/bin/python examples/prefill_decode.py                      # tcp on 127.0.0.1
    .venv/bin/python examples/prefill_decode.py --provider shm --requests 16
    .venv/bin/python examples/prefill_decode.py --imm-bytes 4        # as on EFA / verbs
    .venv/bin/python examples/prefill_decode.py --layers 4 --blocks 64 --block-kib 4   # tiny

**Mapping it onto a serving engine's KV connector** (vLLM's
``KVConnectorBase_V1``, SGLang's disaggregation sender/receiver; names vary):

- *registering the KV cache*: each worker connects to its node's daemon
  (``p2pxfer.connect``) and makes its pool with ``kv_pool(name, KVLayout(...))``
  describing the cache's paging (layers, blocks, block bytes, K/V planes and
  their order), then serves attention out of ``pool.array`` (host memory
  shared with the daemon; GPU memory needs FI_HMEM registration, which this
  build does not do yet, so stage through it). The decode pool's name and
  node are what prefill needs, e.g. in the request's transfer parameters.
- *decode scheduler allocates blocks for a remote prefill*: it picks the
  request id and block table (as ``decode`` below) and sends them to prefill.
- *prefill saves KV* (per layer as computed, or once at the end):
  ``push = await client.kv_push(decode_node, pool_name, src_pool,
  src_blocks, dst_blocks, request=request_id, layers=...)``; pushing layer
  subsets as they are computed works (each layer once per request); ``await
  push.wait()`` before reusing the source blocks (cancelling it stops the
  push and returns once the daemon no longer reads them).
- *decode waits for a layer before its attention*: ``await
  pool.wait_layers(request_id, layer)`` (or iterate ``pool.layers(...)``);
  ``PeerLost`` if the prefill node dies, ``WaitTimeout`` past the push's
  deadline; ``await pool.forget(request_id)`` when the request is done.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

try:
    import numpy as np
    import numpy.typing as npt

    import p2pxfer
    from p2pxfer.client import KVPool
    from p2pxfer.kv import ORDERS, KVLayout
    from p2pxfer.testing import DaemonProc, free_port, start_daemon
except ModuleNotFoundError as exc:  # run with a python that lacks the project
    raise SystemExit(f"{exc}: run the examples with the project's virtualenv, from the "
                     f"repository root: .venv/bin/python examples/prefill_decode.py "
                     f"(bash deploy/setup.sh makes it)") from None

U8 = npt.NDArray[np.uint8]
PROVIDERS = {"tcp": "tcp;ofi_rxm", "shm": "shm"}


# -- shared by both sides -----------------------------------------------------------


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


async def receive(conn: Connection, timeout: float, what: str) -> Any:
    """One message from the other process without blocking the event loop."""
    ready = await asyncio.to_thread(conn.poll, timeout)
    if not ready:
        raise TimeoutError(f"no {what} from the other side within {timeout} s")
    try:
        msg = conn.recv()
    except EOFError:
        raise ConnectionError(f"the other side went away before sending {what}") from None
    if isinstance(msg, dict) and msg.get("op") == "error":
        raise RuntimeError(f"the other side failed:\n{msg['traceback']}")
    return msg


# -- prefill ------------------------------------------------------------------------


def prefill_main(conn: Connection, args: dict[str, Any]) -> None:
    try:
        asyncio.run(prefill(conn, args))
    except BaseException:
        conn.send({"op": "error", "traceback": traceback.format_exc()})
        raise SystemExit(1) from None


async def prefill(conn: Connection, args: dict[str, Any]) -> None:
    async with p2pxfer.connect(args["socket"]) as client:
        msg = await receive(conn, args["timeout"], "decode's pool")
        d = KVLayout.from_wire(msg["layout"])
        lay = KVLayout(d.num_layers, args["prefill_blocks"], d.block_bytes, d.planes,
                       args["prefill_order"])
        pool = await client.kv_pool("prefill-kv", lay, receive=False)
        view = kv_view(pool)
        conn.send({"op": "ready"})
        while True:
            msg = await receive(conn, args["timeout"], "request")
            if msg["op"] == "stop":
                return
            rid, db = msg["id"], np.frombuffer(msg["blocks"], np.int64)
            n = len(db)
            # "Compute" the request's KV into blocks of our own pool.
            sb = np.random.default_rng([args["seed"], rid, 1]).choice(
                lay.num_blocks, n, replace=False).astype(np.int64)
            view[:, :, sb] = request_kv(args["seed"], rid, lay, n)
            t_start = time.monotonic()
            push = await client.kv_push(msg["node"], msg["pool"], pool, sb, db, request=rid,
                                        deadline=args["timeout"])
            res = await push.wait(timeout=args["timeout"])
            conn.send({"op": "pushed", "id": rid, "t_start": t_start, "seconds": res.seconds,
                       "first": res.first_layer_seconds, "pieces": sum(res.pieces),
                       "nbytes": res.nbytes})


# -- decode -------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: int
    blocks: int
    nbytes: int
    pieces: int
    ttfl: float  # prefill's kv_push call -> layer 0 seen here
    total: float  # prefill's kv_push call -> last layer seen here
    sender_seconds: float
    verified: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total / 1e9


async def decode(conn: Connection, args: argparse.Namespace) -> list[Outcome]:
    lay = KVLayout(args.layers, args.blocks, args.block_kib << 10, args.planes, args.order)
    rng = np.random.default_rng([args.seed, 2])
    outcomes: list[Outcome] = []
    async with p2pxfer.connect(args.decode_socket) as client:
        pool = await client.kv_pool("decode-kv", lay)
        view = kv_view(pool)
        conn.send({"op": "pool", "layout": lay.to_wire()})
        await receive(conn, args.timeout, "ready")
        free = np.ones(lay.num_blocks, bool)
        ever_used = np.zeros(lay.num_blocks, bool)
        for rid in map(int, rng.choice(1 << 40, args.requests, replace=False)):
            n = args.blocks_per_request
            db = rng.choice(np.flatnonzero(free), n, replace=False).astype(np.int64)
            free[db] = False
            ever_used[db] = True
            conn.send({"op": "req", "id": rid, "blocks": db.tobytes(), "node": client.node,
                       "pool": pool.name})
            landed: list[float] = []
            async for _layer in pool.layers(rid, timeout=args.timeout):
                # Decode would run this layer's attention right here.
                landed.append(time.monotonic())
            msg = await receive(conn, args.timeout, "push report")
            assert msg["op"] == "pushed" and msg["id"] == rid, msg
            want = request_kv(args.seed, rid, lay, n)
            ok = len(landed) == lay.num_layers and bool(np.array_equal(view[:, :, db], want))
            outcomes.append(Outcome(rid, n, msg["nbytes"], msg["pieces"],
                                    landed[0] - msg["t_start"], landed[-1] - msg["t_start"],
                                    msg["seconds"], ok))
            o = outcomes[-1]
            print(f"request {rid:>13}: {n} blocks, {o.nbytes / 2**20:8.1f} MiB in "
                  f"{o.pieces:>6} pieces, TTFL {o.ttfl * 1e3:7.2f} ms, total "
                  f"{o.total * 1e3:8.2f} ms, {o.gbps:6.2f} GB/s, "
                  f"{'verified' if ok else 'MISMATCH'}", flush=True)
            await pool.forget(rid)
            free[db] = True
        # Blocks no request ever used must still be zero.
        untouched = np.flatnonzero(~ever_used)
        if untouched.size and view[:, :, untouched].any():
            print("blocks outside every request were written")
            outcomes.append(Outcome(-1, 0, 0, 0, 0, 1, 0, False))
        conn.send({"op": "stop"})
    return outcomes


def summarize(outcomes: list[Outcome], args: argparse.Namespace) -> bool:
    real = [o for o in outcomes if o.request_id >= 0]
    ok = all(o.verified for o in outcomes)

    def line(label: str, group: list[Outcome]) -> None:
        nbytes = sum(o.nbytes for o in group)
        ttfl = [o.ttfl for o in group]
        print(f"{label}: {len(group)} requests, {nbytes / 2**20:.1f} MiB over {args.provider} "
              f"through the daemons, {nbytes / sum(o.total for o in group) / 1e9:.2f} GB/s, "
              f"TTFL median {statistics.median(ttfl) * 1e3:.2f} ms, max {max(ttfl) * 1e3:.2f} ms, "
              f"total per request median {statistics.median(o.total for o in group) * 1e3:.2f} ms")

    line("overall", real)
    if len(real) > 1:
        # The first request also pays for the daemons' first connection and page faults.
        line("overall after the first request", real[1:])
    print(f"all {len(real)} requests verified" if ok else "VERIFICATION FAILED")
    return ok


@contextmanager
def daemons(args: argparse.Namespace) -> Iterator[None]:
    """Start a prefill and a decode daemon here unless sockets were given."""
    if args.prefill_socket and args.decode_socket:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="p2pxfer-example-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        ports = {"prefill": free_port(), "decode": free_port()}
        procs: list[DaemonProc] = []
        stack.callback(lambda: [d.stop() for d in procs])
        extra = {"imm_bytes": args.imm_bytes} if args.imm_bytes else {}
        for name, other in (("prefill", "decode"), ("decode", "prefill")):
            procs.append(start_daemon(
                work, name, provider=PROVIDERS[args.provider], control_port=ports[name],
                peers=[{"name": other, "address": f"127.0.0.1:{ports[other]}"}], **extra))
        args.prefill_socket, args.decode_socket = procs[0].socket, procs[1].socket
        yield


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--provider", choices=sorted(PROVIDERS), default="tcp")
    p.add_argument("--imm-bytes", type=int, choices=(0, 4), default=0,
                   help="4: 4-byte immediates, as EFA and verbs carry (daemons started here)")
    p.add_argument("--prefill-socket", help="a running prefill daemon's socket")
    p.add_argument("--decode-socket", help="a running decode daemon's socket")
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
    if bool(args.prefill_socket) != bool(args.decode_socket):
        p.error("give both --prefill-socket and --decode-socket, or neither")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    lay_mib = args.layers * args.blocks * args.planes * (args.block_kib << 10) / 2**20
    print(f"decode pool: {args.layers} layers x {args.blocks} blocks x {args.planes} "
          f"plane(s) x {args.block_kib} KiB = {lay_mib:.0f} MiB ({args.order}); "
          f"{args.requests} requests of {args.blocks_per_request} blocks over {args.provider}",
          flush=True)
    ok = False
    with daemons(args):
        ctx = mp.get_context("spawn")  # never fork: the client's sockets must not be shared
        here, there = ctx.Pipe()
        child = ctx.Process(target=prefill_main, name="prefill", args=(there, {
            "socket": args.prefill_socket, "prefill_blocks": args.prefill_blocks,
            "prefill_order": args.prefill_order, "seed": args.seed,
            "timeout": args.timeout}))
        child.start()
        there.close()  # so a dead prefill reads as EOF here
        try:
            outcomes = asyncio.run(decode(here, args))
            child.join(args.timeout)
            ok = summarize(outcomes, args)
        except Exception as exc:
            print(f"decode failed: {exc!r}", file=sys.stderr)
            traceback.print_exc()
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
