"""``SyncClient``: the client for synchronous callers, on an event loop of its
own in a background thread (anyio's blocking portal).

Requests the daemon answers in turn (``status``, ``peers``, ``export``...)
skip the portal when nothing else is in flight: the calling thread sends the
request and blocks on the socket for its reply itself
(``Conversation.request_blocking``), which saves the two thread hand-offs a
portal call costs (most of a no-op round trip). Anything that waits, passes
descriptors or may be cancelled goes through the portal as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import sniffio
from anyio.from_thread import start_blocking_portal

from p2pxfer.buffers import RegionDescriptor
from p2pxfer.errors import ConnectionLost, UsageError
from p2pxfer.kv_plan import KVLayout
from p2pxfer.scatter import ScatterList

from ._client import Client, SharedMemory, connect
from ._kv import KVPool, KVPushResult

RETRY_S = 0.1  # call_daemon: between tries on a daemon still starting

__all__ = ["SyncClient", "call_daemon"]


class SyncClient:
    """Blocking twin of :class:`Client`; close it (or use ``with``)."""

    def __init__(self, path: str) -> None:
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            library = ""
        if library:
            # Its blocking calls would wait for a portal thread while holding
            # this thread's event loop: every call would hang.
            raise UsageError(
                f"SyncClient cannot be made inside a running {library} event loop: its calls "
                "block that loop; use `async with p2pxfer.client.connect(path)` there, or "
                "make the SyncClient in a worker thread (e.g. trio.to_thread.run_sync)")
        # Who may use the socket: portal calls in flight (counted until their
        # coroutine ends) or one blocking call (``_blocking``), never both.
        self._turn = threading.Condition()
        self._in_flight = 0
        self._blocking = False
        self._portal_cm = start_blocking_portal("trio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._client_cm = self._portal.wrap_async_context_manager(connect(path))
            self._client: Client = self._client_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` on the portal's loop. Counted in flight until
        the coroutine itself ends there (not when this thread stops waiting,
        e.g. on KeyboardInterrupt): only then may a blocking call use the
        socket again."""
        with self._turn:
            while self._blocking:
                self._turn.wait()
            self._in_flight += 1

        async def run() -> Any:
            try:
                return await fn(*args, **kw)
            finally:
                with self._turn:
                    self._in_flight -= 1
                    self._turn.notify_all()

        # Should ``run`` never start (the portal is closed), the count stays
        # up: blocking calls then stay off the socket, which is closed anyway.
        return self._portal.call(run)

    def _request(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A request the daemon answers in turn: in this thread when nothing
        else is in flight (the module docstring), else through the portal."""
        with self._turn:
            while self._blocking:
                self._turn.wait()
            fast = not self._in_flight and self._client.idle()
            if fast:
                self._blocking = True
        if not fast:
            return self._call(self._client._request, kind, **fields)  # type: ignore[no-any-return]
        try:
            return self._client.request_blocking(kind, **fields)
        finally:
            with self._turn:
                self._blocking = False
                self._turn.notify_all()

    def alloc(self, nbytes: int, name: str = "p2pxfer") -> SharedMemory:
        return self._call(self._client.alloc, nbytes, name)  # type: ignore[no-any-return]

    def export(self, name: str, mem: SharedMemory, offset: int = 0,
               length: int | None = None, *,
               writers: Iterable[int] | None = None) -> RegionDescriptor:
        length = mem.nbytes - offset if length is None else length
        fields: dict[str, Any] = {} if writers is None else {"writers": list(writers)}
        result = self._request("export", name=name, mem=mem.mem_id, offset=offset,
                               length=length, **fields)
        return RegionDescriptor.from_wire(result["descriptor"])

    def free(self, mem: SharedMemory) -> None:
        self._request("unshare", mem=mem.mem_id)
        self._client._forget(mem)

    def unexport(self, name: str) -> None:
        self._request("unexport", name=name)

    def write(self, peer: str, region: str, scatter: ScatterList, *, src: SharedMemory,
              src_offset: int = 0, imm: int | None = None, notify: bool = False,
              timeout: float | None = None) -> int:
        """See :meth:`Client.write` (``timeout`` included)."""
        return int(self._call(self._client.write, peer, region, scatter, src=src,
                              src_offset=src_offset, imm=imm, notify=notify, timeout=timeout))

    def wait_imm(self, imm: int, count: int, *, region: str | None = None,
                 timeout: float | None = None) -> None:
        self._call(self._client.wait_imm, imm, count, region=region, timeout=timeout)

    def ping(self, peer: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """See :meth:`Client.ping`."""
        return self._call(self._client.ping, peer,  # type: ignore[no-any-return]
                          timeout=timeout)

    def kv_pool(self, name: str, layout: KVLayout, *, receive: bool = True,
                writers: Iterable[int] | None = None) -> KVPool:
        return self._call(self._client.kv_pool, name, layout,  # type: ignore[no-any-return]
                          receive=receive, writers=writers)

    def kv_push(self, peer: str, pool: str, src: KVPool, src_blocks: Any, dst_blocks: Any, *,
                request: int, layers: Iterable[int] | None = None,
                deadline: float = 30.0) -> KVPushResult:
        """Push and wait for it (the async ``kv_push`` + ``wait``)."""
        async def run() -> KVPushResult:
            push = await self._client.kv_push(peer, pool, src, src_blocks, dst_blocks,
                                              request=request, layers=layers,
                                              deadline=deadline)
            return await push.wait()
        return self._call(run)  # type: ignore[no-any-return]

    def wait_layers(self, pool: KVPool, request: int, upto_layer: int, *, first: int = 0,
                    timeout: float | None = None) -> None:
        self._call(pool.wait_layers, request, upto_layer, first=first, timeout=timeout)

    def status(self) -> dict[str, Any]:
        return self._request("status")

    def peers(self) -> list[dict[str, Any]]:
        return list(self._request("peers")["peers"])

    def lookup(self, name: str) -> dict[str, Any] | None:
        return next((p for p in self.peers() if p["name"] == name), None)

    def locate(self, region: str) -> list[str]:
        return list(self._call(self._client.locate, region))

    def add_peer(self, name: str, address: str) -> None:
        self._request("add_peer", name=name, address=address)

    def close(self) -> None:
        with self._turn:
            while self._blocking:
                self._turn.wait()
        try:
            self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def call_daemon(path: str, method: str, wait_s: float = 0.0) -> Any:
    """``method()`` of a ``SyncClient`` on ``path``, once. With ``wait_s``,
    a daemon that is not accepting yet (no socket, refused, closed during
    the hello: ``ConnectionLost``) is tried again until it answers or
    ``wait_s`` has passed (the CLI's ``status --wait``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with SyncClient(path) as client:
                return getattr(client, method)()
        except ConnectionLost as exc:
            if time.monotonic() >= deadline:
                if not wait_s:
                    raise
                raise ConnectionLost(f"{exc} (waited {wait_s:g} s)") from exc
            time.sleep(RETRY_S)
