"""Daemon path: client -> daemon -> peer daemon, against the C reference.

Starts two daemons on loopback (``b``, and ``a`` with ``b`` as its peer), has a
client of ``b`` export a region, then runs ``p2pxfer bench --via-daemon``
through ``a`` (4096 random 64 KiB pages; the reference is the C initiator
writing the same pages into the same region, ``reference = "c-initiator"``)
and the control round trip of a no-op request. Writes one JSON list of bench
records and one scenario document.

    python bench/daemon.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from p2pxfer import connect
from p2pxfer.bench import BenchOptions, run_bench, run_scenario, write_document, write_json
from p2pxfer.testing import free_port, start_daemon

PAGE, PAGES = 64 << 10, 4096


async def via_daemon(b_socket: str, opts: BenchOptions) -> list[Any]:
    """``p2pxfer bench --via-daemon`` while a client of b holds the region."""
    async with connect(b_socket) as cb:
        await cb.export(opts.region, await cb.alloc(opts.region_bytes()))
        report = await trio.to_thread.run_sync(run_bench, opts)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    return list(report.results)


def measure(provider: str, work: Path, args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    b = start_daemon(work, "b", provider=provider, control_port=free_port(),
                     log_level="WARNING")
    try:
        a = start_daemon(work, "a", provider=provider, control_port=free_port(),
                         peers=[{"name": "b", "address": b.control}], log_level="WARNING")
        try:
            opts = BenchOptions(mode="via-daemon", socket=a.socket, peer="b", region="bench",
                                pattern="paged", page_size=PAGE, pages=args.pages,
                                iterations=args.iterations, memcpy_size=64 << 20)
            records = trio.run(via_daemon, b.socket, opts)
            return records, run_scenario("control-rtt", socket=a.socket, n=args.rtt_count)
        finally:
            a.stop()
    finally:
        b.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--providers", default="tcp;ofi_rxm,shm")
    ap.add_argument("--pages", type=int, default=PAGES)
    ap.add_argument("--iterations", type=int, help="timed rounds [enough for ~256 MiB]")
    ap.add_argument("--rtt-count", type=int, default=500)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON files")
    args = ap.parse_args()
    records, rtts = [], []
    for provider in args.providers.split(","):
        with tempfile.TemporaryDirectory(prefix="p2pbd") as tmp:
            r, t = measure(provider, Path(tmp), args)
            records += r
            rtts += t
    out = Path(args.out)
    write_json(records, out / "daemon.json")
    write_document("daemon", rtts, out / "daemon-rtt.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
