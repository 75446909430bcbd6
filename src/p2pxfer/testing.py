"""Running real daemons from tests and benches: ``start_daemon`` /
``spawn_daemon`` write a TOML config and start ``p2pxfer daemon --config``
in a subprocess (tcp daemons bind the fabric to 127.0.0.1), returning once
its socket accepts; ``DaemonProc`` stops it (SIGINT, then SIGKILL) and reads
its status over ``RawConn``, a bare unix-socket connection. Every wait is
bounded. ``DriverArray``: device memory from the CUDA driver itself (no
torch, no CuPy), for GPU tests and benches. What must not live here:
anything the daemon itself runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import P2PXferError
from p2pxfer.protocol import SCHEMA_VERSION, FrameDecoder, encode_frame

__all__ = [
    "LOOPBACK",
    "NO_ETCD",
    "START_TIMEOUT",
    "STOP_TIMEOUT",
    "DaemonProc",
    "DriverArray",
    "LaunchError",
    "RawConn",
    "etcd_in",
    "free_port",
    "p2pxfer_cmd",
    "scatter_at_random",
    "spawn_daemon",
    "start_daemon",
    "toml_value",
    "wait_accepting",
    "wait_for",
    "write_config",
]

LOOPBACK = "127.0.0.1"
START_TIMEOUT = 20.0  # a daemon's socket must accept within this
STOP_TIMEOUT = 5.0  # SIGINT, then SIGKILL after this


class LaunchError(P2PXferError, AssertionError):
    """A daemon did not start, answer or stop as expected (an
    ``AssertionError`` too, so a test that meets one fails rather than errs)."""


I64 = npt.NDArray[np.int64]


def scatter_at_random(rng: np.random.Generator, length: I64, region: int, *,
                      to_end: bool = False) -> tuple[I64, I64, I64]:
    """Pieces of ``length`` bytes at random, non-overlapping places of a
    ``region``-byte destination, in random order, their sources packed in
    another random order: ``(src, dst, length)``. ``to_end``: the last of
    them ends at the region's very end. For tests' and benches' scatter
    lists (one numpy pass, whatever the number of pieces)."""
    slack = region - int(length.sum())
    if slack < 0:
        raise ValueError(f"{int(length.sum())} bytes of pieces do not fit {region} bytes")
    gap = np.sort(rng.integers(0, slack + 1, len(length), dtype=np.int64))
    if to_end and len(gap):
        gap[-1] = slack
    dst = gap + np.cumsum(length) - length
    order = rng.permutation(len(length))
    length, dst = length[order], dst[order]
    src_order = rng.permutation(len(length))
    src = np.empty(len(length), np.int64)
    src[src_order] = np.cumsum(length[src_order]) - length[src_order]
    return src, dst, length


def p2pxfer_cmd() -> list[str]:
    """The ``p2pxfer`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "p2pxfer"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "p2pxfer"]


#: the lowest port ``free_port`` hands out
PORTS_FROM = 10000
_cursor: list[int] = []  # this process's next port to try


def _port_window() -> tuple[int, int] | None:
    """Where ``free_port`` looks: below the kernel's ephemeral range, which
    every outgoing connection and ``bind(0)`` draw from (a port found free
    there can be taken by any connection before the daemon binds it), one
    slice per pytest-xdist worker. None where there is no room."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    size = (low - PORTS_FROM) // workers
    if size < 1000:
        return None
    first = PORTS_FROM + (int(worker) % workers if worker.isdigit() else 0) * size
    return first, first + size


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from outside the
    kernel's ephemeral range (``_port_window``): only another test could
    take it before it is bound, and tests in other workers look elsewhere."""
    window = _port_window()
    if window is not None:
        lo, hi = window
        if not _cursor:  # processes of one worker start apart
            _cursor.append(lo + (os.getpid() * 7919) % (hi - lo))
        for i in range(hi - lo):
            port = lo + (_cursor[0] - lo + i) % (hi - lo)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((LOOPBACK, port))
                except OSError:
                    continue
            _cursor[0] = port + 1 if port + 1 < hi else lo
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # "3.0", "0.25": TOML floats
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML for {v!r}")


def write_config(path: Path, keys: dict[str, Any]) -> Path:
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()))
    return path


@dataclass
class DaemonProc:
    """A ``p2pxfer daemon`` subprocess."""

    name: str
    socket: str
    control: str
    config: Path
    log: Path
    proc: subprocess.Popen[bytes]
    keys: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        """The daemon's status, over a raw connection (every read bounded)."""
        with RawConn(self.socket, timeout) as c:
            c.hello()
            try:
                reply = c.request({"t": "status", "id": 1})
            except LaunchError as exc:
                # Said here, with what the daemon said last: the report of a
                # long test may keep only its first lines.
                time.sleep(0.2)  # a dying daemon's exit status and last words
                raise LaunchError(f"daemon {self.name} (alive: {self.alive()}, exit: "
                                  f"{self.proc.returncode}): {exc}\n{self.log_tail(25)}"
                                  ) from None
            if reply["t"] != "ok":
                raise LaunchError(f"daemon {self.name} answered status with {reply!r:.300}")
            return dict(reply["result"])

    def stop(self) -> int:
        """SIGINT (the daemon's clean shutdown), then SIGKILL; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        return int(self.proc.returncode)


def start_daemon(workdir: Path, name: str, *, provider: str = "tcp;ofi_rxm",
                 control_port: int = 0, peers: list[dict[str, str]] | None = None,
                 **extra: Any) -> DaemonProc:
    """Write ``workdir/NAME.toml`` and start a daemon on it; returns once its
    socket accepts connections (bounded)."""
    sock = str(workdir / f"{name}.sock")
    keys: dict[str, Any] = {
        "node": name,
        "socket": sock,
        "control": f"{LOOPBACK}:{control_port}",
        "provider": provider,
        # tcp stays on loopback; shm takes no address.
        "fabric_node": LOOPBACK if provider.startswith("tcp") else "",
        "log_level": "INFO",
        **extra,
    }
    if peers:
        keys["peers"] = peers
    return spawn_daemon(workdir, keys)


def spawn_daemon(workdir: Path, keys: dict[str, Any],
                 wrap: Callable[[list[str]], list[str]] = list) -> DaemonProc:
    """Write ``workdir/NODE.toml`` from ``keys`` and run ``p2pxfer daemon`` on
    it (``wrap`` turns the command line into another, e.g. one run inside a
    network namespace); its output goes to ``NODE.log`` (appended: a restart
    keeps the earlier life's). Returns once its socket accepts (bounded)."""
    name = keys["node"]
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = write_config(workdir / f"{name}.toml", keys)
    log = workdir / f"{name}.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen(wrap([*p2pxfer_cmd(), "daemon", "--config", str(cfg)]),
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
    d = DaemonProc(name, keys["socket"], keys["control"], cfg, log, proc, keys)
    try:
        wait_accepting(d)
    except BaseException:
        d.stop()
        raise
    return d


def wait_accepting(d: DaemonProc, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not d.alive():
            raise LaunchError(f"daemon {d.name} exited with {d.proc.returncode} before "
                                 f"accepting:\n{d.log_tail()}")
        if os.path.exists(d.socket):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                try:
                    s.connect(d.socket)
                    return
                except OSError:
                    pass
        if time.monotonic() > deadline:
            raise LaunchError(f"daemon {d.name} did not accept on {d.socket} within "
                                 f"{timeout} s:\n{d.log_tail()}")
        time.sleep(0.05)


def wait_for(pred: Any, what: str, timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll ``pred()`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise LaunchError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


class RawConn:
    """A bare unix-socket connection to a daemon, frames decoded with the
    protocol's FrameDecoder; every read has a timeout."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.decoder = FrameDecoder(1 << 30)
        self.eof = False

    def send_raw(self, data: bytes, fds: list[int] | None = None) -> None:
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)

    def send(self, obj: dict[str, Any], fds: list[int] | None = None) -> None:
        self.send_raw(encode_frame(obj, 1 << 30), fds)

    def hello(self) -> dict[str, Any]:
        self.send({"t": "hello", "v": SCHEMA_VERSION, "role": "client"})
        reply = self.frame()
        if reply is None or reply["t"] != "welcome":
            raise LaunchError(f"the daemon answered hello with {reply!r:.300}")
        return reply

    def frame(self) -> dict[str, Any] | None:
        """The next frame, or None at end of stream (or a reset)."""
        while (obj := self.decoder.next_frame()) is None:
            if self.eof:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
            else:
                self.decoder.feed(data)
        return obj

    def closed_by_peer(self) -> bool:
        """True once the daemon has closed its end (no more frames)."""
        return self.frame() is None

    def request(self, obj: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        self.send(obj, fds)
        reply = self.frame()
        if reply is None:
            raise LaunchError(f"connection closed instead of answering {obj!r:.300}")
        return reply

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NO_ETCD = "no etcd binary on PATH (Debian: apt-get install etcd-server)"
# Run inside etcd's namespace: waits (bounded) until etcd answers /health.
ETCD_PROBE = """\
import sys, time, httpx
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.1)
sys.exit(1)
"""


@contextmanager
def etcd_in(host: Any, workdir: Path, timeout: float = 20.0) -> Iterator[str]:
    """A one-member etcd inside ``host``'s namespace, listening on its lan
    address only (client port 2379, peer 2380), data in ``workdir/data``; its
    client URL. Killed, and its data removed, on the way out whatever happens."""
    binary = shutil.which("etcd")
    if binary is None:
        raise LaunchError(NO_ETCD)
    addr = host.addresses[0]
    url, peer = f"http://{addr}:2379", f"http://{addr}:2380"
    data = workdir / "data"
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "etcd.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen(
            host.exec_argv([binary, "--name", "lan", "--data-dir", str(data),
                            "--listen-client-urls", url, "--advertise-client-urls", url,
                            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                            "--initial-cluster", f"lan={peer}"]),
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        probe = subprocess.run(host.exec_argv([sys.executable, "-c", ETCD_PROBE, url,
                                               str(timeout)]),
                               capture_output=True, text=True, timeout=timeout + 10,
                               check=False)
        if probe.returncode != 0 or proc.poll() is not None:
            raise LaunchError(f"etcd did not start in {host.ns}: {probe.stderr[-1000:]}"
                               + log.read_text(errors="replace")[-2000:])
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


class DriverArray:
    """``nbytes`` from ``cuMemAlloc``, described by ``__cuda_array_interface__``."""

    def __init__(self, nbytes: int) -> None:
        from p2pxfer.devmem import driver  # only here: loads the CUDA driver

        self.drv = driver()
        self.nbytes = nbytes
        self.address = self._alloc()
        self.stream = self.drv.stream(0)
        self.obj = self
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self.address, False),
            "version": 3, "strides": None}
        self.write(np.zeros(nbytes, np.uint8))  # cuMemAlloc leaves what was there

    def _alloc(self) -> int:
        return self.drv.alloc(self.nbytes, 0)

    def _free(self) -> None:
        self.drv.free(self.address, 0)

    def _copy(self, dst: int, src: int) -> None:
        one = np.zeros(1, np.int64)
        self.drv.copy(self.stream, 0, dst, src, one, one, np.array([self.nbytes], np.int64))
        self.drv.stream_sync(self.stream, 0)

    def read(self) -> npt.NDArray[np.uint8]:
        out = np.empty(self.nbytes, np.uint8)
        self._copy(out.ctypes.data, self.address)
        return out

    def write(self, data: npt.NDArray[np.uint8]) -> None:
        src = np.ascontiguousarray(data, np.uint8)
        assert src.nbytes == self.nbytes
        self._copy(self.address, src.ctypes.data)

    def close(self) -> None:
        self.drv.stream_destroy(self.stream, 0)
        self._free()
