"""deploy/: the systemd unit passes ``systemd-analyze verify`` and its own
command line runs the daemon with its config path under a temporary root; the
Kubernetes manifests pass ``kubernetes-validate`` (strict) and agree with the
daemon's config; the Containerfile installs packages this Debian knows."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import (
    LOOPBACK,
    DaemonProc,
    free_port,
    p2pxfer_cmd,
    toml_value,
    wait_accepting,
)
from p2pxfer.daemon import DaemonConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "p2pxfer.service"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
K8S_VERSION = "1.29.0"  # the oldest release we support; validated strict
TOOL_TIMEOUT = 120.0


def unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    return parser


def test_unit_verifies(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (deploy/setup.sh installs systemd)")
    # verify insists that ExecStart's program exists: point it at this
    # environment's p2pxfer; every other line is checked as written.
    text = UNIT.read_text()
    program = shlex.split(unit()["Service"]["ExecStart"])[0]
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(program, p2pxfer_cmd()[0]))
    proc = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT, check=False)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr + proc.stdout


def test_unit_hardening() -> None:
    svc = unit()["Service"]
    assert svc["LimitMEMLOCK"] == "infinity"
    assert svc["Restart"] == "on-failure"
    assert svc["RuntimeDirectory"] == "p2pxfer"
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["User"] != "root"
    assert "78" in svc["RestartPreventExitStatus"].split()
    # The installed config's socket lives in the RuntimeDirectory.
    argv = shlex.split(svc["ExecStart"])
    assert argv[1:3] == ["daemon", "--config"]
    cfg = DaemonConfig.from_toml(DEPLOY / "p2pxfer.toml")
    assert Path(cfg.socket).parent == Path("/run") / svc["RuntimeDirectory"]


def test_unit_command_line_runs(tmp_path: Path) -> None:
    """ExecStart as written, its absolute paths moved under a temporary root;
    the config is deploy/p2pxfer.toml installed there (its socket moved the
    same way, its ports made free, the fabric kept on loopback). The daemon
    comes up, answers status, and stops cleanly on the unit's KillSignal."""
    svc = unit()["Service"]
    argv = shlex.split(svc["ExecStart"])
    rooted = [str(tmp_path / a.lstrip("/")) if a.startswith("/") else a for a in argv[1:]]
    config_path = Path(rooted[rooted.index("--config") + 1])
    keys: dict[str, Any] = tomllib.loads((DEPLOY / "p2pxfer.toml").read_text())
    keys["socket"] = str(tmp_path / keys["socket"].lstrip("/"))
    keys["control"] = f"{LOOPBACK}:{free_port()}"
    keys["fabric_node"] = LOOPBACK
    peers = keys.pop("peers", [])
    config_path.parent.mkdir(parents=True)
    (tmp_path / "run" / svc["RuntimeDirectory"]).mkdir(parents=True)  # what systemd makes
    config_path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()) +
                           "".join(f"[[peers]]\nname = {toml_value(p['name'])}\n"
                                   f"address = {toml_value(p['address'])}\n" for p in peers))
    log = tmp_path / "daemon.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen([*p2pxfer_cmd(), *rooted], stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT)
    d = DaemonProc(keys["node"], keys["socket"], keys["control"], config_path, log, proc, keys)
    try:
        wait_accepting(d)
        st = d.status()
        assert st["node"] == keys["node"] and st["socket"] == keys["socket"]
        assert [p["name"] for p in st["peers"]] == [p["name"] for p in peers]
        proc.send_signal(getattr(signal, svc["KillSignal"]))
        assert proc.wait(10) == 0, d.log_tail()
    finally:
        d.stop()


def _kubernetes_validate(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[dev]')")
    tool = str(Path(sys.executable).parent / "kubernetes-validate")
    return subprocess.run([tool, "--strict", "-k", K8S_VERSION, *args], capture_output=True,
                          text=True, timeout=TOOL_TIMEOUT, check=False)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(manifest: Path) -> None:
    proc = _kubernetes_validate(str(manifest))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_validator_catches_mistakes(tmp_path: Path) -> None:
    """The validation can fail: a misspelt field in the DaemonSet is refused."""
    bad = tmp_path / "bad.yaml"
    bad.write_text((DEPLOY / "k8s" / "p2pxfer.yaml").read_text()
                   .replace("hostNetwork: true", "hostNetwrk: true"))
    proc = _kubernetes_validate(str(bad))
    assert proc.returncode != 0 and "hostNetwrk" in proc.stdout + proc.stderr


def test_daemonset_matches_the_daemon(tmp_path: Path) -> None:
    """The ConfigMap's TOML is a valid config, the flags are the daemon's, and
    the socket the config names is in the hostPath the probes use."""
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "p2pxfer.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs if d}
    toml_text = by_kind["ConfigMap"]["data"]["p2pxfer.toml"]
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    cfg = DaemonConfig.load(None, **tomllib.loads(toml_text), cluster_token_file=str(token))
    assert cfg.membership == "etcd"
    pod = by_kind["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    container = pod["containers"][0]
    args = container["args"]
    from p2pxfer.cli import daemon

    flags = {opt for p in daemon.params for opt in p.opts}
    assert {a for a in args if a.startswith("--")} <= flags
    socket_dir = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == "socket")
    assert str(Path(cfg.socket).parent) == socket_dir
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[1] == "status" and cfg.socket in probe
    # the daemon runs unprivileged; only the init container (chown of the
    # hostPath) is root
    assert container["securityContext"]["runAsNonRoot"] is True
    (init,) = pod["initContainers"]
    assert init["command"][-1] == socket_dir


def test_containerfile_packages_exist() -> None:
    apt = shutil.which("apt-cache")
    if apt is None:
        pytest.skip("apt-cache is not here (not a Debian machine)")
    text = (DEPLOY / "Containerfile").read_text()
    assert re.search(r"^FROM \S*debian:12", text, re.M)
    assert re.search(r"^USER (?!0\b|root\b)", text, re.M), "the image must not run as root"
    packages = set()
    for block in re.findall(r"apt-get install -y --no-install-recommends \\\n(.*?)\\\n",
                            text, re.S):
        packages |= set(block.split())
    assert {"libfabric1", "python3"} <= packages
    proc = subprocess.run([apt, "show", *sorted(packages)], capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stderr
