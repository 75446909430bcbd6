"""A peer row's target process: spawned, spoken to over a pipe, stopped.

The peers measured beside ours (``_mooncake``, ``_nixl``) each run their
target in a process of its own. Its entry point answers ``("ready", ...)``
once it can be written to, ``("error", text)`` if it cannot, and stops when
sent ``("stop",)``. What must not live here: either peer's library calls.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from ._options import BenchError

__all__ = ["SpawnedTarget"]


class SpawnedTarget:
    """``main(conn, *args)`` in a spawned process named ``name``."""

    def __init__(self, main: Callable[..., None], args: tuple[Any, ...], name: str,
                 what: str) -> None:
        self.what = what
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=main, args=(child, *args), daemon=True, name=name)
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    def reply(self, timeout: float, doing: str) -> tuple[Any, ...]:
        """The target's next message (``BenchError`` if it failed or is silent)."""
        if not self.conn.poll(timeout):
            raise BenchError(f"the {self.what} did not {doing} within {timeout:g} s")
        msg: tuple[Any, ...] = self.conn.recv()
        if msg[0] == "error":
            raise BenchError(f"the {self.what} failed: {msg[1]}")
        return msg

    def stop(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self.conn.close()
