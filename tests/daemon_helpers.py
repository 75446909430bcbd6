"""Helpers for the daemon tests: daemons in their own processes, client
"agents" in their own processes, raw-socket access, and seeded transfer plans.

Daemons run as ``p2pxfer daemon --config FILE`` subprocesses with a TOML file
written next to their socket; tcp daemons always bind the fabric to 127.0.0.1.
Agents are spawned (never forked: libfabric and trio state must not be
inherited) and run one client, under trio or asyncio, driven by commands over
a pipe; every wait on either side is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

LOOPBACK = "127.0.0.1"
START_TIMEOUT = 20.0  # a daemon's socket must accept within this
STOP_TIMEOUT = 5.0  # SIGINT, then SIGKILL after this
OP_TIMEOUT = 30.0  # one agent command (inside the agent)
CALL_TIMEOUT = 40.0  # the parent's wait for an agent's reply


# -- processes ------------------------------------------------------------------

def p2pxfer_cmd() -> list[str]:
    """The ``p2pxfer`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "p2pxfer"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "p2pxfer"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
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
            reply = c.request({"t": "status", "id": 1})
            assert reply["t"] == "ok", reply
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
            raise AssertionError(f"daemon {d.name} exited with {d.proc.returncode} before "
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
            raise AssertionError(f"daemon {d.name} did not accept on {d.socket} within "
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
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


# -- seeded transfer plans --------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """``pieces`` pieces of ``min_len..max_len`` bytes at random non-overlapping
    destinations of a ``region``-byte region, sources packed in random order in a
    source buffer; everything derived from ``seed`` so both ends agree."""

    seed: int
    pieces: int = 4096
    min_len: int = 4 << 10
    max_len: int = 64 << 10
    region: int = 192 << 20

    def columns(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                               npt.NDArray[np.int64]]:
        rng = np.random.default_rng([self.seed, 1])
        n = self.pieces
        length = rng.integers(self.min_len, self.max_len + 1, n, dtype=np.int64)
        length[0], length[-1] = self.min_len, self.max_len
        slack = self.region - int(length.sum())
        assert slack > 0, "pieces do not fit the region"
        gap = np.sort(rng.integers(0, slack + 1, n, dtype=np.int64))
        gap[-1] = slack  # the last piece ends at the region's very end
        dst = gap + np.cumsum(length) - length
        order = rng.permutation(n)
        length, dst = length[order], dst[order]
        src_order = rng.permutation(n)
        src = np.empty(n, np.int64)
        src[src_order] = np.cumsum(length[src_order]) - length[src_order]
        return src, dst, length

    def scatter(self) -> Any:
        from p2pxfer.scatter import ScatterList

        return ScatterList(*self.columns())

    @property
    def source_size(self) -> int:
        return int(self.columns()[2].sum())

    def source(self) -> npt.NDArray[np.uint8]:
        rng = np.random.default_rng([self.seed, 2])
        return np.frombuffer(rng.bytes(self.source_size), np.uint8)

    def expected(self) -> npt.NDArray[np.uint8]:
        src, dst, length = self.columns()
        source = self.source()
        image = np.zeros(self.region, np.uint8)
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
            image[d:d + n] = source[s:s + n]
        return image


def describe_mismatch(got: npt.NDArray[np.uint8], want: npt.NDArray[np.uint8]) -> str:
    bad = np.flatnonzero(got != want)
    lines = [f"{len(bad)} of {len(want)} bytes differ"]
    lines += [f"  offset {o}: got {int(got[o])}, want {int(want[o])}" for o in bad[:5].tolist()]
    return "\n".join(lines)


# -- agents: one client in its own process ------------------------------------------

def agent_main(flavor: str, socket_path: str, conn: Connection) -> None:
    """Entry point of an agent process: one client under ``flavor`` ("trio"
    or "asyncio"), answering commands from ``conn`` until "exit" or EOF."""
    try:
        if flavor == "trio":
            import trio

            trio.run(_agent, socket_path, conn)
        elif flavor == "asyncio":
            asyncio.run(_agent(socket_path, conn))
        else:
            raise ValueError(flavor)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


async def _agent(socket_path: str, conn: Connection) -> None:

    import p2pxfer
    from p2pxfer.errors import P2PXferError

    async def recv() -> Any:
        while True:
            if await anyio.to_thread.run_sync(conn.poll, 0.2):
                try:
                    return conn.recv()
                except EOFError:
                    return ("exit",)

    mems: dict[str, Any] = {}
    async with p2pxfer.connect(socket_path) as client:
        conn.send(("ok", {"node": client.node, "flavor": _flavor()}))
        while True:
            cmd = await recv()
            op, args = cmd[0], cmd[1:]
            if op == "exit":
                break
            try:
                # A loop runs until killed; each of its writes is bounded instead.
                with anyio.fail_after(None if op == "loop" else OP_TIMEOUT):
                    reply = await _do(client, mems, conn, op, *args)
            except P2PXferError as exc:
                reply = ("raised", type(exc).__name__, getattr(exc, "code", None), str(exc))
            except Exception:
                reply = ("error", traceback.format_exc())
            conn.send(reply)
        for mem in mems.values():
            mem.close()
        mems.clear()


def _flavor() -> str:
    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        return "trio"


async def _do(client: Any, mems: dict[str, Any], conn: Connection, op: str,
              *args: Any) -> tuple[Any, ...]:
    if op == "export":  # name, size: alloc zeroed shared memory and export it whole
        name, size = args
        mem = mems[name] = await client.alloc(size, name)
        desc = await client.export(name, mem)
        return ("ok", desc.length)
    if op == "write":  # peer, region, plan, imm: write the plan from a fresh source
        peer, region, plan, imm = args
        src = await _source(client, mems, plan)
        pieces = await client.write(peer, region, plan.scatter(), src=src, imm=imm)
        return ("ok", pieces)
    if op == "loop":  # like write, forever (until killed); reports after the first
        peer, region, plan, imm = args
        src = await _source(client, mems, plan)
        scatter = plan.scatter()
        await client.write(peer, region, scatter, src=src, imm=imm)
        conn.send(("ok", "looping"))
        while True:
            with anyio.fail_after(OP_TIMEOUT):
                await client.write(peer, region, scatter, src=src, imm=imm)
    if op == "verify":  # region, plan, imm, pieces: wait for the pieces, check every byte
        region, plan, imm, pieces = args
        await client.wait_imm(imm, pieces)
        want = plan.expected()
        if not np.array_equal(mems[region].array, want):
            return ("mismatch", describe_mismatch(mems[region].array, want))
        return ("ok", int(want.astype(bool).sum()))
    if op == "status":
        return ("ok", await client.status())
    if op == "add_peer":
        await client.add_peer(*args)
        return ("ok", None)
    raise ValueError(f"unknown agent command {op!r}")


async def _source(client: Any, mems: dict[str, Any], plan: Plan) -> Any:
    key = f"src-{plan.seed}"
    if key not in mems:
        mem = await client.alloc(plan.source_size, key)
        mem.array[:] = plan.source()
        mems[key] = mem
    return mems[key]


class Agent:
    """The parent's handle on an agent process."""

    def __init__(self, flavor: str, socket_path: str, name: str = "agent", *,
                 wait: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=agent_main, args=(flavor, socket_path, child),
                                name=f"p2pxfer-{name}", daemon=True)
        self.proc.start()
        child.close()
        self.name = name
        self.hello: dict[str, Any] = {}
        if wait:
            self.ready()

    def ready(self) -> Agent:
        """Wait until the agent has connected (its hello: node and flavor)."""
        if not self.hello:
            self.hello = self._reply(START_TIMEOUT, "connect")[1]
        return self

    def _reply(self, timeout: float, what: str) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.name}: no reply to {what} within {timeout} s "
                                 f"(alive: {self.proc.is_alive()})")
        try:
            reply = self.conn.recv()
        except EOFError:
            raise AssertionError(f"{self.name} died during {what} "
                                 f"(exit {self.proc.exitcode})") from None
        if reply[0] == "error":
            raise AssertionError(f"{self.name} failed in {what}:\n{reply[1]}")
        return tuple(reply)

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def call(self, *cmd: Any, timeout: float = CALL_TIMEOUT) -> tuple[Any, ...]:
        self.send(*cmd)
        return self._reply(timeout, repr(cmd[0]))

    def ok(self, *cmd: Any, timeout: float = CALL_TIMEOUT) -> Any:
        reply = self.call(*cmd, timeout=timeout)
        if reply[0] != "ok":
            raise AssertionError(f"{self.name}: {cmd[0]!r} answered {reply!r}")
        return reply[1]

    def wait_reply(self, what: str, timeout: float = CALL_TIMEOUT) -> tuple[Any, ...]:
        return self._reply(timeout, what)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(STOP_TIMEOUT)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(STOP_TIMEOUT)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(STOP_TIMEOUT)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


# -- raw unix-socket access ---------------------------------------------------------

class RawConn:
    """A bare unix-socket connection to a daemon, frames decoded with the
    protocol's FrameDecoder; every read has a timeout."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        from p2pxfer.protocol import FrameDecoder

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
        from p2pxfer.protocol import encode_frame

        self.send_raw(encode_frame(obj, 1 << 30), fds)

    def hello(self) -> dict[str, Any]:
        from p2pxfer.protocol import SCHEMA_VERSION

        self.send({"t": "hello", "v": SCHEMA_VERSION, "role": "client"})
        reply = self.frame()
        assert reply is not None and reply["t"] == "welcome", reply
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
        assert reply is not None, f"connection closed instead of answering {obj!r}"
        return reply

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
