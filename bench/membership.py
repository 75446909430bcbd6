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
- ``kill``: one member stops dead; until the first suspicion, and until all
  see it dead (with the suspicion timeout for reference);
- ``steady``: datagrams and bytes each member sends per period, over 20 periods;
- ``cpu_us_per_datagram``: this process's CPU per datagram delivered (decode,
  MAC, protocol, encode): what a daemon pays.

    python bench/membership.py --json bench/results/membership.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import emit

from p2pxfer.membership import MemberState, SwimConfig
from p2pxfer.membership.sim import SimCluster

SIM = SwimConfig(period=1.0, ack_timeout=0.4)  # the default's ratios, in periods
DEFAULT_PERIOD = SwimConfig().period


def scenario(n: int, drop: float, seed: int) -> dict[str, Any]:
    c = SimCluster(SIM, seed=seed, drop=drop, delay=(0.001, 0.02))
    cpu0 = time.process_time()
    delivered0 = c.net.delivered
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

    before = {k: v.statistics() for k, v in c.nodes.items()}
    c.run_for(20)
    sent = sum(v.statistics().sent - before[k].sent for k, v in c.nodes.items())
    nbytes = sum(v.statistics().bytes_sent - before[k].bytes_sent for k, v in c.nodes.items())
    syncs = sum(v.statistics().syncs - before[k].syncs for k, v in c.nodes.items())
    out["steady"] = {"datagrams_per_member_per_period": round(sent / len(c.nodes) / 20, 3),
                     "bytes_per_member_per_period": round(nbytes / len(c.nodes) / 20, 1),
                     "syncs": syncs}

    victim = "m001"
    c.leave(victim, linger=0.0)
    out["leave"] = periods(c.run_until(lambda: c.all_see(victim, [MemberState.LEFT]), 60))

    victim = "m002"
    timeout = c.nodes["m000"].suspicion_timeout()
    c.kill(victim)
    first = c.run_until(lambda: any(
        (m := node.member(victim)) is not None and m.state is not MemberState.ALIVE
        for node in c.nodes.values()), 60)
    rest = c.run_until(lambda: c.all_see(victim, [MemberState.DEAD]), 120)
    out["kill"] = {"first_suspicion": periods(first),
                   "all_see_dead": periods(None if first is None or rest is None
                                           else first + rest),
                   "suspicion_timeout": periods(timeout)}
    delivered = c.net.delivered - delivered0
    out["datagrams_delivered"] = delivered
    out["cpu_us_per_datagram"] = round((time.process_time() - cpu0) / max(delivered, 1) * 1e6,
                                       1)
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
    return emit("membership", results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
