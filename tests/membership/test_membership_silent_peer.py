"""Membership ends a write to a silent peer (issue 16): daemons with embedded
membership in namespaces on one switch; h0 writes to h1 in a loop, h1's link
goes down (no reset); the write in flight fails with ``PeerLost`` promptly,
and h0's writes to h2 go on. Needs root (namespaces); skipped otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_membership_daemon import PEER_LOST_WITHIN, lan_members, start_in, states, stop_all

from daemon_helpers import Agent, Plan, wait_for
from netns import ip
from p2pxfer.daemon._follow import HOST_CHECK_S
from p2pxfer.engine import EngineConfig

#: h1 cut off is dead at h0 within what a killed member takes (its host
#: refuses the check at once) plus the check a silent host gets to answer
SILENT_DEAD_WITHIN = PEER_LOST_WITHIN["embedded"] + HOST_CHECK_S + 2.0
CANCEL_GRACE_S = EngineConfig().cancel_grace_s


@pytest.mark.netns
def test_membership_ends_a_write_to_a_silent_peer_and_others_go_on(tmp_path: Path) -> None:
    """Daemons with embedded membership on h0..h2 (one switch): h0 writes to
    h1 in a loop; h1's link goes down (silent: no reset). Membership's verdict
    ends the write in flight with ``PeerLost`` promptly (it used to wait,
    shielded, for pieces that never complete), and h0's writes to h2 go on."""

    procs: list[Any] = []
    names = ["h0", "h1", "h2"]
    ds: dict[str, Any] = {}
    with lan_members("embedded", 3, tmp_path) as (hosts, keys):
        try:
            for i, n in enumerate(names):
                ds[n] = start_in(hosts[i], tmp_path, n, keys)
                procs.append(ds[n])
            for n in names:
                wait_for(lambda n=n: states(ds[n]) == {m: "alive" for m in names},
                         f"{n} to see all three alive")
            plan = Plan(0x1501, pieces=512, min_len=4 << 10, max_len=32 << 10,
                        region=16 << 20)
            agents = {}
            for who, sock in (("t1", "h1"), ("t2", "h2"), ("loop", "h0"), ("other", "h0")):
                agents[who] = Agent("trio", ds[sock].socket, who)
                procs.append(agents[who])
            assert agents["t1"].ok("export", "r1", plan.region) == plan.region
            assert agents["t2"].ok("export", "r2", plan.region) == plan.region
            t0 = time.monotonic()
            agents["other"].ok("write", "h2", "r2", plan, 2)
            base = time.monotonic() - t0
            assert agents["loop"].call("loop", "h1", "r1", plan, 1) == ("ok", "looping")
            ip("-n", hosts[1].ns, "link", "set", hosts[1].interfaces[0], "down")
            t_cut = time.monotonic()
            times = []
            for i in range(3):
                t0 = time.monotonic()
                agents["other"].ok("write", "h2", "r2", plan, 3 + i)
                times.append(time.monotonic() - t0)
            wait_for(lambda: states(ds["h0"]).get("h1") == "dead", "h0 to see h1 dead",
                     timeout=30, interval=0.02)
            verdict = time.monotonic() - t_cut
            reply = agents["loop"].wait_reply("the write to the silent h1 to fail",
                                              timeout=30)
            ended = time.monotonic() - t_cut - verdict
            assert reply[:3] == ("raised", "PeerLost", "peer_lost"), reply
            assert verdict < SILENT_DEAD_WITHIN, verdict
            # The verdict ends the write: at most the engine's cancel grace (its
            # posted pieces never complete), then slack.
            assert ended < CANCEL_GRACE_S + 2.0, (verdict, ended)
            assert max(times) < 3 * base + 1.0, (times, base)
        finally:
            # The cut-off host is killed, not stopped: its daemon, closing its
            # engine with h0's write half received into memory its client
            # unexported, segfaults in libfabric's fi_close (a separate bug,
            # seen with and without the teardown on h0; reported).
            if "h1" in ds and ds["h1"].alive():
                ds["h1"].proc.kill()
                ds["h1"].proc.wait(10)
            stop_all(procs)
