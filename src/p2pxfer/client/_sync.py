"""``SyncClient``: the client for synchronous callers, on a blocking socket
of its own (``_blocking.py``): no event loop, no thread behind it, each call
a request the calling thread sends and reads the reply to. One call at a
time per client; threads that share one queue behind each other.

What must not live here: the conversation itself (``_blocking.py``) or the
async API (``_client.py``); the two speak the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import sniffio

from p2pxfer.buffers import RegionDescriptor
from p2pxfer.errors import (
    ConnectionLost,
    DeviceError,
    InvalidArgument,
    TransferError,
    UsageError,
    WaitTimeout,
)
from p2pxfer.kv_plan import KVLayout
from p2pxfer.protocol import check_reason, pack_scatter
from p2pxfer.scatter import ScatterList

from ._blocking import BlockingConversation
from ._client import (
    WAIT_MARGIN_S,
    SharedMemory,
    new_buffer,
    unexport_fields,
    wait_timed_out,
)
from ._devshare import DeviceShared, device_memory_of, device_share
from ._kv import (
    KVPool,
    KVPushResult,
    combine,
    direct_device,
    pool_fields,
    pool_memory,
    pool_stage,
    push_fields,
    push_layer_list,
    push_result,
    staged_after,
    tries_direct,
)

RETRY_S = 0.1  # call_daemon: between tries on a daemon still starting

__all__ = ["SyncClient", "call_daemon"]


class SyncClient:
    """Blocking twin of :class:`Client`; close it (or use ``with``)."""

    def __init__(self, path: str, *, max_frame: int = 16 << 20) -> None:
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            library = ""
        if library:
            # Its calls block the thread they run on: here, that loop.
            raise UsageError(
                f"SyncClient cannot be made inside a running {library} event loop: its calls "
                "block that loop; use `async with p2pxfer.client.connect(path)` there, or "
                "make the SyncClient in a worker thread (e.g. trio.to_thread.run_sync)")
        self._c = BlockingConversation(path, max_frame)
        self._mems: list[SharedMemory | DeviceShared] = []
        self._takes_device: tuple[bool | None] | None = None

    @property
    def node(self) -> str:
        return self._c.node

    def alloc(self, nbytes: int, name: str = "p2pxfer") -> SharedMemory:
        """Shared memory of ``nbytes``, mapped here and registered by the daemon."""
        with new_buffer(nbytes, name) as buf:
            result = self._c.request("share", [buf.fd], size=nbytes, name=name)
        mem = SharedMemory(buf, int(result["mem"]))
        self._mems.append(mem)
        return mem

    def export(self, name: str, mem: SharedMemory, offset: int = 0,
               length: int | None = None, *,
               writers: Iterable[int] | None = None) -> RegionDescriptor:
        length = mem.nbytes - offset if length is None else length
        fields: dict[str, Any] = {} if writers is None else {"writers": list(writers)}
        result = self._c.request("export", name=name, mem=mem.mem_id, offset=offset,
                                 length=length, **fields)
        return RegionDescriptor.from_wire(result["descriptor"])

    def free(self, mem: SharedMemory | DeviceShared) -> None:
        self._c.request("unshare", mem=mem.mem_id)
        if mem in self._mems:
            self._mems.remove(mem)
        mem.close()

    def unexport(self, name: str, *, reason: str | None = None) -> None:
        """``Client.unexport``."""
        self._c.request("unexport", name=name, **unexport_fields(reason))

    def withdraw(self, name: str, reason: str) -> None:
        """``Client.withdraw``."""
        check_reason(reason)
        self._c.request("withdraw", name=name, reason=reason)

    def write(self, peer: str, region: str, scatter: ScatterList, *, src: SharedMemory,
              src_offset: int = 0, imm: int | None = None, notify: bool = False,
              timeout: float | None = None) -> int:
        """See :meth:`Client.write` (``timeout`` included: the write is
        cancelled, the daemon has stopped reading ``src`` when this raises)."""
        if not isinstance(scatter, ScatterList):
            raise InvalidArgument(f"scatter must be a ScatterList, got {type(scatter).__name__}")
        if timeout is not None and (not isinstance(timeout, (int, float))
                                    or isinstance(timeout, bool) or not timeout > 0):
            raise InvalidArgument(f"timeout must be a number of seconds > 0, got {timeout!r}")
        extra: dict[str, Any] = {"notify": True} if notify else {}
        try:
            result = self._c.request(
                "write", peer=peer, region=region, mem=src.mem_id, offset=src_offset,
                scatter=pack_scatter(scatter.src, scatter.dst, scatter.length), imm=imm,
                timeout=timeout, **extra)
        except WaitTimeout:
            raise WaitTimeout(f"write to {region!r} on {peer!r} did not finish within "
                              f"{timeout:g} s") from None
        return int(result["pieces"])

    def wait_imm(self, imm: int, count: int, *, region: str | None = None,
                 timeout: float | None = None) -> None:
        """See :meth:`Client.wait_imm`."""
        fields: dict[str, Any] = {"region": region} if region is not None else {}
        if timeout is None:
            self._c.request("wait_imm", imm=imm, count=count, **fields)
            return
        # The daemon keeps the deadline, so it can say how many arrived; ours
        # is the backstop for a daemon that does not answer at all.
        result = self._c.request("wait_imm", imm=imm, count=count,
                                 timeout_ms=max(0, round(timeout * 1000)),
                                 timeout=timeout + WAIT_MARGIN_S, **fields)
        if result.get("timed_out"):
            raise wait_timed_out(result, imm, count, region, timeout)

    def ping(self, peer: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """See :meth:`Client.ping`."""
        return self._c.request("ping", peer=peer, timeout_ms=max(1, round(timeout * 1000)))

    def takes_device_memory(self) -> bool | None:
        """See :meth:`Client.takes_device_memory`."""
        if self._takes_device is None:
            self._takes_device = (device_memory_of(self.status()),)
        return self._takes_device[0]

    def share_device(self, obj: Any) -> DeviceShared:
        """See :meth:`Client.share_device`."""
        dev, fields = device_share(obj)
        shared = DeviceShared(dev, int(self._c.request("share_device", **fields)["mem"]))
        self._mems.append(shared)
        return shared

    def kv_pool(self, name: str, layout: KVLayout, *, receive: bool = True,
                writers: Iterable[int] | None = None, device: Any = None,
                memory: SharedMemory | None = None, direct: bool | None = None) -> KVPool:
        """See :meth:`Client.kv_pool`; wait on it with :meth:`wait_layers`."""
        dev = None
        if tries_direct(layout, device, memory, direct):
            dev = direct_device(name, layout, device, direct, self.takes_device_memory())
        if dev is not None:
            try:
                shared = self.share_device(dev)
            except DeviceError as exc:
                staged_after(exc, direct, name)
            else:
                try:
                    r = self._c.request("kv_pool", name=name, mem=shared.mem_id,
                                        **pool_fields(layout, receive, writers, "cuda"))
                except BaseException:
                    self.free(shared)
                    raise
                desc = RegionDescriptor.from_wire(r["descriptor"]) if receive else None
                return KVPool(None, name, layout, shared, desc)
        mem = self.alloc(layout.nbytes, name) if memory is None else \
            pool_memory(layout, device, memory, self._mems)
        stage = None
        try:
            if memory is None:  # as Client.kv_pool: allocated here, mapped whole there
                mem.buffer.commit()
            stage = pool_stage(layout, device, mem)
            r = self._c.request("kv_pool", name=name, mem=mem.mem_id, **pool_fields(
                layout, receive, writers, "host" if stage is None else stage.kind))
        except BaseException:
            try:
                if stage is not None:
                    stage.close()
            finally:
                if memory is None:  # the caller's memory stays the caller's
                    self.free(mem)
            raise
        mem.stage = stage
        desc = RegionDescriptor.from_wire(r["descriptor"]) if receive else None
        return KVPool(None, name, layout, mem, desc, stage)

    def kv_push(self, peer: str, pool: str, src: KVPool, src_blocks: Any, dst_blocks: Any, *,
                request: int, layers: Iterable[int] | None = None,
                deadline: float = 30.0) -> KVPushResult:
        """Push and wait for it (the async ``kv_push`` + ``wait``). From a
        device pool, every layer's copy to the mirror is queued at once and
        each layer is pushed as soon as its copy is done (the copies of
        later layers run on the GPU meanwhile)."""
        if src.stage is None:
            return self._push(push_fields(peer, pool, src, src_blocks, dst_blocks, request,
                                          layers, deadline), request)
        t0 = time.perf_counter()
        lays = push_layer_list(src, layers)
        push_fields(peer, pool, src, src_blocks, dst_blocks, request, lays, deadline)  # checks
        staged = src.stage.staged(src_blocks, lays)
        try:
            parts = []
            k = 0
            while k < len(lays):
                staged.ready_sync(k)
                group = lays[k:k + staged.ready_after(k)]  # every layer in the mirror now
                parts.append(self._push(push_fields(peer, pool, src, src_blocks, dst_blocks,
                                                    request, group, deadline), request))
                k += len(group)
        finally:
            staged.close()
        return combine(request, parts, time.perf_counter() - t0)

    def kv_abandon(self, peer: str, pool: str, request: int, *, reason: str = "") -> bool:
        """See :meth:`Client.kv_abandon`."""
        check_reason(reason)
        r = self._c.request("kv_abandon", peer=peer, pool=pool, request=request, reason=reason)
        return bool(r.get("ended"))

    def _push(self, fields: dict[str, Any], request: int) -> KVPushResult:
        r = self._c.request("kv_push", **fields)
        if r.get("cancelled"):
            raise TransferError(f"push of request {request} was cancelled")
        return push_result(request, r)

    def wait_layers(self, pool: KVPool, request: int, upto_layer: int, *, first: int = 0,
                    timeout: float | None = None, blocks: Any = None) -> None:
        """See :meth:`KVPool.wait_layers` (a device pool needs ``blocks``)."""
        pool.need_blocks(blocks)
        deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
        nxt = first
        while nxt <= upto_layer:
            # Host pools wait for the whole range at once; device pools layer
            # by layer, each copied to the device while later ones land.
            upto = upto_layer if pool.stage is None else nxt
            fields: dict[str, Any] = {}
            if timeout is not None:
                fields["timeout_ms"] = max(0, int((deadline - time.monotonic()) * 1000))
            r = self._c.request("kv_wait", pool=pool.name, request=request, first=nxt,
                                upto=upto, **fields)
            done = pool.check_done(request, int(r["done"]), upto, timeout)
            pool.landed()
            if pool.stage is not None:
                events = pool.stage.to_device(blocks, list(range(nxt, min(done, upto_layer + 1))))
                try:
                    pool.stage.sync(events[-1])
                finally:
                    pool.stage.release(events)
            nxt = done

    def status(self) -> dict[str, Any]:
        return self._c.request("status")

    def peers(self) -> list[dict[str, Any]]:
        return list(self._c.request("peers")["peers"])

    def lookup(self, name: str) -> dict[str, Any] | None:
        return next((p for p in self.peers() if p["name"] == name), None)

    def locate(self, region: str) -> list[str]:
        return [str(n) for n in self._c.request("locate", region=region)["nodes"]]

    def add_peer(self, name: str, address: str) -> None:
        self._c.request("add_peer", name=name, address=address)

    def close(self) -> None:
        self._c.close()
        for mem in self._mems:
            mem.close()
        self._mems.clear()

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
