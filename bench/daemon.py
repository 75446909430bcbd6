"""Daemon-path benchmark: client -> daemon -> peer daemon, against the
in-process engine writing the same pages into the same region, in one run.

Two daemons run as separate processes on loopback. Client B exports a 1 GiB
region on daemon B; client A writes 4096 random 64 KiB pages into it through
daemon A; an in-process engine in this process writes the same pages straight
to the region's descriptor. Also reports the control round trip of a no-op
request (``peers``).

    python bench/daemon.py --json bench/results/daemon.json
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import trio

from _common import emit, parser

GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(tmp: str, name: str, port: int, provider: str,
                 peers: dict[str, int]) -> subprocess.Popen[bytes]:
    fabric_node = "127.0.0.1" if provider.startswith("tcp") else ""
    lines = [f'node = "{name}"', f'socket = "{tmp}/{name}.sock"',
             f'control = "127.0.0.1:{port}"', f'provider = "{provider}"',
             f'fabric_node = "{fabric_node}"', 'log_level = "WARNING"']
    for peer, pport in peers.items():
        lines += ["[[peers]]", f'name = "{peer}"', f'address = "127.0.0.1:{pport}"']
    path = f"{tmp}/{name}.toml"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "p2pxfer.cli", "daemon", "--config", path])
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{tmp}/{name}.sock"):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"daemon {name} did not start")
        time.sleep(0.05)
    return proc


async def measure(tmp: str, provider: str, repeat: int) -> list[dict[str, Any]]:
    from p2pxfer import ScatterList, connect
    from p2pxfer.engine import EngineConfig, open_engine
    from p2pxfer.loopback import loopback_node

    page, n = 64 << 10, 4096
    rng = np.random.default_rng(11)
    slots = GIB // page
    sl = ScatterList(rng.choice(slots, n, replace=False).astype(np.int64) * page,
                     rng.choice(slots, n, replace=False).astype(np.int64) * page,
                     np.full(n, page, np.int64))
    async with connect(f"{tmp}/b.sock") as cb, connect(f"{tmp}/a.sock") as ca, \
            open_engine(EngineConfig(provider=provider, node=loopback_node(provider))) as eng:
        dst = await cb.alloc(GIB)
        dst.array.fill(0)
        desc = await cb.export("bench", dst)
        src = await ca.alloc(GIB)
        src.array.fill(1)
        local = np.ones(GIB, np.uint8)
        eng.register(local)
        await ca.write("b", "bench", sl, src=src, imm=1)
        await eng.write(local, desc, sl, imm=1)
        d_s, e_s = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await ca.write("b", "bench", sl, src=src, imm=1)
            d_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await eng.write(local, desc, sl, imm=1)
            e_s.append(time.perf_counter() - t0)
        rtt = []
        for _ in range(500):
            t0 = time.perf_counter()
            await ca.peers()
            rtt.append(time.perf_counter() - t0)
        d, e = statistics.median(d_s), statistics.median(e_s)
        return [
            {"provider": provider, "pattern": "4096x64KiB-random via daemons",
             "pages": n, "bytes": sl.nbytes, "seconds": d, "baseline_seconds": e,
             "gbps": sl.nbytes / d / 1e9, "baseline_gbps": sl.nbytes / e / 1e9,
             "baseline": "in-process engine", "ratio": e / d},
            {"provider": provider, "pattern": "control round trip (peers)",
             "p50_us": statistics.median(rtt) * 1e6,
             "p99_us": float(np.percentile(rtt, 99) * 1e6)},
        ]


def main() -> int:
    ap = parser(__doc__, repeat=5)
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    for provider in args.providers.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            pa, pb = free_port(), free_port()
            procs = [start_daemon(tmp, "b", pb, provider, {}),
                     start_daemon(tmp, "a", pa, provider, {"b": pb})]
            try:
                results += trio.run(measure, tmp, provider, args.repeat)
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
    return emit("daemon", results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
