"""Soak: writes in a loop between two daemons while one rail flaps.

Two hosts in network namespaces (``tests/netns.py``'s ``two_hosts``: two veth
pairs, one "NIC" per rail), a daemon in each striping over both rails, each
the other's static peer, writes with a deadline of ``--deadline`` seconds
(the daemons' ``write_timeout_s``). A client writes random scatter lists
(32-192 pieces of 4-64 KiB into a 16 MiB region) in a loop for
``--seconds``, the whole target region compared after every write; from the
third write on, the target's ``--rail`` goes down ``--down`` seconds and up
``--up`` seconds, over and over (``p2pxfer.soak.soak``, shared with the
``soak`` test in ``tests/daemon/test_hostile_netns.py``).

Counts: writes ok, failed (by named error), hung (not ended within the
deadline + 10 s), late (bytes of a failed write landing after its failure
was reported), corrupt (bytes nobody wrote), incomplete (an ok write whose
pieces did not all arrive); the landed throughput of the ok writes; each
daemon's open fds and RSS after the warm-up and at the end (link up, clients
still connected). Without failover in the engine, a write caught by a cut
fails with a named deadline error (reported, not a hang); with it, it should
succeed on the other rail.

Needs root and ``ip netns``; elsewhere it writes one ``skipped`` result and
exits 0. Not part of ``bench/run_all`` (it takes minutes, mostly waiting).

    python bench/soak.py --json bench/results/soak.json
    python bench/soak.py --seconds 60 --down 5 --up 5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from p2pxfer.bench import write_document
from p2pxfer.soak import soak

# Namespaces: the multi-host tests' helper (tests/netns.py, no tests in it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import set_link, two_hosts


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="p2psoak") as tmp, \
            two_hosts(rails=2) as (a, b):
        dev = b.interfaces[args.rail]
        result = soak(Path(tmp), a, b, lambda up: set_link(b, dev, up), seconds=args.seconds,
                      down_s=args.down, up_s=args.up, deadline_s=args.deadline,
                      seed=args.seed, delivery_complete=args.delivery_complete)
    return {"pattern": "soak", "flapping_rail": args.rail, **result}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0, help="how long to write")
    ap.add_argument("--down", type=float, default=10.0, help="seconds the rail is down")
    ap.add_argument("--up", type=float, default=10.0, help="seconds the rail is up")
    ap.add_argument("--rail", type=int, choices=(0, 1), default=1,
                    help="which rail flaps (0 also carries the control connections)")
    ap.add_argument("--deadline", type=float, default=5.0,
                    help="the daemons' write_timeout_s")
    ap.add_argument("--delivery-complete", action="store_true",
                    help="the daemons' delivery_complete: a write is done once delivered")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write results here as JSON")
    args = ap.parse_args()
    if args.seconds <= 0 or args.down <= 0 or args.up <= 0 or args.deadline <= 0:
        ap.error("--seconds, --down, --up and --deadline must be > 0")
    try:
        results = [run(args)]
    except pytest.skip.Exception as exc:  # no namespaces here (netns.two_hosts skips)
        results = [{"pattern": "skipped", "skipped": str(exc.msg)}]
    sys.stdout.write(write_document("soak", results, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
