"""Membership benchmark: the sans-IO SWIM protocol at 8..256 simulated members.

Every member is a real ``p2pxfer.membership.Swim`` (real encoding, real HMAC);
the network and the clock are simulated (``p2pxfer.membership.sim``):
datagrams take 1-20 ms and are dropped with the given probability. Times are
in protocol periods (and in seconds at the default period of
``SwimConfig().period``) of *simulated* time. Per cluster size and drop rate:

- ``bootstrap``: n members join through one seed within 2 periods; until
  every member sees every other alive;
- ``join``: one more member joins the formed cluster; until all see it alive;
- ``leave``: one member leaves gracefully; until all see it left;
- ``kill``: five members stop dead, one after the other; until the first
  suspicion and until all see it dead, median and worst (with the suspicion
  timeout for reference);
- ``steady``: once all gossip has been passed on (``gossip_drained_after``),
  datagrams and bytes each member sends per period over 20 periods, and this
  process's CPU per datagram delivered (decode, MAC, protocol, encode: what a
  daemon pays).

    python bench/membership.py --json bench/results/membership.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import fields, replace
from typing import Any

from p2pxfer.bench import write_document
from p2pxfer.membership import MemberState, SwimConfig
from p2pxfer.membership.sim import SimCluster

DEFAULT_PERIOD = SwimConfig().period
KILLS = 5
# The default configuration with every duration counted in periods.
SIM = replace(SwimConfig(), **{
    f.name: getattr(SwimConfig(), f.name) / DEFAULT_PERIOD for f in fields(SwimConfig)
    if f.name in ("period", "ack_timeout", "tombstone", "reconnect_interval", "join_retry",
                  "sync_interval", "sync_quiet")})


def scenario(n: int, drop: float, seed: int) -> dict[str, Any]:
    c = SimCluster(SIM, seed=seed, drop=drop, delay=(0.001, 0.02))
    out: dict[str, Any] = {"members": n, "drop": drop, "seed": seed}

    def periods(value: float | None) -> dict[str, float | None]:
        if value is None:
            return {"periods": None, "seconds": None}
        return {"periods": round(value, 2), "seconds": round(value * DEFAULT_PERIOD, 3)}

    c.bootstrap(n, stagger=2.0)
    out["bootstrap"] = periods(c.run_until(c.converged, 120, check_every=0.5))

    late = c.start("late", "10.9.0.1:7946", [c.address_of(n // 2)])
    out["join"] = periods(c.run_until(
        lambda: c.all_see("late", [MemberState.ALIVE], late.me.incarnation), 60))
    c.run_until(c.converged, 60, check_every=0.5)

    # Steady state: once the join news has been passed on its last time.
    drained = c.run_until(lambda: not any(node._queue for node in c.nodes.values()), 200,
                          check_every=5.0)
    before = {k: v.statistics() for k, v in c.nodes.items()}
    delivered0, cpu0 = c.net.delivered, time.process_time()
    c.run_for(20)
    cpu = time.process_time() - cpu0
    sent = sum(v.statistics().sent - before[k].sent for k, v in c.nodes.items())
    nbytes = sum(v.statistics().bytes_sent - before[k].bytes_sent for k, v in c.nodes.items())
    syncs = sum(v.statistics().syncs - before[k].syncs for k, v in c.nodes.items())
    out["gossip_drained_after"] = periods(drained)
    out["steady"] = {"datagrams_per_member_per_period": round(sent / len(c.nodes) / 20, 3),
                     "bytes_per_member_per_period": round(nbytes / len(c.nodes) / 20, 1),
                     "syncs": syncs,
                     # decode + MAC + protocol + encode, per datagram: what a daemon pays
                     "cpu_us_per_datagram": round(cpu / max(c.net.delivered - delivered0, 1)
                                                  * 1e6, 1)}

    victim = "m001"
    c.leave(victim, linger=0.0)
    out["leave"] = periods(c.run_until(lambda: c.all_see(victim, [MemberState.LEFT]), 60))

    # Kills, one after the other (the cluster stays formed around the dead).
    timeout = c.nodes["m000"].suspicion_timeout()
    firsts, everyone = [], []
    for i in range(KILLS):
        victim = f"m{2 + i * (n // KILLS - 1) + i:03d}"
        c.kill(victim)
        first = c.run_until(lambda v=victim: any(
            (m := node.member(v)) is not None and m.state is not MemberState.ALIVE
            for node in c.nodes.values()), 60)
        rest = c.run_until(lambda v=victim: c.all_see(v, [MemberState.DEAD]), 120)
        if first is not None and rest is not None:
            firsts.append(first)
            everyone.append(first + rest)
    out["kill"] = {"kills": KILLS, "detected": len(everyone),
                   "first_suspicion_median": periods(statistics.median(firsts)),
                   "all_see_dead_median": periods(statistics.median(everyone)),
                   "all_see_dead_max": periods(max(everyone)),
                   "suspicion_timeout": periods(timeout)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--members", default="8,32,64,128,256")
    ap.add_argument("--drops", default="0,0.02")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write results here as JSON")
    args = ap.parse_args()
    results = []
    for n in (int(x) for x in args.members.split(",")):
        for drop in (float(x) for x in args.drops.split(",")):
            results.append(scenario(n, drop, args.seed))
    sys.stdout.write(write_document("membership", results, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
