"""Mooncake Transfer Engine as a peer row: the same pages, the same run.

``MooncakePeer`` runs Mooncake's TCP transport with P2PHANDSHAKE (no metadata
server): a target process registers a zeroed buffer, this process registers
the source and writes each round with one ``batch_transfer_sync_write``. It
is optional (``pip install mooncake-transfer-engine-non-cuda``); where it is
missing, ``mooncake_missing`` says why and the bench leaves the row out with
a note. What must not live here: anything of ours on the data path.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.memory import buffer_span
from p2pxfer.scatter import ScatterList

from ._options import BenchError
from ._reference import process_cpu_seconds
from ._spawned import SpawnedTarget

__all__ = ["MooncakePeer", "mooncake_missing"]

INSTALL = "pip install mooncake-transfer-engine-non-cuda"
# Mooncake refuses a batch larger than its per-peer queue (default 256 here).
_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
        "GLOG_minloglevel": "2"}
START_TIMEOUT = 60.0


def mooncake_missing(provider: str) -> str | None:
    """Why no Mooncake row can run next to ``provider``, or None."""
    if not provider.startswith("tcp"):
        return "Mooncake's TCP transport is compared with tcp providers only"
    try:
        importlib.import_module("mooncake.engine")
    except ImportError:
        return f"Mooncake Transfer Engine is not installed ({INSTALL})"
    return None


def _engine() -> Any:
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    # Through importlib: an optional dependency without type information.
    engine = importlib.import_module("mooncake.engine").TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise BenchError(f"Mooncake TransferEngine.initialize failed ({rc})")
    return engine


def _target_main(conn: Any, size: int) -> None:
    """Entry point of the Mooncake target process."""
    try:
        engine = _engine()
        buf = np.zeros(size, np.uint8)
        buf.fill(0)
        address = buffer_span(buf).address
        rc = engine.register_memory(address, size)
        if rc != 0:
            raise BenchError(f"Mooncake register_memory failed ({rc})")
        conn.send(("ready", engine.get_rpc_port(), address))
        conn.recv()  # stop
        conn.send(("stopped",))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class MooncakePeer:
    """Mooncake writing from ``src`` into a target process's buffer of ``size``."""

    name = "mooncake"

    def __init__(self, src: npt.NDArray[np.uint8], size: int, timeout: float) -> None:
        for k, v in _ENV.items():
            os.environ.setdefault(k, v)  # the spawned target inherits them
        self._target = SpawnedTarget(_target_main, (size,), "p2pxfer-mooncake-target",
                                     "Mooncake target")
        try:
            msg = self._target.reply(START_TIMEOUT, "start")
            self._peer = f"127.0.0.1:{msg[1]}"
            self._dst = int(msg[2])
            self._engine = _engine()
            self._src = buffer_span(src).address
            rc = self._engine.register_memory(self._src, src.nbytes)
            if rc != 0:
                raise BenchError(f"Mooncake register_memory failed ({rc})")
        except BaseException:
            self.close()
            raise
        self._pid = self._target.pid

    def plan(self, sl: ScatterList) -> tuple[list[int], list[int], list[int]]:
        """Raw addresses, as Mooncake takes them (built before any timing)."""
        return ((sl.src + self._src).tolist(), (sl.dst + self._dst).tolist(),
                sl.length.tolist())

    def block(self, plans: list[Any], timeout: float) -> tuple[int, list[float], float | None]:
        cpu0 = process_cpu_seconds(self._pid)
        n, dts = 0, []
        for srcs, dsts, lens in plans:
            t0 = time.perf_counter()
            rc = self._engine.batch_transfer_sync_write(self._peer, srcs, dsts, lens)
            dts.append(time.perf_counter() - t0)
            if rc != 0:
                raise BenchError(f"Mooncake batch_transfer_sync_write failed ({rc})")
            n += len(lens)
        return n, dts, process_cpu_seconds(self._pid) - cpu0

    def close(self) -> None:
        self._target.stop()

    def __enter__(self) -> MooncakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
