"""A blocking facade over the engine, for synchronous callers.

``BlockingEngine`` opens an :class:`Engine` inside a trio event loop on a
thread of its own and forwards every call to it (``trio.from_thread``): one
thread hop per call, the same validation, posting and counting as any other
engine user. Scripts, ``p2pxfer demo`` and the loopback target use it.

What must not live here: posting, polling, counting or validating anything
(all of it is the engine's); a method forwards a call and, at most, turns
its ``timeout`` into ``WaitTimeout``.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import trio

from p2pxfer._sigmask import MAIN_THREAD_SIGNALS
from p2pxfer.errors import EngineClosed, WaitTimeout
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

from ._engine import Engine, EngineConfig, EngineStats
from ._open import open_engine

__all__ = ["BlockingEngine"]

_T = TypeVar("_T")


class BlockingEngine:
    """An :class:`Engine` for code that is not async. Use as a context manager
    (or call :meth:`close`); every method blocks the calling thread, never the
    engine's. Not for use from inside a trio task (use the engine there)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._engine: Engine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._closed = False
        started: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, args=(started,),
                                        name="p2pxfer-engine", daemon=True)
        self._thread.start()
        error = started.get()
        if error is not None:
            self._thread.join()
            self._closed = True
            raise error

    @classmethod
    def open(cls, provider: str = "tcp;ofi_rxm", *, node: str | None = None,
             interfaces: Sequence[str] | None = None, **options: Any) -> BlockingEngine:
        """Shorthand for ``BlockingEngine(EngineConfig(provider=..., ...))``;
        ``options`` are further :class:`EngineConfig` fields."""
        return cls(EngineConfig(provider=provider, node=node,
                                interfaces=tuple(interfaces) if interfaces else None,
                                **options))

    def _main(self, started: queue.SimpleQueue[BaseException | None]) -> None:
        # Our thread for good: Ctrl-C goes to the caller's (main) thread, which
        # waits on this one and must wake at once (``p2pxfer._sigmask``).
        signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
        try:
            trio.run(self._serve, started)
        except BaseException as exc:
            if self._engine is None:  # failed to open: the constructor raises it
                started.put(exc)
            else:
                raise

    async def _serve(self, started: queue.SimpleQueue[BaseException | None]) -> None:
        async with open_engine(self.config) as engine:
            self._engine = engine
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            started.put(None)
            await self._stop.wait()

    def _run_sync(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._closed:
            raise EngineClosed("engine is closed")
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def _run(self, fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        if self._closed:
            raise EngineClosed("engine is closed")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    @property
    def _eng(self) -> Engine:
        # Only for use inside calls forwarded to the engine's thread: an
        # Engine is not thread-safe.
        assert self._engine is not None
        return self._engine

    # -- memory ---------------------------------------------------------------

    def register(self, obj: Any, *, writable: bool = False,
                 numa_node: int | None = None) -> None:
        """See :meth:`Engine.register`."""
        self._run_sync(lambda: self._eng.register(obj, writable=writable, numa_node=numa_node))

    def export(self, obj: Any, name: str, *, numa_node: int | None = None) -> RegionDescriptor:
        """See :meth:`Engine.export`."""
        return self._run_sync(lambda: self._eng.export(obj, name, numa_node=numa_node))

    def unexport(self, name: str) -> None:
        self._run_sync(self._eng.unexport, name)

    def deregister(self, obj: Any) -> None:
        """See :meth:`Engine.deregister`."""
        self._run_sync(self._eng.deregister, obj)

    def exported(self) -> dict[str, int]:
        return self._run_sync(self._eng.exported)

    # -- transfers ------------------------------------------------------------

    def write(self, src: Any, dst: RegionDescriptor, scatter: ScatterList, *,
              imm: int | None = None, notify: bool = False, dry_run: bool = False,
              timeout: float | None = None) -> int:
        """:meth:`Engine.write` (``notify`` included), waiting at most
        ``timeout`` seconds. On timeout the write stops posting and, once the
        pieces it posted are done (the source is free again), raises
        ``WaitTimeout``."""

        async def write() -> int:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                return await self._eng.write(src, dst, scatter, imm=imm, notify=notify,
                                             dry_run=dry_run)
            raise WaitTimeout(f"write to {dst.name!r} did not complete within {timeout} s")

        return self._run(write)

    def wait_imm(self, imm: int, count: int, *, timeout: float | None = None) -> None:
        """:meth:`Engine.wait_imm`, waiting at most ``timeout`` seconds; on
        timeout the arrivals so far stay counted and ``WaitTimeout`` is raised."""

        async def wait() -> None:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await self._eng.wait_imm(imm, count)
                return
            raise WaitTimeout(f"only {self._eng.imm_count(imm)} of {count} pieces with "
                              f"immediate {imm} arrived within {timeout} s")

        self._run(wait)

    def imm_count(self, imm: int) -> int:
        return self._run_sync(self._eng.imm_count, imm)

    @property
    def imm_bits(self) -> int:
        return self._eng.imm_bits

    @property
    def provider(self) -> str:
        return self.config.provider

    def statistics(self) -> EngineStats:
        return self._run_sync(self._eng.statistics)

    # -- life -----------------------------------------------------------------

    def close(self) -> None:
        """Close the engine (in-flight writes fail with ``EngineClosed``) and
        join its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        assert self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
