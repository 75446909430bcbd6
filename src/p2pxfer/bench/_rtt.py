"""The control round trip: a request the daemon answers at once (``peers``
by default), through a running daemon, from every kind of caller, against
raw-socket baselines measured in the same run.

Paths, each ``n`` timed round trips per round on a fresh connection (after a
warm-up), in ``rounds`` rounds whose order rotates (the machine is shared:
compare within a run, and look at the spread of the per-round p50s):

- ``raw-blocking``: a blocking socket, the protocol's framing and msgpack,
  nothing else: the daemon's own cost plus the kernel's. The baseline.
- ``raw-trio`` / ``raw-asyncio``: one task on a non-blocking socket under
  each loop (trio parks in ``wait_readable``; asyncio reads in an
  ``add_reader`` callback): what the event loop adds, the floor for a
  client on it.
- ``trio`` / ``asyncio``: ``p2pxfer.client.Client``; ``sync``: ``SyncClient``.

``ratio`` is a path's p50 over raw-blocking's p50. What must not live here:
option parsing or rendering.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from p2pxfer.client import SyncClient, connect
from p2pxfer.protocol import SCHEMA_VERSION, FrameDecoder, encode_frame

__all__ = ["PATHS", "measure_control_rtt"]

WARMUP = 50
BASELINE = "raw-blocking"


class _Raw:
    """A bare connection to the daemon, said hello to."""

    def __init__(self, path: str, kind: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(path)
        self.decoder = FrameDecoder(1 << 24)
        self.kind = kind
        self.rid = 0
        self.sock.sendall(encode_frame({"t": "hello", "v": SCHEMA_VERSION, "role": "client"}))
        self.blocking_reply()

    def frame(self) -> bytes:
        self.rid += 1
        return encode_frame({"t": self.kind, "id": self.rid})

    def blocking_reply(self) -> dict[str, Any]:
        while (obj := self.decoder.next_frame()) is None:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self.decoder.feed(data)
        return obj

    def take(self) -> bool:
        """Whatever is there, without waiting; True once a reply is whole."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return False
        if not data:
            raise ConnectionError("the daemon closed the connection")
        self.decoder.feed(data)
        return self.decoder.next_frame() is not None

    def close(self) -> None:
        self.sock.close()


def _raw_blocking(path: str, kind: str, n: int) -> list[float]:
    c = _Raw(path, kind)
    try:
        out = []
        for i in range(WARMUP + n):
            t0 = time.perf_counter()
            c.sock.sendall(c.frame())
            c.blocking_reply()
            if i >= WARMUP:
                out.append(time.perf_counter() - t0)
        return out
    finally:
        c.close()


def _raw_trio(path: str, kind: str, n: int) -> list[float]:
    async def run() -> list[float]:
        c = _Raw(path, kind)
        c.sock.setblocking(False)
        try:
            out = []
            for i in range(WARMUP + n):
                t0 = time.perf_counter()
                c.sock.send(c.frame())
                while not c.take():
                    await trio.lowlevel.wait_readable(c.sock)
                if i >= WARMUP:
                    out.append(time.perf_counter() - t0)
            return out
        finally:
            c.close()
    return trio.run(run)


def _raw_asyncio(path: str, kind: str, n: int) -> list[float]:
    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        c = _Raw(path, kind)
        c.sock.setblocking(False)
        done: list[asyncio.Future[None]] = []

        def readable() -> None:
            if c.take() and done and not done[0].done():
                done[0].set_result(None)

        loop.add_reader(c.sock, readable)
        try:
            out = []
            for i in range(WARMUP + n):
                t0 = time.perf_counter()
                done[:] = [loop.create_future()]
                c.sock.send(c.frame())
                await done[0]
                if i >= WARMUP:
                    out.append(time.perf_counter() - t0)
            return out
        finally:
            loop.remove_reader(c.sock)
            c.close()
    return asyncio.run(run())


async def _client_loop(path: str, kind: str, n: int) -> list[float]:
    async with connect(path) as client:
        call = getattr(client, kind)
        out = []
        for i in range(WARMUP + n):
            t0 = time.perf_counter()
            await call()
            if i >= WARMUP:
                out.append(time.perf_counter() - t0)
        return out


def _trio_client(path: str, kind: str, n: int) -> list[float]:
    return trio.run(_client_loop, path, kind, n)


def _asyncio_client(path: str, kind: str, n: int) -> list[float]:
    return asyncio.run(_client_loop(path, kind, n))


def _sync_client(path: str, kind: str, n: int) -> list[float]:
    with SyncClient(path) as client:
        call = getattr(client, kind)
        out = []
        for i in range(WARMUP + n):
            t0 = time.perf_counter()
            call()
            if i >= WARMUP:
                out.append(time.perf_counter() - t0)
        return out


PATHS: dict[str, Callable[[str, str, int], list[float]]] = {
    BASELINE: _raw_blocking, "raw-trio": _raw_trio, "raw-asyncio": _raw_asyncio,
    "trio": _trio_client, "asyncio": _asyncio_client, "sync": _sync_client,
}
LABELS = {BASELINE: "raw blocking socket", "raw-trio": "raw socket, one trio task",
          "raw-asyncio": "raw socket, asyncio reader callback", "trio": "Client on trio",
          "asyncio": "Client on asyncio", "sync": "SyncClient"}


def _us(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e6


def measure_control_rtt(path: str, n: int = 500, rounds: int = 5,
                        kind: str = "peers") -> list[dict[str, Any]]:
    """Round trips of ``kind`` through the daemon at ``path`` on every path
    (blocking: run it outside any event loop, e.g. in a worker thread)."""
    raw = _Raw(path, "status")
    try:
        raw.sock.sendall(raw.frame())
        provider = str(raw.blocking_reply()["result"]["provider"])
    finally:
        raw.close()
    samples: dict[str, list[float]] = {name: [] for name in PATHS}
    per_round: dict[str, list[float]] = {name: [] for name in PATHS}
    names = list(PATHS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            xs = PATHS[name](path, kind, n)
            samples[name] += xs
            per_round[name].append(_us(xs, 50))
    base50, base99 = _us(samples[BASELINE], 50), _us(samples[BASELINE], 99)
    out = []
    for name in names:
        p50 = _us(samples[name], 50)
        out.append({"provider": provider, "pattern": f"control round trip ({kind}), "
                    f"{LABELS[name]}", "client": name, "requests": len(samples[name]),
                    "rounds": rounds, "p50_us": p50, "p99_us": _us(samples[name], 99),
                    "round_p50_us": per_round[name], "baseline": BASELINE,
                    "baseline_p50_us": base50, "baseline_p99_us": base99,
                    "ratio": p50 / base50})
    return out
