"""An idle daemon's CPU: with membership "none" (one daemon) and "embedded"
(two daemons probing each other over SWIM), over tcp;ofi_rxm and shm.

Each daemon is a real ``p2pxfer daemon`` process on loopback with one client
connected and one region exported (what a node waiting for work looks like);
after a settling pause, the CPU seconds of the measured daemon's process (all
its threads) over ``--seconds`` give its share of one core. Writes a scenario
document (``bench/summarize.py`` reads it).

    python bench/idle_daemon.py --json bench/results/idle-daemon.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from p2pxfer import connect
from p2pxfer.bench import write_document
from p2pxfer.bench._reference import process_cpu_seconds
from p2pxfer.testing import LOOPBACK, DaemonProc, free_port, start_daemon

TOKEN = "idle-bench-token"


async def _idle(d: DaemonProc, seconds: float, members: int) -> float:
    """Share of a core ``d`` uses over ``seconds`` while a client of it holds
    an exported region, once membership (if any) sees ``members`` alive."""
    async with connect(d.socket) as c:
        await c.export("idle", await c.alloc(1 << 20))
        with trio.fail_after(30):
            while members > 1:
                st = await c.status()
                if sum(1 for p in st.get("peers", []) if p.get("state") == "alive") >= members:
                    break
                await trio.sleep(0.2)
        await trio.sleep(2.0)  # start-up and join traffic over
        cpu0, t0 = process_cpu_seconds(d.proc.pid), time.monotonic()
        await trio.sleep(seconds)
        return (process_cpu_seconds(d.proc.pid) - cpu0) / (time.monotonic() - t0)


def measure(provider: str, membership: str, work: Path, seconds: float) -> dict[str, Any]:
    keys: dict[str, Any] = {"provider": provider, "log_level": "WARNING"}
    if membership == "embedded":
        keys |= {"membership": "embedded", "cluster_token": TOKEN}
    daemons: list[DaemonProc] = []
    try:
        b_port = free_port()
        daemons.append(start_daemon(work, "idle-b", control_port=b_port, **keys))
        members = 1
        if membership == "embedded":
            daemons.append(start_daemon(work, "idle-a", control_port=free_port(),
                                        seeds=[f"{LOOPBACK}:{b_port}"], **keys))
            members = 2
        busy = trio.run(_idle, daemons[0], seconds, members)
    finally:
        for d in daemons:
            d.stop()
    label = "none" if membership == "none" else f"embedded, {members} members"
    return {"provider": provider, "pattern": f"idle daemon (membership {label})",
            "seconds": seconds, "cpu_fraction_of_core": busy}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--providers", default="tcp;ofi_rxm,shm")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="p2pxfer-idle-") as tmp:
        for provider in args.providers.split(","):
            for membership in ("none", "embedded"):
                results.append(measure(provider, membership, Path(tmp) / provider.replace(
                    ";", "_") / membership, args.seconds))
    write_document("idle-daemon", results, args.json)
    for r in results:
        print(f"{r['provider']:12} {r['pattern']:40} {100 * r['cpu_fraction_of_core']:.2f}% "
              "of a core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
