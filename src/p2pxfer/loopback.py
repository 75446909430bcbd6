"""A target in a second process on this machine, for demos, tests and benchmarks.

``LoopbackTarget`` spawns a process that opens an engine (``BlockingEngine``)
on loopback (``127.0.0.1`` for tcp, the shm provider within the node), exports
a zeroed region and answers requests over a pipe: wait for immediates, report
a digest of the region, stop. Real provider, real second process; nothing is
faked.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from types import TracebackType
from typing import Any, Self

import numpy as np

from p2pxfer.errors import P2PXferError, WaitTimeout
from p2pxfer.memory import RegionDescriptor

__all__ = ["LoopbackTarget", "digest", "loopback_node"]


def loopback_node(provider: str) -> str | None:
    """The bind address that keeps ``provider``'s traffic on this machine."""
    ip_based = provider.split(";", maxsplit=1)[0] in ("tcp", "sockets", "udp", "net")
    return "127.0.0.1" if ip_based else None


def digest(buf: Any) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def _serve(provider: str, nbytes: int, conn: Any) -> None:
    from p2pxfer.engine import BlockingEngine

    try:
        with BlockingEngine.open(provider, node=loopback_node(provider)) as t:
            region = np.zeros(nbytes, np.uint8)
            region.fill(0)  # fault the pages in now, not during the first transfer
            conn.send(("ready", t.export(region, "loopback").to_bytes()))
            while True:
                # The engine's poller thread progresses the CQ meanwhile (on
                # manual-progress providers writes land only while it does).
                msg = conn.recv()
                if msg[0] == "stop":
                    conn.send(("stopped",))
                    return
                if msg[0] == "wait":
                    _, imm, count, timeout = msg
                    t.wait_imm(imm, count, timeout=timeout)
                    conn.send(("done", digest(region)))
    except BaseException as exc:  # report to the parent instead of dying silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class LoopbackTarget:
    """A region of ``nbytes`` exported by a second process."""

    def __init__(self, provider: str, nbytes: int, *, start_timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(provider, nbytes, child), daemon=True)
        self._proc.start()
        reply = self._recv(start_timeout)
        self.descriptor = RegionDescriptor.from_bytes(reply[1])

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise WaitTimeout(f"loopback target did not answer within {timeout} s")
        reply = self._conn.recv()
        if reply[0] == "error":
            raise P2PXferError(f"loopback target failed: {reply[1]}")
        return reply

    def wait_imm(self, imm: int, count: int, timeout: float = 60.0) -> str:
        """Wait on the target for ``count`` pieces with ``imm``; returns the
        digest of the whole region after they landed."""
        self._conn.send(("wait", imm, count, timeout))
        return str(self._recv(timeout + 30)[1])

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
                self._recv(10)
            except (P2PXferError, OSError):
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
