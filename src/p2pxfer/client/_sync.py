"""``SyncClient``: the client for synchronous callers, on an event loop of its
own in a background thread (anyio's blocking portal)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from types import TracebackType
from typing import Any, Self

import sniffio
from anyio.from_thread import start_blocking_portal

from p2pxfer.errors import UsageError
from p2pxfer.kv import KVLayout
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

from ._client import Client, SharedMemory, connect
from ._kv import KVPool, KVPushResult

__all__ = ["SyncClient"]


class SyncClient:
    """Blocking twin of :class:`Client`; close it (or use ``with``)."""

    def __init__(self, path: str) -> None:
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            library = ""
        if library:
            # Its blocking calls would wait for a portal thread while holding
            # this thread's event loop: every call would hang (issue 16).
            raise UsageError(
                f"SyncClient cannot be made inside a running {library} event loop: its calls "
                "block that loop; use `async with p2pxfer.client.connect(path)` there, or "
                "make the SyncClient in a worker thread (e.g. trio.to_thread.run_sync)")
        self._portal_cm = start_blocking_portal("trio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._client_cm = self._portal.wrap_async_context_manager(connect(path))
            self._client: Client = self._client_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return self._portal.call(partial(fn, *args, **kw))

    def alloc(self, nbytes: int, name: str = "p2pxfer") -> SharedMemory:
        return self._call(self._client.alloc, nbytes, name)  # type: ignore[no-any-return]

    def export(self, name: str, mem: SharedMemory, offset: int = 0,
               length: int | None = None, *,
               writers: Iterable[int] | None = None) -> RegionDescriptor:
        return self._call(self._client.export, name, mem, offset,  # type: ignore[no-any-return]
                          length, writers=writers)

    def free(self, mem: SharedMemory) -> None:
        self._call(self._client.free, mem)

    def unexport(self, name: str) -> None:
        self._call(self._client.unexport, name)

    def write(self, peer: str, region: str, scatter: ScatterList, *, src: SharedMemory,
              src_offset: int = 0, imm: int | None = None, notify: bool = False,
              timeout: float | None = None) -> int:
        """See :meth:`Client.write` (``timeout`` included)."""
        return int(self._call(self._client.write, peer, region, scatter, src=src,
                              src_offset=src_offset, imm=imm, notify=notify, timeout=timeout))

    def wait_imm(self, imm: int, count: int, *, region: str | None = None,
                 timeout: float | None = None) -> None:
        self._call(self._client.wait_imm, imm, count, region=region, timeout=timeout)

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
        return dict(self._call(self._client.status))

    def peers(self) -> list[dict[str, Any]]:
        return list(self._call(self._client.peers))

    def lookup(self, name: str) -> dict[str, Any] | None:
        return self._call(self._client.lookup, name)  # type: ignore[no-any-return]

    def locate(self, region: str) -> list[str]:
        return list(self._call(self._client.locate, region))

    def add_peer(self, name: str, address: str) -> None:
        self._call(self._client.add_peer, name, address)

    def close(self) -> None:
        try:
            self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
