"""A trio thread for synchronous callers (a serving engine's worker and
scheduler processes): it holds an async ``p2pxfer.Client`` to the node
daemon and runs what the caller hands it, so that a call such as "push this
request" returns as soon as the request is handed over, and the waits
happen here, concurrently, not in the caller's loop.

- :meth:`Bridge.call` runs an async function here and blocks the caller
  until it returns (for the short requests: open a pool, start a push);
- :meth:`Bridge.spawn` starts one and returns at once (loads, pushes,
  lease timers); its failures are the task's to report (it must catch
  them: an escaping exception is logged and ends only that task);
  :meth:`Bridge.spawn_each` starts one per item of a batch (a step's
  loads or holds) in a single hop to the bridge and back;
- :meth:`Bridge.on_close` hooks run in the bridge when it ends, after its
  tasks and before its client (and the memory the client maps) closes.

State: everything a spawned task touches belongs to this thread; callers
read results through whatever thread-safe hand-off their owner keeps
(``p2pxfer.integrations.vllm._worker``: a lock). What must not live here:
anything about KV or vLLM.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from p2pxfer.client import Client, connect
from p2pxfer.errors import ConnectionLost
from p2pxfer.log import get_logger

__all__ = ["Bridge"]

log = get_logger("p2pxfer.integrations")

T = TypeVar("T")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


class Bridge:
    """A daemon client in a thread of its own (see the module docstring)."""

    def __init__(self, socket: str, name: str = "p2pxfer-bridge") -> None:
        self.socket = socket
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._client: Client | None = None
        self._closing: list[Callable[[], None]] = []
        self._accepting = True  # False once the nursery has closed (``_start``)
        self._hooks_lock = threading.Lock()  # ``_closing`` and ``_accepting``
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise ConnectionLost(f"no client to the p2pxfer daemon at {socket} after "
                                 f"{START_TIMEOUT_S:g} s")
        if self._failed is not None:
            raise self._failed

    @property
    def client(self) -> Client:
        assert self._client is not None
        return self._client

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # connect failed, or the client broke
            self._failed = exc
            log.warning("bridge.ended", socket=self.socket, error=repr(exc))
        finally:
            self._ready.set()

    async def _run(self) -> None:
        async with connect(self.socket) as client:
            try:
                async with trio.open_nursery() as nursery:
                    self._client = client
                    self._nursery = nursery
                    self._stop = trio.Event()
                    self._token = trio.lowlevel.current_trio_token()
                    self._ready.set()
                    await self._stop.wait()
                    nursery.cancel_scope.cancel()
            finally:
                # Every task is over, the client (and the memory it maps) not
                # yet closed: however the bridge ends.
                with self._hooks_lock:
                    self._accepting = False
                    hooks = list(self._closing)
                for fn in reversed(hooks):
                    try:
                        fn()
                    except Exception as exc:
                        log.error("bridge.close_hook_failed", hook=getattr(fn, "__name__", ""),
                                  error=repr(exc))

    def on_close(self, fn: Callable[[], None]) -> bool:
        """Run ``fn()`` in the bridge when it ends (closed, or its client
        lost), after its tasks and before the client closes; last added
        first. False (and ``fn`` not kept) if the bridge is ending already:
        the caller cleans up itself."""
        with self._hooks_lock:
            if not self._accepting:
                return False
            self._closing.append(fn)
            return True

    def _live_token(self) -> trio.lowlevel.TrioToken:
        if self._token is None or not self._thread.is_alive():
            raise ConnectionLost(f"the client to the p2pxfer daemon at {self.socket} is "
                                 f"closed ({self._failed!r})")
        return self._token

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` in the bridge; its result (or exception)."""
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._live_token())
        except trio.RunFinishedError as exc:
            raise ConnectionLost(f"the client to the p2pxfer daemon at {self.socket} "
                                 "closed") from exc

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``fn(*args)`` in the bridge and return."""
        self._spawn(self._start, fn, *args)

    def spawn_each(self, fn: Callable[[T], Awaitable[Any]], items: Sequence[T]) -> None:
        """Start ``fn(item)`` for each of ``items`` in the bridge and return:
        all of them or (``ConnectionLost``) none. One hop to the bridge
        thread and back however many there are: each hop is a wake-up of
        the bridge and a wait of the caller's (a serving engine's step)."""
        if items:
            self._spawn(self._start_each, fn, items)

    def _spawn(self, start: Callable[..., None], *args: Any) -> None:
        assert self._nursery is not None
        try:
            trio.from_thread.run_sync(start, *args, trio_token=self._live_token())
        except trio.RunFinishedError as exc:
            raise ConnectionLost(f"the client to the p2pxfer daemon at {self.socket} "
                                 "closed") from exc

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` to run in the bridge, in the order queued,
        and return at once (never waits for the bridge). ``fn`` must not
        raise: it runs in trio's own loop."""
        try:
            self._live_token().run_sync_soon(fn, *args)
        except trio.RunFinishedError as exc:
            raise ConnectionLost(f"the client to the p2pxfer daemon at {self.socket} "
                                 "closed") from exc

    def _start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self._open_nursery().start_soon(self._guard, fn, *args)

    def _start_each(self, fn: Callable[[T], Awaitable[Any]], items: Sequence[T]) -> None:
        nursery = self._open_nursery()
        for item in items:
            nursery.start_soon(self._guard, fn, item)

    def _open_nursery(self) -> trio.Nursery:
        # In the bridge's thread: once its nursery has closed (the close
        # hooks and the client's close may still run), nothing starts.
        with self._hooks_lock:
            accepting = self._accepting
        if not accepting:
            raise ConnectionLost(f"the client to the p2pxfer daemon at {self.socket} is "
                                 "closing")
        assert self._nursery is not None
        return self._nursery

    @staticmethod
    async def _guard(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            await fn(*args)
        except Exception as exc:
            # The task's owner reports its own failures; this is the backstop
            # that keeps one task's bug from ending every other.
            log.error("bridge.task_failed", task=getattr(fn, "__name__", repr(fn)),
                      error=repr(exc))

    def close(self) -> None:
        """Cancel what runs here, close the client, end the thread."""
        if self._token is not None and self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it ended meanwhile
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(STOP_TIMEOUT_S)
