"""Helpers for the daemon tests: client "agents" in their own processes and
seeded transfer plans; daemons in their own processes and raw-socket access
come from ``p2pxfer.testing``.

Agents are spawned (never forked: libfabric and trio state must not be
inherited) and run one client, under trio or asyncio, driven by commands over
a pipe; every wait on either side is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import SCHEMA_VERSION, FrameDecoder, encode_frame
from p2pxfer.protocol._frames import FrameMac
from p2pxfer.testing import (
    LOOPBACK,
    START_TIMEOUT,
    STOP_TIMEOUT,
    DaemonProc,
    RawConn,
    free_port,
    p2pxfer_cmd,
    scatter_at_random,
    spawn_daemon,
    start_daemon,
    toml_value,
    wait_accepting,
    wait_for,
    write_config,
)

# The daemon launcher lives in ``p2pxfer.testing`` (benches use it too); the
# tests import it from here as before.
__all__ = [
    "LOOPBACK",
    "START_TIMEOUT",
    "STOP_TIMEOUT",
    "Agent",
    "DaemonProc",
    "Plan",
    "RawConn",
    "as_uid",
    "describe_mismatch",
    "free_port",
    "p2pxfer_cmd",
    "shared_mem",
    "spawn_daemon",
    "start_daemon",
    "toml_value",
    "wait_accepting",
    "wait_for",
    "write_config",
]

OP_TIMEOUT = 30.0  # one agent command (inside the agent)
CALL_TIMEOUT = 40.0  # the parent's wait for an agent's reply


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
        assert self.region > int(length.sum()), "pieces do not fit the region"
        return scatter_at_random(rng, length, self.region, to_end=True)

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
    if op == "write":  # peer, region, plan, imm[, notify]: write the plan from a fresh source
        peer, region, plan, imm, *notify = args
        src = await _source(client, mems, plan)
        pieces = await client.write(peer, region, plan.scatter(), src=src, imm=imm,
                                    notify=bool(notify and notify[0]))
        return ("ok", pieces)
    if op == "loop":  # like write, forever (until killed); reports after the first
        peer, region, plan, imm, *notify = args
        src = await _source(client, mems, plan)
        scatter = plan.scatter()
        once = bool(notify and notify[0])
        await client.write(peer, region, scatter, src=src, imm=imm, notify=once)
        conn.send(("ok", "looping"))
        while True:
            with anyio.fail_after(OP_TIMEOUT):
                await client.write(peer, region, scatter, src=src, imm=imm, notify=once)
    if op == "verify":  # region, plan, imm, pieces: wait for the pieces, check every byte
        region, plan, imm, pieces = args
        await client.wait_imm(imm, pieces)
        want = plan.expected()
        if not np.array_equal(mems[region].array, want):
            return ("mismatch", describe_mismatch(mems[region].array, want))
        return ("ok", int(want.astype(bool).sum()))
    if op == "nonzero":  # region: how many of its bytes are not zero, and the first few
        (region,) = args
        where = np.flatnonzero(mems[region].array)
        return ("ok", int(where.size), where[:5].tolist())
    if op == "digest":  # region: a hash of every byte (what changed, wherever it changed)
        (region,) = args
        return ("ok", hashlib.sha256(mems[region].array).hexdigest())
    if op == "unexport":  # region
        (region,) = args
        await client.unexport(region)
        return ("ok", None)
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


class RawControl:
    """A hand-driven TCP connection to a daemon's control port (MACs too, once
    told the keys)."""

    def __init__(self, address: str, *, silence_closes: bool = False) -> None:
        #: a read that times out counts as the daemon hanging up (tests that
        #: only care whether a frame ever comes), else TimeoutError is raised
        self.silence_closes = silence_closes
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.decoder = FrameDecoder(1 << 24)
        self.send_mac: FrameMac | None = None

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(obj, 1 << 24, self.send_mac))

    def frame(self) -> dict[str, Any] | None:
        while (obj := self.decoder.next_frame()) is None:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            except TimeoutError:
                if not self.silence_closes:
                    raise
                data = b""
            if not data:
                return None
            self.decoder.feed(data)
        return obj

    def request(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self.send(obj)
        return self.frame()

    def hello(self, name: str = "intruder", **fields: Any) -> dict[str, Any]:
        reply = self.request({"t": "hello", "v": SCHEMA_VERSION, "role": "daemon",
                              "name": name, **fields})
        assert reply is not None and reply["t"] == "welcome", reply
        return reply

    def secure(self, send_key: bytes, receive_key: bytes) -> None:
        """MAC every frame from now on, as a daemon does after ``auth``."""
        self.send_mac = FrameMac(send_key)
        self.decoder.mac = FrameMac(receive_key)

    def authenticate(self, auth: ClusterAuth, name: str, node: str) -> None:
        mine = os.urandom(16)
        welcome = self.hello(name, nonce=mine, control=f"{LOOPBACK}:{free_port()}")
        self.send({"t": "auth", "id": 1, "proof": auth.connection_proof(
            "initiator", mine, welcome["nonce"], name)})
        send, receive = auth.session_keys(mine, welcome["nonce"], name, node)
        self.secure(send, receive)
        reply = self.frame()
        assert reply is not None and reply["t"] == "ok", reply

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def daemon_pair(workdir: Any, **keys: Any) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """Daemons node-a and node-b on loopback, each the other's static peer,
    both with config ``keys``; stopped on the way out."""
    port_a, port_b = free_port(), free_port()
    daemons: list[DaemonProc] = []
    try:
        daemons.append(start_daemon(workdir, "node-a", control_port=port_a, peers=[
            {"name": "node-b", "address": f"{LOOPBACK}:{port_b}"}], **keys))
        daemons.append(start_daemon(workdir, "node-b", control_port=port_b, peers=[
            {"name": "node-a", "address": f"{LOOPBACK}:{port_a}"}], **keys))
        yield daemons[0], daemons[1]
    finally:
        for d in daemons:
            d.stop()


def as_uid(uid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a forked child under ``uid``; its result (or what it
    raised, as ``("raised", "Type: text")``). Needs root."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out: Any = fn()
        except BaseException as exc:
            out = ("raised", f"{type(exc).__name__}: {exc}")
        os.write(w, pickle.dumps(out))
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return pickle.loads(data)


def shared_mem(c: RawConn, rid: int, size: int = 1 << 16) -> Any:
    """A fresh memfd of ``size`` shared over the raw connection ``c``
    (request id ``rid``): the daemon's handle for it."""
    fd = os.memfd_create("shared", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        return c.request({"t": "share", "id": rid, "size": size}, fds=[fd])["result"]["mem"]
    finally:
        os.close(fd)
