"""KV pushes of GPU memory through two daemons: taken as is (``direct``,
``share_device``) against staged through pinned host memory, against the
host path (host pools) through the same daemons in the same run.

Two daemons (node-a: prefill, node-b: decode) with ``hmem = true`` on one
provider. Each round pushes ``--blocks`` scattered blocks of every layer
(K and V planes) three ways, in an order that rotates from round to round:

- ``host``: host pools on both sides (the baseline: the fabric's speed
  through these daemons, no device anywhere);
- ``staged``: device pools with ``direct=False`` (device -> pinned mirror
  copies in the client, the wire, mirror -> device copies in the decode's
  client, overlapped layer by layer);
- ``direct``: device pools taken as is, where the daemons can (their
  libfabric registers CUDA memory); where they cannot, the row says so.

Timed from the push to the decode's last layer on the device. Reported
(medians over rounds): seconds and GB/s of each, and each device mode over
``host``. Every round's bytes are checked on the decode's device.

    python bench/device_daemons.py --provider shm --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

import p2pxfer
from p2pxfer.kv_plan import KVLayout, expand_pages
from p2pxfer.testing import LOOPBACK, DriverArray, free_port, start_daemon

MODES = ("host", "staged", "direct")


def expected(src: Any, lay: KVLayout, sb: Any, db: Any) -> Any:
    out = np.zeros(lay.nbytes, np.uint8)
    so, do, ln, _ = expand_pages(lay, lay, sb, db, range(lay.num_layers))
    for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
        out[d:d + n] = src[s:s + n]
    return out


async def run(args: argparse.Namespace, sockets: tuple[str, str]) -> dict[str, Any]:
    lay = KVLayout(args.layers, args.pool_blocks, args.block_bytes, planes=2)
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    sb = np.sort(rng.choice(lay.num_blocks, args.blocks, replace=False)).astype(np.int64)
    db = rng.permutation(lay.num_blocks)[:args.blocks].astype(np.int64)
    want = expected(data, lay, sb, db)
    nbytes = args.blocks * 2 * lay.block_bytes * lay.num_layers
    src_dev, dst_dev = DriverArray(lay.nbytes), DriverArray(lay.nbytes)
    src_dev.write(data)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    paths: dict[str, str] = {}
    request = 0
    try:
        async with p2pxfer.connect(sockets[1]) as decode, \
                p2pxfer.connect(sockets[0]) as prefill:
            pools: dict[str, tuple[Any, Any]] = {}
            pools["host"] = (await prefill.kv_pool("h-src", lay, receive=False),
                             await decode.kv_pool("h-dst", lay))
            pools["host"][0].array[:] = data
            pools["staged"] = (
                await prefill.kv_pool("s-src", lay, receive=False, device=src_dev, direct=False),
                await decode.kv_pool("s-dst", lay, device=dst_dev, direct=False))
            d_src = await prefill.kv_pool("d-src", lay, receive=False, device=src_dev)
            d_dst = await decode.kv_pool("d-dst", lay, device=dst_dev)
            if d_src.direct and d_dst.direct:
                pools["direct"] = (d_src, d_dst)
            paths = {m: ("direct" if p[1].direct else p[1].kind if m == "host" else "staged")
                     for m, p in pools.items()}
            modes = list(pools)
            for rnd in range(args.rounds + 1):  # the first round warms up
                for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                    src, dst = pools[mode]
                    if mode != "host":
                        dst_dev.write(np.zeros(lay.nbytes, np.uint8))
                    request += 1
                    t0 = time.perf_counter()
                    push = await prefill.kv_push("node-b", dst.name, src, sb, db,
                                                 request=request)
                    await dst.wait_layers(request, lay.num_layers - 1, blocks=db, timeout=60)
                    took = time.perf_counter() - t0
                    await push.wait(timeout=60)
                    got = dst.array if mode == "host" else dst_dev.read()
                    if not np.array_equal(got, want):
                        raise SystemExit(f"{mode}: the bytes that landed differ")
                    if rnd:
                        times[mode].append(took)
    finally:
        src_dev.close()
        dst_dev.close()
    rows: dict[str, Any] = {}
    for mode, ts in times.items():
        if ts:
            med = statistics.median(ts)
            rows[mode] = {"seconds": med, "gbps": nbytes / med / 1e9, "path": paths[mode]}
    for mode in ("staged", "direct"):
        if mode in rows:
            rows[mode]["over_host"] = rows[mode]["gbps"] / rows["host"]["gbps"]
    if "direct" not in rows:
        rows["direct"] = {"path": "unavailable: the daemons' libfabric registers no CUDA "
                                  "memory on this provider (status device_memory)"}
    return {"provider": args.provider, "layers": lay.num_layers, "blocks": args.blocks,
            "block_bytes": lay.block_bytes, "nbytes_per_push": nbytes, "rounds": args.rounds,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pool-blocks", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    from p2pxfer.devmem import driver
    from p2pxfer.errors import DeviceError

    try:
        driver().use(0)
    except DeviceError as exc:
        raise SystemExit(f"device_daemons: needs a CUDA GPU: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="p2px-devd-") as work:
        port_a, port_b = free_port(), free_port()
        a = start_daemon(Path(work), "node-a", provider=args.provider, control_port=port_a,
                         hmem=True, peers=[{"name": "node-b",
                                            "address": f"{LOOPBACK}:{port_b}"}])
        try:
            b = start_daemon(Path(work), "node-b", provider=args.provider, control_port=port_b,
                             hmem=True, peers=[{"name": "node-a",
                                                "address": f"{LOOPBACK}:{port_a}"}])
            try:
                out = trio.run(run, args, (a.socket, b.socket))
            finally:
                b.stop()
        finally:
            a.stop()
    text = json.dumps(out, indent=2)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
