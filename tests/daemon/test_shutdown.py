"""Daemon shutdown is bounded, whatever is stuck.

A write whose peer went silent (its link down, or all its packets dropped
with nftables: no reset) never completes: the engine keeps waiting for the pieces it posted.
SIGTERM (or SIGINT) must still end the daemon within a few seconds: after a
grace period the daemon closes its engine, which fails what is in flight with
``EngineClosed`` and closes the rails (nothing can land later).

Two hosts in network namespaces (``netns.two_hosts``), one daemon each
(static peers); skipped where namespaces cannot be made.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import Agent, DaemonProc, Plan, wait_for
from p2pxfer.testing import spawn_daemon

pytestmark = pytest.mark.netns

CONTROL_PORT = 7710
EXIT_WITHIN = 5.0  # the bound: SIGTERM to exit


def start_in(host: Any, workdir: Path, name: str, peer: str, peer_host: Any) -> DaemonProc:
    addr = host.addresses[0]
    return spawn_daemon(workdir, {
        "node": name, "socket": str(workdir / f"{name}.sock"),
        "control": f"{addr}:{CONTROL_PORT}", "provider": "tcp;ofi_rxm", "fabric_node": addr,
        "log_level": "INFO", "cluster_token": "shutdown-test-token",
        "peers": [{"name": peer, "address": f"{peer_host.addresses[0]}:{CONTROL_PORT}"}],
    }, host.exec_argv)


@pytest.mark.parametrize("silence", ["link_down", "nft_drop"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_a_write_stuck_on_a_silent_peer(signum: int, silence: str,
                                                    tmp_path: Path) -> None:
    from netns import block_port, ip, two_hosts

    procs: list[Any] = []
    with two_hosts(rails=1) as (a, b):
        try:
            da = start_in(a, tmp_path, "ha", "hb", b)
            procs.append(da)
            db = start_in(b, tmp_path, "hb", "ha", a)
            procs.append(db)
            plan = Plan(0x5707, pieces=2048, min_len=16 << 10, max_len=64 << 10,
                        region=128 << 20)
            target = Agent("trio", db.socket, "target-hb")
            procs.append(target)
            assert target.ok("export", "r", plan.region) == plan.region
            looper = Agent("trio", da.socket, "looper-ha")
            procs.append(looper)
            assert looper.call("loop", "hb", "r", plan, 1) == ("ok", "looping")
            # hb goes silent: its end of the link down, or every packet through
            # it dropped; either way ha's packets vanish, with no reset.
            if silence == "link_down":
                ip("-n", b.ns, "link", "set", b.interfaces[0], "down")
            else:
                block_port(b, b.interfaces[0], None)
            wait_for(lambda: da.status()["transfers_in_flight"] > 0,
                     "ha to have a write in flight", timeout=5)
            time.sleep(1.0)  # the write is stuck, not merely slow
            assert da.status()["transfers_in_flight"] > 0
            assert da.alive()
            t0 = time.monotonic()
            da.proc.send_signal(signum)
            try:
                code = da.proc.wait(EXIT_WITHIN + 5)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - t0
            assert code is not None, f"ha did not exit within {EXIT_WITHIN + 5} s:\n" \
                                     f"{da.log_tail()}"
            assert took < EXIT_WITHIN, f"ha took {took:.2f} s to exit:\n{da.log_tail()}"
            assert code == 0, f"ha exited with {code}:\n{da.log_tail()}"
            # The stuck write ended by force: torn down after the engine's
            # cancel grace, or, failing that, by the daemon's shutdown deadline.
            said = da.log.read_text()
            assert "transfer.aborted" in said or "daemon.shutdown_forced" in said, da.log_tail()
            target.kill()
            # hb, cut off in the middle of receiving ha's write, still shuts
            # down cleanly (libfabric would die closing that connection).
            assert db.stop() == 0, f"hb exited with {db.proc.returncode}:\n{db.log_tail()}"
        finally:
            for p in reversed(procs):
                if isinstance(p, Agent):
                    p.kill()
                else:
                    p.stop()
