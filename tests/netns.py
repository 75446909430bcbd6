"""Two "hosts" on one machine: network namespaces joined by veth pairs.

``lan(n)`` puts ``n`` hosts on one switch; ``rails_lan(n, rails)`` gives each
of ``n`` hosts ``rails`` NICs, rail ``r`` of every host on switch ``r``.
``two_hosts()`` creates namespaces ``A`` and ``B`` (names unique per process
and call), ``rails`` veth pairs between them (each pair one "NIC" per host),
addresses ``10.77.<rail+1>.1`` (A) and ``10.77.<rail+1>.2`` (B) on ``/24``s,
and brings ``lo`` and every link up. Whatever happens, the namespaces (and
with them the veths) are deleted on exit. Where namespaces cannot be created
(not root, no ``ip``), the calling test is skipped with the reason.

Faults: ``set_link`` (a NIC down or up: a cut cable, no reset),
``block_port`` (drop a port's packets), ``lossy`` (drop a percentage of the
packets at random, nftables ``numgen``), ``slow_link`` (a rate limit,
``tc tbf``); ``send_queue`` says how many bytes
a host's TCP sockets still hold unacknowledged.

All traffic stays inside these namespaces: nothing is routed to the host.
This module is a helper, not a test file.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

__all__ = ["Host", "block_port", "ip", "lan", "lossy", "rails_lan", "send_queue", "set_link",
           "slow_link", "two_hosts", "unblock", "unloss"]

_counter = itertools.count()
IP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its veth interfaces (one per rail) and their
    addresses, in rail order."""

    ns: str
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raises ``RuntimeError`` with ip's own words on failure."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT,
                          check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _wait_up(ns: str, dev: str, timeout: float = 5.0) -> None:
    """Wait until ``dev`` has carrier (libfabric's tcp provider skips links
    that are down or have no carrier)."""
    deadline = time.monotonic() + timeout
    while True:
        out = ip("-n", ns, "-o", "link", "show", "dev", dev).stdout
        flags = out.split("<", 1)[-1].split(">", 1)[0].split(",")
        if "UP" in flags and "LOWER_UP" in flags:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{dev} in {ns} did not come up: {out.strip()}")
        time.sleep(0.02)


def _delete(namespaces: list[str]) -> None:
    """Delete the namespaces this module created (their veths go with them)."""
    errors = []
    for ns in reversed(namespaces):
        proc = ip("netns", "del", ns, check=False)
        if proc.returncode != 0:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    if errors:
        raise RuntimeError(f"could not delete namespaces: {errors}")


@contextmanager
def two_hosts(rails: int = 2) -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B with ``rails`` veth links between them; see the module doc."""
    if not 1 <= rails <= 9:
        raise ValueError(f"rails must be 1..9, got {rails}")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid()}{next(_counter)}"
    names = {side: f"p2p{tag}{side}" for side in "ab"}
    # Interface names must fit IFNAMSIZ (15 characters).
    ifaces = {side: tuple(f"p2{tag}{side}{r}" for r in range(rails)) for side in "ab"}
    assert all(len(n) <= 15 for side in "ab" for n in ifaces[side]), ifaces
    created: list[str] = []
    try:
        try:
            for side in "ab":
                ip("netns", "add", names[side])
                created.append(names[side])
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot create a network namespace: {exc}")
        for r in range(rails):
            a_if, b_if = ifaces["a"][r], ifaces["b"][r]
            # Created straight inside the namespaces: never a link in the host's.
            ip("link", "add", a_if, "netns", names["a"], "type", "veth",
               "peer", "name", b_if, "netns", names["b"])
            for side, dev, host_part in (("a", a_if, 1), ("b", b_if, 2)):
                ip("-n", names[side], "addr", "add", f"10.77.{r + 1}.{host_part}/24",
                   "dev", dev)
                ip("-n", names[side], "link", "set", dev, "up")
        for side in "ab":
            ip("-n", names[side], "link", "set", "lo", "up")
        for side in "ab":
            for dev in ifaces[side]:
                _wait_up(names[side], dev)
        hosts = tuple(
            Host(names[side], ifaces[side],
                 tuple(f"10.77.{r + 1}.{1 if side == 'a' else 2}" for r in range(rails)))
            for side in "ab"
        )
        yield hosts[0], hosts[1]
    finally:
        _delete(created)


@contextmanager
def lan(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one switch: namespaces ``h0..h{n-1}``, each with one veth
    (address ``10.78.0.<i+1>/24``) whose other end sits on a bridge in a
    switch namespace. ``Host.interfaces[0]`` set down / up cuts / heals a
    host's link. Skips like ``two_hosts`` where namespaces cannot be made."""
    if not 1 <= n <= 200:
        raise ValueError(f"n must be 1..200, got {n}")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid()}{next(_counter)}"
    switch = f"p2p{tag}sw"
    created: list[str] = []
    try:
        try:
            ip("netns", "add", switch)
            created.append(switch)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot create a network namespace: {exc}")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        hosts = []
        for i in range(n):
            ns = f"p2p{tag}h{i}"
            ip("netns", "add", ns)
            created.append(ns)
            dev, port = f"l{tag}h{i}"[-15:], f"l{tag}s{i}"[-15:]
            ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
               "netns", switch)
            ip("-n", switch, "link", "set", port, "master", "br0")
            ip("-n", switch, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"10.78.0.{i + 1}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            hosts.append(Host(ns, (dev,), (f"10.78.0.{i + 1}",)))
        for h in hosts:
            _wait_up(h.ns, h.interfaces[0])
        yield hosts
    finally:
        _delete(created)


@contextmanager
def rails_lan(n: int, rails: int = 2) -> Iterator[list[Host]]:
    """``n`` hosts ``h0..h{n-1}``, each with ``rails`` veths: rail ``r`` of
    every host sits on bridge ``br<r>`` of one switch namespace (its own
    segment, ``10.79.<r+1>.0/24``; host ``i`` is ``.<i+1>``), so each host has
    one NIC per rail. ``Host.interfaces[r]`` / ``addresses[r]``: rail ``r``.
    Skips like ``two_hosts`` where namespaces cannot be made."""
    if not 1 <= n <= 200 or not 1 <= rails <= 9:
        raise ValueError(f"n must be 1..200 and rails 1..9, got {n}, {rails}")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid()}{next(_counter)}"
    switch = f"p2p{tag}rs"
    created: list[str] = []
    try:
        try:
            ip("netns", "add", switch)
            created.append(switch)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot create a network namespace: {exc}")
        for r in range(rails):
            ip("-n", switch, "link", "add", f"br{r}", "type", "bridge")
            ip("-n", switch, "link", "set", f"br{r}", "up")
        hosts = []
        for i in range(n):
            ns = f"p2p{tag}r{i}"
            ip("netns", "add", ns)
            created.append(ns)
            devs, addrs = [], []
            for r in range(rails):
                dev, port = f"r{tag}h{i}e{r}"[-15:], f"r{tag}s{i}e{r}"[-15:]
                ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
                   "netns", switch)
                ip("-n", switch, "link", "set", port, "master", f"br{r}")
                ip("-n", switch, "link", "set", port, "up")
                addr = f"10.79.{r + 1}.{i + 1}"
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                devs.append(dev)
                addrs.append(addr)
            ip("-n", ns, "link", "set", "lo", "up")
            hosts.append(Host(ns, tuple(devs), tuple(addrs)))
        for h in hosts:
            for dev in h.interfaces:
                _wait_up(h.ns, dev)
        yield hosts
    finally:
        _delete(created)


def block_port(host: Host, dev: str, port: int | None) -> None:
    """Inside ``host``: drop every TCP and UDP packet to or from ``port`` that
    enters or leaves ``dev`` (``port`` None: every packet), with nftables
    table ``p2pblock``; it goes with the namespace, or with ``unblock``.
    Skips the test where ``nft`` is missing."""
    match = [f"meta l4proto {{ tcp, udp }} th {d} {port}" for d in ("dport", "sport")] \
        if port is not None else [""]
    rules = "\n".join([
        "table inet p2pblock {",
        "  chain blockin {",
        "    type filter hook input priority 0; policy accept;",
        *[f'    iifname "{dev}" {m} drop' for m in match],
        "  }",
        "  chain blockout {",
        "    type filter hook output priority 0; policy accept;",
        *[f'    oifname "{dev}" {m} drop' for m in match],
        "  }",
        "}",
        "",
    ])
    _nft(host, rules)


def unblock(host: Host) -> None:
    """Remove what ``block_port`` added in ``host``."""
    subprocess.run(host.exec_argv(["nft", "delete", "table", "inet", "p2pblock"]),
                   capture_output=True, text=True, timeout=IP_TIMEOUT, check=True)


def _nft(host: Host, rules: str) -> None:
    if shutil.which("nft") is None:
        pytest.skip("nftables (`nft`) is not installed")
    proc = subprocess.run(host.exec_argv(["nft", "-f", "-"]), input=rules, capture_output=True,
                          text=True, timeout=IP_TIMEOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"nft failed in {host.ns}: {proc.stderr.strip()}")


def lossy(host: Host, devs: Sequence[str], percent: int) -> None:
    """Inside ``host``: drop ``percent`` % of the packets, at random, that
    enter or leave any of ``devs`` (nftables table ``p2ploss``, ``numgen
    random``: each packet on its own, both directions). Replaces an earlier
    ``lossy`` of the host; ``unloss`` (or the namespace's end) removes it.
    Skips the test where ``nft`` is missing."""
    if not 0 < percent < 100 or not devs:
        raise ValueError(f"needs devices and 0 < percent < 100, got {devs}, {percent}")
    unloss(host)
    rule = f"numgen random mod 100 < {percent} counter drop"
    _nft(host, "\n".join([
        "table inet p2ploss {",
        "  chain lossin {",
        "    type filter hook input priority 0; policy accept;",
        *[f'    iifname "{dev}" {rule}' for dev in devs],
        "  }",
        "  chain lossout {",
        "    type filter hook output priority 0; policy accept;",
        *[f'    oifname "{dev}" {rule}' for dev in devs],
        "  }",
        "}",
        "",
    ]))


def slow_link(host: Host, dev: str, mbit: int) -> None:
    """Inside ``host``: what leaves through ``dev`` at most ``mbit`` Mbit/s
    (a token bucket, ``tc tbf``, a short queue: a narrow link, not a lossy
    one). Gone with the namespace."""
    proc = subprocess.run(host.exec_argv(["tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                                          "rate", f"{mbit}mbit", "burst", "256kb",
                                          "latency", "20ms"]),
                          capture_output=True, text=True, timeout=IP_TIMEOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tc failed in {host.ns}: {proc.stderr.strip()}")


def unloss(host: Host) -> None:
    """Remove what ``lossy`` added in ``host`` (nothing if it added nothing)."""
    if shutil.which("nft") is None:
        return
    listed = subprocess.run(host.exec_argv(["nft", "list", "tables"]), capture_output=True,
                            text=True, timeout=IP_TIMEOUT, check=True).stdout
    if "p2ploss" in listed:
        subprocess.run(host.exec_argv(["nft", "delete", "table", "inet", "p2ploss"]),
                       capture_output=True, text=True, timeout=IP_TIMEOUT, check=True)


def set_link(host: Host, dev: str, up: bool) -> None:
    """``dev`` of ``host`` up (waiting for carrier) or down: down, the veth
    drops whatever is sent to it, with no reset (a cut cable, a dead NIC)."""
    ip("-n", host.ns, "link", "set", dev, "up" if up else "down")
    if up:
        _wait_up(host.ns, dev)


def send_queue(host: Host) -> int:
    """Bytes that TCP sockets of ``host`` still hold unacknowledged (the
    ``Send-Q`` of every socket, closing ones included): what could still
    arrive at a peer once a cut link is back."""
    out = subprocess.run(host.exec_argv(["ss", "-Htan"]), capture_output=True, text=True,
                         timeout=IP_TIMEOUT, check=True).stdout
    # Columns: State Recv-Q Send-Q Local Peer; a listener's Send-Q is its backlog.
    return sum(int(cols[2]) for line in out.splitlines()
               if len(cols := line.split()) >= 3 and cols[0] != "LISTEN")
