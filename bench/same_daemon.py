"""Same-daemon writes: two clients of one daemon, the daemon's copy fast path
against this machine's memcpy of the same 64 MiB (measured in the same run).

Starts one daemon per setting (copy threads 1 and 2, and ``local_copy =
false``: the same write through the engine, for comparison) and runs the
``same-daemon`` scenario through each. Writes one scenario document.

    python bench/same_daemon.py --json bench/results/same-daemon.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from p2pxfer.bench import parse_size, run_scenario, write_document
from p2pxfer.testing import free_port, start_daemon

SETTINGS: tuple[dict[str, Any], ...] = (
    {"local_copy_threads": 1}, {"local_copy_threads": 2}, {"local_copy": False})


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--provider", default="tcp;ofi_rxm",
                    help="the daemon's provider (used only with local_copy = false)")
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--page-size", default="16KiB")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default="bench/results/same-daemon.json")
    args = ap.parse_args()
    records: list[Any] = []
    for i, keys in enumerate(SETTINGS):
        with tempfile.TemporaryDirectory(prefix="p2pbs") as tmp:
            d = start_daemon(Path(tmp), f"same{i}", provider=args.provider,
                             control_port=free_port(), log_level="WARNING", **keys)
            try:
                records += run_scenario("same-daemon", socket=d.socket,
                                        size=parse_size(args.size),
                                        page_size=parse_size(args.page_size),
                                        rounds=args.rounds)
            finally:
                d.stop()
    write_document("same-daemon", records, Path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
