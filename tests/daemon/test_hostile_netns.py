"""Daemons on a hostile network (issue 16): random loss, an abandoned write,
a flapping rail.

Two "hosts" (``netns.two_hosts``: namespaces joined by two veth pairs, one
"NIC" per rail), a daemon in each striping over both rails (``interfaces =
[eth0, eth1]``), each the other's static peer (``p2pxfer.hostile``):

- **Loss** (1 % and 5 % of the packets dropped at random by nftables, both
  directions, on one rail or on both; and no loss, for comparison): a client
  writes random scatter lists of a few MiB in a loop, the *whole* target
  region compared after every write: every write completes, verified, well
  within its deadline. Throughput per case goes to the test log (``pytest
  -rA``; and ``record_property``), not asserted.
- **The abandoned write**: a write stuck on the target's dead rails (both
  cut: nothing fails over), bytes of it waiting in the writer's sockets; it
  is given up (its clients exit; or its deadline passes, then they exit),
  the target's region is unexported with its client; a new client exports a
  zeroed region there; the rails come back and the old bytes go out: not one
  of them lands in the new region, which then takes new writes.
- **A region re-exported while its writer was cut off**: the owner's
  ``invalidate`` cannot reach the writer's daemon; it is retried until it
  does, so the writer's next writes, small ones included, land in the new
  region (before the retry, a small write through the old key vanished at
  the owner's end while its writer was told it succeeded).
- **Soak** (``soak`` marker; runs with ``P2PXFER_SOAK=1``, for
  ``P2PXFER_SOAK_SECONDS``, default 180): writes in a loop while one rail
  goes down 10 s and up 10 s, over and over, with ``delivery_complete`` (an
  ok write has landed); no write hangs, is incomplete or lands late or
  corrupt, every failure is a named error, and the daemons' fds and RSS stay
  flat. ``bench/soak.py`` runs the same (``delivery_complete`` off unless
  asked) and writes JSON.
- **A write given up at its deadline (or when its rail fails under it)
  lands nothing later**, and the peer takes new writes after the heal: a
  strict xfail (only for ``LandedLate``): the engine's teardown resets the
  connections, but segments already handed to the cut veth are delivered at
  the heal. (The soak passes: what it flaps never strands a given-up write's
  segment on the wire before newer writes to the same places.)

Needs root (namespaces) and nftables; skipped otherwise. All addresses live
inside the namespaces the tests create, deleted afterwards also on failure.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import Agent, Plan, wait_for
from netns import lossy, send_queue, set_link, two_hosts
from p2pxfer.hostile import LoopSpec, rail_daemons, run_loop
from p2pxfer.soak import soak

pytestmark = pytest.mark.netns

# The numbers (throughput, soak counts) go to the test log: `pytest -rA` shows them.
log = logging.getLogger("p2pxfer.tests.hostile")
log.setLevel(logging.INFO)

LOSS_DEADLINE_S = 20.0  # a write's deadline under loss (they take well under 1 s)
LOSS_ROUNDS = 12
RAIL_RETRY_S = 3.0  # EngineConfig.rail_retry_s, the daemons' default


@pytest.mark.parametrize(("percent", "rails"), [(0, "none"), (1, "one"), (5, "one"),
                                                (1, "both"), (5, "both")],
                         ids=["no-loss", "1pct-one-rail", "5pct-one-rail", "1pct-both-rails",
                              "5pct-both-rails"])
def test_writes_verify_under_random_loss(percent: int, rails: str, tmp_path: Path,
                                         record_property: Any) -> None:
    with two_hosts(rails=2) as (a, b), \
            rail_daemons(tmp_path, [a, b], write_timeout_s=LOSS_DEADLINE_S) as (da, db):
        if percent:
            lossy(b, b.interfaces[:1] if rails == "one" else b.interfaces, percent)
        report = run_loop(LoopSpec(da.socket, db.socket, db.name, LOSS_DEADLINE_S,
                                   rounds=LOSS_ROUNDS, seed=100 + percent))
        nics = {n["name"]: n["bytes"] for n in da.status()["nics"]}
        again = None
        if min(nics.values()) <= sum(nics.values()) / 4 and da.status()["failovers"]:
            # A rail pair whose connection went rail_stall_s without an ACK
            # (a lost SYN or a retransmission backoff under loss) was taken
            # down and its writes moved; it is tried again after
            # rail_retry_s, and must then carry its share again.
            time.sleep(RAIL_RETRY_S + 0.5)
            again = run_loop(LoopSpec(da.socket, db.socket, db.name, LOSS_DEADLINE_S,
                                      rounds=LOSS_ROUNDS, seed=200 + percent))
            before, nics = nics, {n["name"]: n["bytes"] for n in da.status()["nics"]}
            nics = {name: nics[name] - before[name] for name in nics}
    summary = report.summary()
    record_property("summary", json.dumps(summary))
    record_property("mib_per_s_landed", summary["ok_mib_per_s_landed"])
    log.info("loss %d%% on %s rail(s): %.1f MiB/s landed, writes %.3f s median, %.3f s max; "
             "%s", percent, rails, summary["ok_mib_per_s_landed"], summary["write_s_median"],
             summary["write_s_max"], json.dumps(summary))
    assert not report.stopped, report.stopped
    assert summary["ok"] == LOSS_ROUNDS, (summary, report.rounds)
    assert not report.problems(), report.problems()
    assert summary["write_s_max"] < LOSS_DEADLINE_S, summary
    if again is not None:
        log.info("a rail was taken down under loss; after its retry: %s",
                 json.dumps(again.summary()))
        assert not again.stopped and again.summary()["ok"] == LOSS_ROUNDS, again.summary()
        assert not again.problems(), again.problems()
    # Both rails carried the writes (each NIC at least a quarter of the bytes;
    # after a retry, of the second loop's).
    assert min(nics.values()) > sum(nics.values()) / 4, nics


ABANDON_DEADLINE_S = 3.0
# 1 MiB pieces: each is a message streaming into the region when the rails go.
ABANDON_PLAN = Plan(0xAB4D, pieces=32, min_len=1 << 20, max_len=1 << 20, region=48 << 20)


@pytest.mark.parametrize("given_up_by", ["clients_exit", "deadline"])
def test_an_abandoned_write_never_lands_in_a_region_exported_later(given_up_by: str,
                                                                   tmp_path: Path) -> None:
    plan = ABANDON_PLAN
    agents: list[Agent] = []
    with two_hosts(rails=2) as (a, b), \
            rail_daemons(tmp_path, [a, b], write_timeout_s=ABANDON_DEADLINE_S) as (da, db):
        try:
            old_target = Agent("trio", db.socket, "old-target")
            agents.append(old_target)
            assert old_target.ok("export", "r", plan.region) == plan.region
            writer = Agent("trio", da.socket, "old-writer")
            agents.append(writer)
            assert writer.call("loop", db.name, "r", plan, 1) == ("ok", "looping")
            time.sleep(0.3)  # writes streaming on both rails
            for dev in b.interfaces:
                set_link(b, dev, False)
            # Bytes of the write wait in the writer's sockets: they will go out
            # once the links are back (TCP retransmits them).
            stuck = wait_for(lambda: send_queue(a), "bytes stuck in the writer's sockets",
                             timeout=5)
            if given_up_by == "deadline":
                reply = writer.wait_reply("the stuck write's end",
                                          timeout=ABANDON_DEADLINE_S + 15)
                # Each outcome has its own class and wire code.
                assert reply[:2] in (("raised", "TransferTimeout"),
                                     ("raised", "RailFailedUnderImmediates")), reply
                # Given up at its deadline, or sooner: the rails go down one
                # after the other, and one stalling while the other still
                # moved is a failed rail pair (its pieces carry immediates:
                # the write fails rather than moving).
                assert any(w in reply[3] for w in ("deadline", "timed out",
                                                   "a rail failed under it")), reply
            else:
                assert da.status()["transfers_in_flight"] == 1
            writer.kill()
            old_target.kill()
            wait_for(lambda: not db.status()["regions"], "the old region to be unexported")
            wait_for(lambda: da.status()["transfers_in_flight"] == 0,
                     "the abandoned write to be torn down", timeout=ABANDON_DEADLINE_S + 10)
            new_target = Agent("trio", db.socket, "new-target")
            agents.append(new_target)
            assert new_target.ok("export", "r", plan.region) == plan.region
            for dev in b.interfaces:
                set_link(b, dev, True)
            # The old bytes go out now (or are dropped): wait until the
            # writer's sockets hold nothing more, and then some.
            wait_for(lambda: send_queue(a) == 0, "the writer's sockets to drain", timeout=60,
                     interval=0.2)
            time.sleep(3.0)
            nonzero = new_target.call("nonzero", "r")
            assert nonzero == ("ok", 0, []), \
                f"{nonzero[1]} bytes of the abandoned write landed in the new region " \
                f"(first at {nonzero[2]}; {stuck} bytes were stuck)"
            # The new region takes new writes, over the healed rails.
            writer2 = Agent("trio", da.socket, "new-writer")
            agents.append(writer2)
            fresh = Plan(0xF2E5, pieces=256, min_len=4 << 10, max_len=64 << 10,
                         region=plan.region)
            pieces = writer2.ok("write", db.name, "r", fresh, 7)
            assert new_target.call("verify", "r", fresh, 7, pieces)[0] == "ok"
            assert da.alive() and db.alive(), (da.log_tail(), db.log_tail())
        finally:
            for agent in agents:
                agent.kill()


@pytest.mark.parametrize("piece", [4096, 1 << 20], ids=["small", "large"])
def test_a_region_re_exported_while_its_writer_was_cut_off_gets_the_next_writes(
        piece: int, tmp_path: Path) -> None:
    plan = Plan(0x5E1F, pieces=2, min_len=piece, max_len=piece, region=4 << 20)
    agents: list[Agent] = []
    with two_hosts(rails=2) as (a, b), rail_daemons(tmp_path, [a, b]) as (da, db):
        try:
            old_target = Agent("trio", db.socket, "old-target")
            agents.append(old_target)
            old_target.ok("export", "r", plan.region)
            writer = Agent("trio", da.socket, "writer")
            agents.append(writer)
            pieces = writer.ok("write", db.name, "r", plan, 1)  # h0 holds r's descriptor now
            assert old_target.call("verify", "r", plan, 1, pieces)[0] == "ok"
            for dev in b.interfaces:
                set_link(b, dev, False)
            old_target.kill()  # r is unexported; h0 cannot be told
            wait_for(lambda: db.status()["invalidations_pending"] == 1,
                     "h1 to keep the invalidation that h0 did not get")
            new_target = Agent("trio", db.socket, "new-target")
            agents.append(new_target)
            new_target.ok("export", "r", plan.region)
            for dev in b.interfaces:
                set_link(b, dev, True)
            wait_for(lambda: db.status()["invalidations_pending"] == 0,
                     "the invalidation to reach h0 once the link is back", timeout=15)
            for imm in (2, 3):
                pieces = writer.ok("write", db.name, "r", plan, imm)
                assert new_target.call("verify", "r", plan, imm, pieces)[0] == "ok"
        finally:
            for agent in agents:
                agent.kill()


class LandedLate(AssertionError):
    """Bytes of a write landed after its writer was told it failed, or over a
    newer write: the engine's bug below (the xfails expect this one only)."""


# Not strict: whether the link holds segments at the cut depends on timing (on
# a host busy with two CPU hogs none were held, and nothing landed late). Any
# failure other than LandedLate still fails the test.
LANDS_LATER = pytest.mark.xfail(raises=LandedLate, strict=False, reason=(
    "what had left the writer's host when the write was given up still lands: the engine's "
    "teardown now resets the connections (the writer's sockets hold nothing after it, "
    "asserted) and the provider drops its queued operations, but the veth holds the "
    "segments it was handed while its peer end is down and delivers them at the heal, in "
    "sequence, ahead of the reset: 1393 bytes (one segment) of a write given up at its "
    "deadline, ~25 KB of one whose rail failed under it; only the target could refuse them"))


@LANDS_LATER
@pytest.mark.parametrize("given_up_by", ["deadline", "rail_failed"])
def test_a_write_given_up_at_its_deadline_lands_nothing_later(given_up_by: str,
                                                              tmp_path: Path) -> None:
    """With ``delivery_complete`` (a piece counts as done once it landed), a
    write stuck on cut rails fails naming the pieces that landed: at its
    deadline (both rails cut: nothing to fail over to), or when its rail pair
    is taken down (one rail cut; its pieces carry immediates, so they are not
    re-posted). Once the rails are back, not one more byte of it may land,
    and the peer takes new writes again."""
    plan = ABANDON_PLAN
    agents: list[Agent] = []
    with two_hosts(rails=2) as (a, b), \
            rail_daemons(tmp_path, [a, b], write_timeout_s=ABANDON_DEADLINE_S,
                         delivery_complete=True) as (da, db):
        try:
            cut = list(b.interfaces) if given_up_by == "deadline" else b.interfaces[1:]
            target = Agent("trio", db.socket, "target")
            agents.append(target)
            assert target.ok("export", "r", plan.region) == plan.region
            warm = Plan(0x3A, pieces=4, min_len=4096, max_len=4096, region=plan.region)
            writer = Agent("trio", da.socket, "writer")
            agents.append(writer)
            target.call("verify", "r", warm, 1, writer.ok("write", db.name, "r", warm, 1))
            target.call("nonzero", "r")  # both rails connected now
            for dev in cut:
                set_link(b, dev, False)
            reply = writer.call("write", db.name, "r", plan, 2,
                                timeout=ABANDON_DEADLINE_S + 15)
            why, cls = (("deadline", "TransferTimeout") if given_up_by == "deadline"
                        else ("a rail failed under it", "RailFailedUnderImmediates"))
            assert reply[:2] == ("raised", cls) and why in reply[3], reply
            stuck = send_queue(a)
            # The teardown reset the connections: no data of it waits in our
            # sockets (a knock's SYN counts one byte; a 1 MiB piece's share,
            # ~100 KiB and more, sat there before).
            assert stuck < 64, f"{stuck} bytes wait in the writer's sockets"
            landed = target.call("nonzero", "r")[1]
            before = target.call("digest", "r")[1]
            for dev in cut:
                set_link(b, dev, True)
            wait_for(lambda: send_queue(a) == 0, "the writer's sockets to drain", timeout=60,
                     interval=0.2)
            # What the link held is delivered once it is back, but on a busy
            # host that takes a while: watch for it for longer than a moment,
            # by digest (late bytes may land where the region was not zero).
            give_up = time.monotonic() + 10.0
            while target.call("digest", "r")[1] == before and time.monotonic() < give_up:
                time.sleep(0.5)

            def landed_late() -> None:
                if target.call("digest", "r")[1] != before:
                    later = target.call("nonzero", "r")[1]
                    raise LandedLate(f"bytes of the failed write landed after it failed "
                                     f"({later - landed} more not zero; {stuck} bytes were "
                                     f"in the writer's sockets): {reply[3]}")

            landed_late()
            # The torn-down connections come back: new writes land, verified
            # (in a region of their own: late bytes of the failed one land in
            # "r", and are caught there, not taken for a corrupt new write).
            assert target.ok("export", "r2", plan.region) == plan.region
            fresh = Plan(0xF2E5, pieces=256, min_len=4 << 10, max_len=64 << 10,
                         region=plan.region)
            pieces = writer.ok("write", db.name, "r2", fresh, 7,
                               timeout=ABANDON_DEADLINE_S + 15)
            assert target.call("verify", "r2", fresh, 7, pieces)[0] == "ok"
            landed_late()
        finally:
            for agent in agents:
                agent.kill()


SOAK_SECONDS = float(os.environ.get("P2PXFER_SOAK_SECONDS", "180"))
FD_GROWTH = 8  # "flat": at most this many more descriptors at the end
RSS_GROWTH_KIB = 64 << 10  # and at most this much more resident memory


@pytest.mark.soak
@pytest.mark.skipif(os.environ.get("P2PXFER_SOAK") != "1",
                    reason="the soak runs minutes: set P2PXFER_SOAK=1")
def test_soak_with_a_flapping_rail(tmp_path: Path, record_property: Any) -> None:
    """With ``delivery_complete``, so that an ok write has landed (without
    it an ok write's tail can sit in a cut rail's socket and land after the
    heal, over newer writes: ``bench/soak.py`` measures that default)."""
    with two_hosts(rails=2) as (a, b):
        dev = b.interfaces[1]
        result = soak(tmp_path, a, b, lambda up: set_link(b, dev, up), seconds=SOAK_SECONDS,
                      delivery_complete=True)
    record_property("soak", json.dumps(result))
    log.info("soak: %s", json.dumps(result))
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=2))  # kept to read after
    assert not result["stopped"], result
    assert result["flaps"] >= 2, result
    assert result["hung"] == 0, result["problems"]
    assert result["incomplete"] == 0, result["problems"]
    assert result["ok"] > result["failed"], result
    assert all(result["alive"].values()), result
    for name, start in result["daemons"]["start"].items():
        end = result["daemons"]["end"][name]
        assert end["fds"] <= start["fds"] + FD_GROWTH, (name, result["daemons"])
        assert end["rss_kib"] <= start["rss_kib"] + RSS_GROWTH_KIB, (name, result["daemons"])
    if result["corrupt_bytes"] or result["late_bytes"]:
        raise LandedLate(f"{result['late_bytes']} bytes of failed writes landed after they "
                         f"failed, {result['corrupt_bytes']} bytes nobody's: "
                         f"{result['problems']}")
