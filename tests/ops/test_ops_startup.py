"""Every startup failure is one line on stderr naming what failed and where
(key, file, port, path, host), with a non-zero exit code and no traceback
unless ``--debug``."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon_helpers import LOOPBACK, p2pxfer_cmd, start_daemon
from p2pxfer._startup import one_line
from p2pxfer.cli import main
from p2pxfer.daemon import DaemonConfig
from p2pxfer.errors import StartupError

RUN_TIMEOUT = 60.0


def run_daemon(*args: str) -> tuple[int, list[str]]:
    """``p2pxfer daemon ARGS`` expected to fail: its exit code and stderr lines."""
    proc = subprocess.run([*p2pxfer_cmd(), "daemon", *args], check=False,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, f"daemon started instead of failing:\n{proc.stderr}"
    return proc.returncode, [ln for ln in proc.stderr.splitlines() if ln.strip()]


def one_error(lines: list[str], *names: str) -> None:
    assert len(lines) == 1, "\n".join(lines)
    assert "Traceback" not in lines[0]
    for name in names:
        assert name in lines[0], lines[0]


def base(tmp_path: Path) -> list[str]:
    return ["--node", "a", "--socket", str(tmp_path / "a.sock"), "--fabric-node", LOOPBACK]


@pytest.mark.parametrize(("line", "names"), [
    ('log_level = "LOUD"', ["log_level", "LOUD"]),
    ("node = 5", ["node", "5"]),
    ('allowed_uids = ["root"]', ["allowed_uids", "root"]),
    ("max_frame = true", ["max_frame", "integer"]),
    ('peers = "node-b"', ["peers", "node-b", "[[peers]]"]),
    ('socket = ""', ["socket", "empty"]),
    ('control = "nope"', ["control", "nope"]),
])
def test_config_error_one_line(tmp_path: Path, line: str, names: list[str]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(line + "\n")
    rc, lines = run_daemon("--config", str(cfg))
    assert rc == 78  # EX_CONFIG: the systemd unit does not restart on it
    one_error(lines, str(cfg), *names)


def test_missing_config_file(tmp_path: Path) -> None:
    _, lines = run_daemon("--config", str(tmp_path / "nope.toml"))
    one_error(lines, "nope.toml", "No such file")


def test_control_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        port = s.getsockname()[1]
        _, lines = run_daemon(*base(tmp_path), "--control", f"{LOOPBACK}:{port}")
    one_error(lines, "control port", f"{LOOPBACK}:{port}", "in use")


def test_metrics_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        port = s.getsockname()[1]
        _, lines = run_daemon(*base(tmp_path), "--metrics", f"{LOOPBACK}:{port}")
    one_error(lines, "metrics port", f"{LOOPBACK}:{port}")


def test_socket_directory_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    _, lines = run_daemon("--node", "a", "--socket", str(blocker / "sub" / "a.sock"))
    one_error(lines, "socket directory", str(blocker / "sub"))


def test_socket_directory_not_writable(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process: as root every directory is writable, so the check is made to
    # see what a service user would.
    real = os.access
    target = str(tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "access",
                        lambda p, mode: False if str(p) == target else real(p, mode))
    result = CliRunner().invoke(main, ["daemon", "--node", "a", "--socket", target + "/a.sock"])
    assert result.exit_code == 1
    one_error(result.output.strip().splitlines(), "socket directory", target, "not writable")


def test_socket_path_too_long(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 120) / "a.sock"
    _, lines = run_daemon("--node", "a", "--socket", str(path))
    one_error(lines, "socket path", "107 bytes")


def test_socket_held_by_another_daemon(tmp_path: Path) -> None:
    first = start_daemon(tmp_path, "first")
    try:
        _, lines = run_daemon("--node", "second", "--socket", first.socket,
                              "--fabric-node", LOOPBACK)
        one_error(lines, first.socket, "another daemon")
        assert first.alive()
    finally:
        first.stop()


def test_unknown_provider(tmp_path: Path) -> None:
    _, lines = run_daemon(*base(tmp_path), "--provider", "no-such-provider")
    one_error(lines, "no-such-provider")


def test_unresolvable_control_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process with a resolver that fails: no name lookup leaves this machine.
    def no_dns(host: str, *args: object, **kw: object) -> object:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    result = CliRunner().invoke(main, ["daemon", *base(tmp_path),
                                       "--control", "ghost.invalid:7700"])
    assert result.exit_code == 1
    one_error(result.output.strip().splitlines(), "control host", "ghost.invalid")


def test_debug_shows_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("node = 5\n")
    proc = subprocess.run([*p2pxfer_cmd(), "daemon", "--debug", "--config", str(cfg)],
                          check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_demo_page_size_zero() -> None:
    result = CliRunner().invoke(main, ["demo", "--page-size", "0"])
    assert result.exit_code == 2
    assert "size must be > 0, got '0'" in result.output
    assert not isinstance(result.exception, ZeroDivisionError)


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("p2pxfer ")


def test_failure_after_checks_is_one_line() -> None:
    """A failure the checks could not foresee (a port taken between the check
    and the bind) still comes out as one line, from inside trio's groups."""
    cfg = DaemonConfig.from_dict({"node": "a", "control": "127.0.0.1:7700"})
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [taken])])
    line = one_line(nested, cfg)
    assert "Address already in use" in line and "127.0.0.1:7700" in line
    ours = ExceptionGroup("g", [OSError(errno.EPIPE, "Broken pipe"),
                                StartupError("metrics port", "127.0.0.1:1", "in use")])
    assert one_line(ours, cfg) == "metrics port 127.0.0.1:1: in use"
    line = one_line(ExceptionGroup("g", [RuntimeError("boom")]), cfg)
    assert "RuntimeError: boom" in line and "--debug" in line and "\n" not in line

