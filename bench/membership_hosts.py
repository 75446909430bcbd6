"""Membership convergence between real daemons, one per network namespace.

``--hosts`` (8) namespaces on one switch (``tests/netns.py``'s ``lan``), each
running a ``p2pxfer daemon`` with ``membership = "embedded"`` (SWIM, seeded by
the first host) or, with ``--backend etcd``, ``"etcd"`` (a one-member etcd in
one more namespace on the switch). The daemons of the first hosts-1 form the
cluster (``bootstrap``); then, once per ``--repeat``, a member with a fresh
name on the last host goes through:

- ``join``: from starting its daemon process until every daemon lists all
  ``hosts`` members alive (``join_after_ready``: from its socket accepting);
- ``kill``: from SIGKILL until every other daemon lists it dead;
- ``restart``: from starting it again until every daemon lists its new
  incarnation alive;
- ``leave``: from SIGINT (the graceful stop) until every other daemon lists it left.

Every daemon's ``status`` is polled over its unix socket every ``--interval``
seconds (a daemon is no longer polled once it has seen the event), so a time
is late by up to one interval plus one polling round. Median and max over the
repetitions. ``steady`` (after the first join, all members alive): what each
member sends and receives per second, from its namespace's own counters
(``/proc/PID/net/snmp``: UDP datagrams, which are SWIM's; TCP segments, which
for etcd are the lease keepalives and the watch), and its CPU. (These count
every datagram the namespace saw, the same way for both backends; the
daemon's ``status`` has SWIM's own counters under ``membership_stats``.)

Needs root and ``ip netns``; elsewhere it writes one ``skipped`` result and exits 0.

    python bench/membership_hosts.py --json bench/results/membership_hosts.json
    python bench/membership_hosts.py --backend both --repeat 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from p2pxfer.bench import write_document

# isort: split
# The daemon launcher, shared with the tests (helper B's p2pxfer.testing).
from p2pxfer.testing import DaemonProc, LaunchError, spawn_daemon

# Namespaces on one switch: the multi-host tests' helper (tests/netns.py, no tests in it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import lan

WAIT = 60.0  # the longest any one event may take to converge
CONTROL_PORT = 7700  # every host's daemon: control (TCP) and membership (UDP)
TOKEN = "membership-bench-token"
ETCD_TTL = 3  # seconds; 2 s gave false deaths on a loaded machine
View = dict[str, dict[str, Any]]


def members(d: DaemonProc) -> View:
    return {p["name"]: p for p in d.status()["peers"]}


def start_in(host: Any, workdir: Path, name: str, membership: dict[str, Any]) -> DaemonProc:
    """A daemon inside ``host``'s namespace, control (and membership) on its
    address; its unix socket in ``workdir`` (reachable from here)."""
    addr = host.addresses[0]
    return spawn_daemon(workdir, {
        "node": name, "socket": str(workdir / f"{name}.sock"),
        "control": f"{addr}:{CONTROL_PORT}", "provider": "tcp;ofi_rxm", "fabric_node": addr,
        "log_level": "INFO", **membership,
    }, host.exec_argv)


def stop_all(procs: list[DaemonProc]) -> None:
    """Stop these daemons, the last started first."""
    while procs:
        procs.pop().stop()


@contextmanager
def lan_members(backend: str, n: int,
                workdir: Path) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """``n`` hosts on one switch and their daemons' membership keys: embedded
    (seeded by the first host) or etcd (one more namespace on the switch runs it)."""
    with lan(n + (backend == "etcd")) as hosts:
        if backend == "embedded":
            yield hosts, {"membership": "embedded", "cluster_token": TOKEN,
                          "seeds": [f"{hosts[0].addresses[0]}:{CONTROL_PORT}"]}
            return
        from p2pxfer.testing import etcd_in

        with etcd_in(hosts[n], workdir / "etcd") as url:
            yield hosts[:n], {"membership": "etcd", "cluster_token": TOKEN,
                              "etcd_endpoint": url, "etcd_ttl": ETCD_TTL}


def until_all(ds: list[DaemonProc], seen: Callable[[View], bool], t0: float,
              interval: float, what: str) -> float:
    """Seconds from ``t0`` until ``seen(members)`` held at every daemon of ``ds``."""
    pending = list(ds)
    last = t0
    deadline = time.monotonic() + WAIT
    while True:
        start = time.monotonic()
        for d in list(pending):
            if seen(members(d)):
                last = time.monotonic()
                pending.remove(d)
        if not pending:
            return last - t0
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not seen by {[d.name for d in pending]} "
                               f"within {WAIT} s")
        time.sleep(max(0.0, interval - (time.monotonic() - start)))


def alive(view: View) -> set[str]:
    return {n for n, p in view.items() if p["state"] == "alive"}


def counters(pid: int) -> dict[str, float]:
    """UDP datagrams and TCP segments of ``pid``'s namespace, and its CPU seconds."""
    lines = Path(f"/proc/{pid}/net/snmp").read_text().splitlines()
    table = {}
    for head, values in zip(lines[::2], lines[1::2], strict=True):
        proto, keys = head.split(":", 1)
        table[proto] = dict(zip(keys.split(), map(int, values.split(":", 1)[1].split()),
                                strict=True))
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"udp_out": table["Udp"]["OutDatagrams"], "udp_in": table["Udp"]["InDatagrams"],
            "tcp_out": table["Tcp"]["OutSegs"], "tcp_in": table["Tcp"]["InSegs"],
            "cpu_s": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")}


def steady(ds: list[DaemonProc], seconds: float) -> dict[str, Any]:
    """Per member and second over ``seconds``: median and max over the members."""
    before = {d.name: counters(d.proc.pid) for d in ds}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {d.name: counters(d.proc.pid) for d in ds}
    dt = time.monotonic() - t0
    out: dict[str, Any] = {"pattern": "steady", "seconds": round(dt, 2)}
    for key in ("udp_out", "udp_in", "tcp_out", "tcp_in", "cpu_s"):
        rates = [(after[n][key] - before[n][key]) / dt for n in before]
        name = "cpu_fraction_of_core" if key == "cpu_s" else f"{key}_per_s"
        out[f"{name}_median"] = round(statistics.median(rates), 4 if key == "cpu_s" else 2)
        out[f"{name}_max"] = round(max(rates), 4 if key == "cpu_s" else 2)
    return out


def summary(pattern: str, samples: list[float]) -> dict[str, Any]:
    return {"pattern": pattern, "median_s": round(statistics.median(samples), 3),
            "max_s": round(max(samples), 3), "samples_s": [round(s, 3) for s in samples]}


def run(backend: str, hosts_n: int, repeat: int, interval: float, steady_s: float,
        workdir: Path) -> list[dict[str, Any]]:
    samples: dict[str, list[float]] = {k: [] for k in ("join", "join_after_ready", "kill",
                                                       "restart", "leave")}
    procs: list[Any] = []
    results: list[dict[str, Any]] = []
    with lan_members(backend, hosts_n, workdir) as (hosts, keys):
        try:
            base = [f"h{i}" for i in range(hosts_n - 1)]
            t0 = time.monotonic()
            for i, name in enumerate(base):
                procs.append(start_in(hosts[i], workdir, name, keys))
            ds = list(procs)
            boot = until_all(ds, lambda v: alive(v) == set(base), t0, interval, "bootstrap")
            results.append({"pattern": "bootstrap", "members": len(base),
                            "seconds": round(boot, 3)})
            for r in range(repeat):
                x = f"x{r}"
                everyone = {*base, x}
                t0 = time.monotonic()
                d = start_in(hosts[-1], workdir, x, keys)
                procs.append(d)
                ready = time.monotonic() - t0
                took = until_all([*ds, d], lambda v, e=everyone: alive(v) == e, t0, interval,
                                 f"{x} joining")
                samples["join"].append(took)
                samples["join_after_ready"].append(took - ready)
                if r == 0 and steady_s > 0:
                    time.sleep(2.0)  # the join news passed on its last time
                    results.append(steady([*ds, d], steady_s))

                inc = members(ds[0])[x]["incarnation"]
                t0 = time.monotonic()
                d.proc.kill()
                samples["kill"].append(until_all(
                    ds, lambda v, x=x: v.get(x, {}).get("state") == "dead", t0, interval,
                    f"{x} seen dead"))
                d.proc.wait(10)

                t0 = time.monotonic()
                d = start_in(hosts[-1], workdir, x, keys)
                procs.append(d)
                samples["restart"].append(until_all(
                    [*ds, d], lambda v, x=x, inc=inc, e=everyone: alive(v) == e and
                    v[x]["incarnation"] > inc, t0, interval, f"{x}'s new life"))

                t0 = time.monotonic()
                d.proc.send_signal(signal.SIGINT)
                samples["leave"].append(until_all(
                    ds, lambda v, x=x: v.get(x, {}).get("state") == "left", t0, interval,
                    f"{x} seen left"))
                d.proc.wait(10)
        finally:
            stop_all(procs)  # before etcd and the namespaces go
    results += [summary(k, v) for k, v in samples.items()]
    for res in results:
        res.update(backend=backend, hosts=hosts_n, repeat=repeat, poll_interval_s=interval)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--backend", choices=("embedded", "etcd", "both"), default="embedded")
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.025,
                    help="seconds between two status polls of a daemon")
    ap.add_argument("--steady-seconds", type=float, default=5.0)
    ap.add_argument("--json", help="write results here as JSON")
    args = ap.parse_args()
    if args.hosts < 2 or args.repeat < 1:
        ap.error("needs --hosts >= 2 and --repeat >= 1")
    backends = ("embedded", "etcd") if args.backend == "both" else (args.backend,)
    results: list[dict[str, Any]] = []
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="p2pmh") as tmp:
            try:
                results += run(backend, args.hosts, args.repeat, args.interval,
                               args.steady_seconds, Path(tmp))
            except pytest.skip.Exception as exc:  # no namespaces here (netns.lan skips)
                results.append({"pattern": "skipped", "backend": backend,
                                "skipped": str(exc.msg)})
            except LaunchError as exc:  # no etcd here
                results.append({"pattern": "skipped", "backend": backend, "skipped": str(exc)})
    sys.stdout.write(write_document("membership_hosts", results, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
