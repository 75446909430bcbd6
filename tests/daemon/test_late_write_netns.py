"""A write already on its way when its target region is unexported.

A writer's completion means "sent" (tcp's default): its bytes may still be
in a socket, or on a link being retransmitted, when the region's owner gives
the region up. Closing the region's keys at once made the target's tcp
provider take those bytes for a protocol error and drop the connection: the
writes queued behind them, into other regions that were never unexported,
were lost though their writers were told they completed (a fresh-clone run
here failed the same way on loopback: "Transport endpoint is not connected:
Broken pipe", the next write after an unexport). The daemon now swaps
private pages in under the export and keeps its keys a while
(``Exports.remove``, ``Engine.unexport_later``): the late bytes land there,
the connection stays, and the writes behind it land.

Two "hosts" (network namespaces, one veth link); the writer's link is cut
while it writes, so its bytes wait in its socket until the link is back.
Needs root; skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon_helpers import Agent, Plan, wait_for
from netns import send_queue, set_link, two_hosts
from p2pxfer.hostile import rail_daemons

pytestmark = pytest.mark.netns

# Small enough that both writes made during the cut fit in the writer's socket
# (they complete: "sent") with room to spare.
PLAN = Plan(0x1A7E, pieces=8, min_len=1 << 10, max_len=4 << 10, region=1 << 20)


def test_a_write_on_its_way_when_its_region_goes_spares_the_writes_behind_it(
        tmp_path: Path) -> None:
    agents: list[Agent] = []
    with two_hosts(rails=1) as (a, b), rail_daemons(tmp_path, [a, b]) as (da, db):
        try:
            owner = Agent("trio", db.socket, "owner")
            writer = Agent("trio", da.socket, "writer")
            agents += [owner, writer]
            for region in ("gone", "kept"):
                assert owner.ok("export", region, PLAN.region) == PLAN.region
                pieces = writer.ok("write", db.name, region, PLAN, 1)
                assert owner.call("verify", region, PLAN, 1, pieces)[0] == "ok"

            # Cut: what the writer sends waits in its socket (it completes: "sent").
            set_link(a, a.interfaces[0], False)
            writer.ok("write", db.name, "gone", PLAN, 2)
            assert owner.ok("unexport", "gone") is None  # before its bytes arrive
            pieces = writer.ok("write", db.name, "kept", PLAN, 3)
            wait_for(lambda: send_queue(a) > 0, "the writes to wait in the writer's socket")
            set_link(a, a.interfaces[0], True)

            # The late bytes for "gone" arrive first, then those for "kept":
            # every one of the latter lands.
            assert owner.call("verify", "kept", PLAN, 3, pieces)[0] == "ok"
            wait_for(lambda: send_queue(a) == 0, "the writer's socket to drain", timeout=30)
            # The connection lived on: the next write goes through at once.
            pieces = writer.ok("write", db.name, "kept", PLAN, 4)
            assert owner.call("verify", "kept", PLAN, 4, pieces)[0] == "ok"
            assert "Broken pipe" not in da.log_tail(400)
        finally:
            for agent in agents:
                agent.kill()
