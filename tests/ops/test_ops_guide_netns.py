"""docs/deploy.md followed in two network namespaces, as two machines: the
guide's config pair and firewall, taken from the page itself (addresses and
paths moved to the namespaces and a temporary directory), in each of its
variants (token, mutual TLS with certificates made by its commands, etcd on
machine A), then its check command. With the fabric's ports closed in B's
firewall, ``p2pxfer ping`` fails at the write over B's rail and names the
port; with the guide's firewall it passes both ways, and the fabric listens
inside the range."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import DaemonProc, p2pxfer_cmd, spawn_daemon
from netns import Host, two_hosts
from p2pxfer.fabric._ports import parse_port_range

pytestmark = pytest.mark.netns

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
GUIDE_ADDRESSES = {"10.0.0.1": 0, "10.0.0.2": 1}
RUN_TIMEOUT = 90.0


def guide_blocks() -> dict[str, str]:
    """The code blocks the guide marks ``<!-- guide: NAME -->``."""
    text = GUIDE.read_text()
    found = re.findall(r"<!-- guide: (\S+) -->\n```[a-z]*\n(.*?)```", text, re.S)
    return dict(found)


def moved(text: str, hosts: tuple[Host, Host], workdir: Path) -> str:
    """The guide's text with its machines' addresses and paths replaced (the
    etcd host, 10.0.0.9 in the guide, is machine A here)."""
    for address, i in {**GUIDE_ADDRESSES, "10.0.0.9": 0}.items():
        text = text.replace(address, hosts[i].addresses[0])
    return text.replace("/etc/p2pxfer/token", str(workdir / "token"))


def nft(host: Host, rules: str) -> None:
    proc = subprocess.run(host.exec_argv(["nft", "-f", "-"]), input=rules, text=True,
                          capture_output=True, timeout=10, check=False)
    assert proc.returncode == 0, proc.stderr


def ping(src: DaemonProc, peer: str, timeout: float = 3) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*p2pxfer_cmd(), "ping", peer, "--socket", src.socket,
                           "--timeout", str(timeout)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, check=False, stdin=subprocess.DEVNULL)


def rail_ports(d: DaemonProc) -> list[int]:
    return [int(r["address"].rsplit(":", 1)[1]) for r in d.status()["rails"]]


def config(name: str, variant: str, blocks: dict[str, str], hosts: tuple[Host, Host],
           workdir: Path) -> dict[str, Any]:
    """``name``'s config as the guide writes it for ``variant``."""
    keys: dict[str, Any] = tomllib.loads(moved(blocks[f"{name}.toml"], hosts, workdir))
    if variant == "etcd":  # "replace membership and seeds with"
        del keys["membership"], keys["seeds"]
        keys.update(tomllib.loads(moved(blocks["etcd.toml"], hosts, workdir)))
    if variant == "tls":  # "add to its config" (node-b.crt on B), its tls-* copied there
        tls = blocks["tls.toml"].replace("node-a", name)
        tls = tls.replace("/etc/p2pxfer/tls", str(workdir / f"tls-{name[-1]}"))
        keys.update(tomllib.loads(tls))
    keys["socket"] = str(workdir / f"{name}.sock")
    keys["log_level"] = "INFO"
    return keys


@contextmanager
def etcd_if(variant: str, host: Host, workdir: Path) -> Iterator[None]:
    if variant != "etcd":
        yield
        return
    from p2pxfer.testing import LaunchError, etcd_in

    try:
        with etcd_in(host, workdir / "etcd"):
            yield
    except LaunchError as exc:
        if shutil.which("etcd") is None:
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("variant", ["token", "tls", "etcd"])
def test_guide_in_two_namespaces(tmp_path: Path, variant: str) -> None:
    blocks = guide_blocks()
    assert {"node-a.toml", "node-b.toml", "firewall.nft", "etcd.toml", "certs.sh",
            "tls.toml"} <= set(blocks), sorted(blocks)
    firewall = blocks["firewall.nft"]
    match = re.search(r"tcp dport (\d+-\d+) accept", firewall)
    assert match is not None, firewall
    low, high = parse_port_range(match[1])
    (tmp_path / "token").write_text("a secret for the two machines\n")
    with two_hosts(rails=1) as hosts:
        a_host, b_host = hosts
        if variant == "tls":  # the guide's commands, run where the CA is kept
            script = moved(blocks["certs.sh"], hosts, tmp_path).replace(
                ".venv/bin/p2pxfer", " ".join(p2pxfer_cmd()))
            subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, check=True,
                           timeout=RUN_TIMEOUT, capture_output=True)
        # "open 2379 on the etcd host to the nodes"
        a_rules = firewall.replace("    tcp dport 7700 accept\n",
                                   "    tcp dport 7700 accept\n    tcp dport 2379 accept\n")
        nft(a_host, a_rules if variant == "etcd" else firewall)
        # B first without the fabric's ports (the token variant): the guide's
        # rules minus that one.
        closed_first = variant == "token"
        nft(b_host, firewall.replace(f"    tcp dport {low}-{high} accept\n", "")
            if closed_first else firewall)
        daemons: list[DaemonProc] = []
        with etcd_if(variant, a_host, tmp_path):
            try:
                for host, name in ((a_host, "node-a"), (b_host, "node-b")):
                    daemons.append(spawn_daemon(
                        tmp_path, config(name, variant, blocks, hosts, tmp_path),
                        host.exec_argv))
                a, b = daemons
                for d in daemons:
                    assert all(low <= p <= high for p in rail_ports(d)), d.status()["rails"]
                    assert d.status()["credentials"] == ("tls+token" if variant == "tls"
                                                         else "token")
                if closed_first:
                    b_port = rail_ports(b)[0]
                    closed = ping(a, "node-b")
                    assert closed.returncode == 1, closed.stdout + closed.stderr
                    assert "write over peer rail" in closed.stderr, closed.stderr
                    assert (f"tcp port {b_port} on {b_host.addresses[0]} does not answer"
                            in closed.stderr), closed.stderr
                    # The guide's firewall on B too.
                    subprocess.run(b_host.exec_argv(["nft", "delete", "table", "inet",
                                                     "p2pxfer"]), check=True, timeout=10)
                    nft(b_host, firewall)
                for src, peer in ((a, "node-b"), (b, "node-a")):  # the pair works both ways
                    r = ping(src, peer, timeout=20)  # generous: a busy host is slow, not broken
                    assert r.returncode == 0, r.stdout + r.stderr + src.log_tail()
                    assert f"reaches {peer} over 1 rail(s), every byte checked" in r.stdout
            finally:
                for d in daemons:
                    d.stop()


def test_fabric_ports_too_few_for_the_rails(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("a secret\n")
    with two_hosts(rails=2) as (a_host, _):
        r = subprocess.run(a_host.exec_argv([
            *p2pxfer_cmd(), "daemon", "--node", "a", "--socket", str(tmp_path / "a.sock"),
            "--control", f"{a_host.addresses[0]}:7700", "--fabric-node", "",
            "--token-file", str(tmp_path / "token"), "--fabric-ports", "7500-7500"]),
            capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
            stdin=subprocess.DEVNULL)
    assert r.returncode == 78, r.stderr
    assert "fabric_ports 7500-7500 has 1 port for" in r.stderr, r.stderr
    for dev in a_host.interfaces:
        assert dev in r.stderr, r.stderr
