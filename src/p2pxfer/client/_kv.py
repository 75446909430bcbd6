"""KV pages through the node daemon, for inference servers (trio or asyncio).

``Client.kv_pool`` puts a paged KV pool (``p2pxfer.kv_plan.KVLayout``) in memory
shared with the daemon; a receiving (decode) pool is exported under its name.
``Client.kv_push`` pushes blocks of a local pool into a peer's pool, layer by
layer, and returns a ``KVPush`` handle; the decode side awaits layers with
``KVPool.wait_layers`` or iterates them with ``KVPool.layers``. Block tables
travel as int64 ``bin``; the daemons expand and coalesce them (numpy) and
count each layer's pieces (``proto/PROTOCOL.md``, "KV pages"). What must not
live here: any per-block work.

Device memory (``device=`` a CUDA tensor, ``__cuda_array_interface__`` or
DLPack object laid out as the pool's ``KVLayout``) takes the staged path of
``p2pxfer.devmem``: the shared memory is the pool's pinned host mirror, and
this process (not the daemon) does the device copies. A push queues every
layer's device -> mirror copy at once and sends each layer to the daemon as
a push of its own as soon as its copy is done, so copying and the wire
overlap; a wait with ``blocks=`` copies each landed layer to the device
while later ones are still arriving.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import numpy.typing as npt

from p2pxfer.buffers import RegionDescriptor
from p2pxfer.devmem import DeviceMemory, DeviceStage, device_memory, driver
from p2pxfer.errors import DeviceError, InvalidArgument, TransferError, UsageError, WaitTimeout
from p2pxfer.kv_plan import KVLayout, is_int
from p2pxfer.log import get_logger

from ._devshare import DeviceShared

if TYPE_CHECKING:
    from ._client import Client, SharedMemory
    from ._wire import _Pending

__all__ = ["KVPool", "KVPush", "KVPushResult"]

log = get_logger("p2pxfer.client")


def blocks_bin(name: str, blocks: Any) -> bytes:
    """A block table as little-endian int64 bytes (checked: 1-D integers)."""
    arr = np.asarray(blocks)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got {arr.dtype} "
                              f"shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype="<i8").tobytes()


def _i64(data: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(data, dtype="<i8").tolist())


@dataclass(frozen=True)
class KVPushResult:
    """What a push did: its layers, each layer's pieces (after coalescing
    and striping), bytes, seconds in the sending daemon, and seconds until
    its first layer had completed there."""

    request: int
    layers: tuple[int, ...]
    pieces: tuple[int, ...]
    nbytes: int
    seconds: float
    first_layer_seconds: float


class KVPush:
    """A push under way: ``await wait()`` for its result. Cancelling the wait
    (or its ``timeout`` passing: ``WaitTimeout``) cancels the push: the
    sending daemon stops posting and waits for what it posted before the wait
    returns (the source blocks are then yours); a later ``wait`` raises
    ``TransferError``."""

    def __init__(self, client: Client, pending: _Pending, request: int) -> None:
        self._client = client
        self._pending = pending
        self.request = request
        self._result: KVPushResult | None = None

    async def wait(self, *, timeout: float | None = None) -> KVPushResult:
        if self._result is None:
            r = await self._client._conv.finish(self._pending, timeout)
            if r.get("cancelled"):
                raise TransferError(f"push of request {self.request} was cancelled (an "
                                    "earlier wait on it was cancelled or timed out)")
            self._result = push_result(self.request, r)
        return self._result


class StagedKVPush(KVPush):
    """A device pool's push: one daemon push per layer (see the module's
    docstring); ``wait`` combines their results."""

    def __init__(self, client: Client, parts: list[KVPush], request: int, t0: float) -> None:
        self._client = client
        self._parts = parts
        self.request = request
        self._t0 = t0
        self._result = None

    async def wait(self, *, timeout: float | None = None) -> KVPushResult:
        if self._result is None:
            deadline = anyio.current_time() + (float("inf") if timeout is None else timeout)
            results = []
            try:
                for part in self._parts:
                    left = None if timeout is None else max(0.0, deadline - anyio.current_time())
                    results.append(await part.wait(timeout=left))
            except BaseException:
                await stop_parts(self._parts[len(results):])
                raise
            self._result = combine(self.request, results, time.perf_counter() - self._t0)
        return self._result


async def stop_parts(parts: list[KVPush]) -> None:
    """Cancel pushes and wait until the daemon has stopped each (shielded):
    the source blocks are the caller's again."""
    with anyio.CancelScope(shield=True):
        for part in parts:
            with contextlib.suppress(Exception):  # already failing: the first error stands
                await part.wait(timeout=0)


def combine(request: int, parts: list[KVPushResult], seconds: float) -> KVPushResult:
    """The per-layer pushes of one staged push as one result."""
    return KVPushResult(request, tuple(n for r in parts for n in r.layers),
                        tuple(n for r in parts for n in r.pieces),
                        sum(r.nbytes for r in parts), seconds,
                        parts[0].first_layer_seconds if parts else 0.0)


def push_result(request: int, r: dict[str, Any]) -> KVPushResult:
    """A ``kv_push`` reply's result as a ``KVPushResult``."""
    return KVPushResult(request, _i64(r["layers"]), _i64(r["pieces"]), int(r["nbytes"]),
                        float(r["seconds"]), float(r["first_layer_s"]))


class KVPool:
    """A paged KV pool in memory shared with the daemon (``Client.kv_pool``).
    ``array`` is the whole pool; :meth:`block` a view of one block. For a
    device pool (``kind`` ``"cuda"``) they are its host mirror, and
    ``stage`` does the device copies."""

    def __init__(self, client: Client | None, name: str, layout: KVLayout,
                 mem: SharedMemory | DeviceShared, descriptor: RegionDescriptor | None,
                 stage: DeviceStage | None = None) -> None:
        #: None for a ``SyncClient``'s pool: wait through ``SyncClient.wait_layers``
        self._client = client
        self.name = name
        self.layout = layout
        self.mem = mem
        #: set for a receiving pool (peers push into it under ``name``)
        self.descriptor = descriptor
        self.stage = stage
        #: the pool is the device memory itself, registered by the daemon as
        #: is (``Client.share_device``): no mirror, no copies, no ``blocks=``
        self.direct = isinstance(mem, DeviceShared)
        self.kind = "cuda" if self.direct else "host" if stage is None else stage.kind

    def _host(self) -> npt.NDArray[np.uint8]:
        if isinstance(self.mem, DeviceShared):
            raise UsageError(f"pool {self.name!r} is device memory taken as is (direct): it "
                             "has no host array; read it on the device")
        return self.mem.array

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return self._host()[: self.layout.nbytes]

    def block(self, layer: int, block: int, plane: int = 0) -> npt.NDArray[np.uint8]:
        lay = self.layout
        off = layer * lay.layer_stride + block * lay.block_stride + plane * lay.plane_stride
        return self._host()[off:off + lay.block_bytes]

    def landed(self) -> None:
        """After a wait of a direct pool: writes a NIC placed in the GPU's
        memory are visible to work started from now on (GPUDirect RDMA)."""
        if isinstance(self.mem, DeviceShared):
            dev = self.mem.device
            driver().flush_rdma_writes(dev.device)

    async def wait_layers(self, request: int, upto_layer: int, *, first: int = 0,
                          timeout: float | None = None, blocks: Any = None) -> None:
        """Return once layers ``first..upto_layer`` of ``request`` have all
        landed in this pool. ``PeerLost`` when membership says a node pushing
        them died or left; ``WaitTimeout`` when the push's deadline or
        ``timeout`` passes first. A wait that ends early leaves nothing
        behind in the daemon. A device pool needs ``blocks`` (the request's
        block ids here): each layer is copied to the device as it lands,
        and this returns once the copies are done."""
        if self.stage is None:
            await self._wait(request, first, upto_layer, timeout)
            self.landed()
            return
        async for _ in self._landed(request, first, upto_layer, blocks, timeout, overall=True):
            pass

    async def _wait(self, request: int, first: int, upto: int, timeout: float | None) -> int:
        fields: dict[str, Any] = {}
        if timeout is not None:
            fields["timeout_ms"] = max(0, int(timeout * 1000))
        r = await self._async_client()._conv.request("kv_wait", pool=self.name, request=request,
                                                first=first, upto=upto, **fields)
        return self.check_done(request, int(r["done"]), upto, timeout)

    def check_done(self, request: int, done: int, upto: int, timeout: float | None) -> int:
        """A ``kv_wait`` answered ``done`` (the first layer not landed yet):
        ``WaitTimeout`` if layer ``upto`` is not among those landed."""
        if done <= upto:
            raise WaitTimeout(f"request {request}: layer {done} of {self.name!r} had not "
                              f"landed in time ({'deadline' if timeout is None else timeout})")
        return done

    def _async_client(self) -> Client:
        if self._client is None:
            raise UsageError(f"pool {self.name!r} belongs to a SyncClient: wait on it with "
                             "SyncClient.wait_layers")
        return self._client

    async def layers(self, request: int, *, first: int = 0, upto: int | None = None,
                     timeout: float | None = None, blocks: Any = None) -> AsyncIterator[int]:
        """Layers ``first..upto`` (default: the last) of ``request``, in
        order, each as soon as it (and every layer before it) has landed;
        several at once when they landed together. ``timeout`` bounds each
        wait. A device pool needs ``blocks``: a layer is yielded once it is
        on the device."""
        last = self.layout.num_layers - 1 if upto is None else upto
        async for landed in self._landed(request, first, last, blocks, timeout, overall=False):
            for layer in landed:
                yield layer

    async def _landed(self, request: int, first: int, last: int, blocks: Any,
                      timeout: float | None, *, overall: bool) -> AsyncIterator[list[int]]:
        """Runs of layers ``first..last`` as they land, a device pool's
        copied to the device first. ``timeout`` bounds each wait, or with
        ``overall`` all of them together."""
        self.need_blocks(blocks)
        deadline = anyio.current_time() + (float("inf") if timeout is None else timeout)
        nxt = first
        while nxt <= last:
            left = (max(0.0, deadline - anyio.current_time())
                    if overall and timeout is not None else timeout)
            done = await self._wait(request, nxt, nxt, left)
            landed = list(range(nxt, min(done, last + 1)))
            if self.stage is not None:
                await self.stage.copy_in(blocks, landed)
            self.landed()
            yield landed
            nxt = done

    def need_blocks(self, blocks: Any) -> None:
        if self.stage is not None and blocks is None:
            raise InvalidArgument(f"pool {self.name!r} is device memory: its waits need "
                                  "blocks= (the block ids to copy to the device)")

    async def forget(self, request: int, *, refuse: bool = False) -> None:
        """Drop the daemon's bookkeeping of ``request`` (its id may then be
        pushed again); waits on it end with ``UnknownRegion``. ``refuse``:
        give the request up but keep refusing pushes of it (a sender's next
        ``kv_begin`` is answered ``bad_request``) until it is forgotten
        without ``refuse``."""
        fields: dict[str, Any] = {"refuse": True} if refuse else {}
        await self._async_client()._conv.request("kv_forget", pool=self.name, request=request,
                                                 **fields)


def pool_stage(layout: KVLayout, device: Any, mem: SharedMemory) -> DeviceStage | None:
    """The device copies of a pool made with ``device=`` (None: a host pool)."""
    if device is None:
        return None
    dev = device_memory(device)
    if dev is None:
        raise InvalidArgument(f"device= must be device memory, got host memory "
                              f"({type(device).__name__}): leave it out for a host pool")
    return DeviceStage(dev, mem.array, layout)


def pool_memory(layout: KVLayout, device: Any, memory: SharedMemory,
                mems: list[Any]) -> SharedMemory:
    """``kv_pool(memory=...)`` checked: shared memory of this client, large
    enough for ``layout``, for a host pool (a device pool's mirror is its own)."""
    if not any(memory is m for m in mems):
        raise InvalidArgument("memory= must be shared memory this client allocated (alloc), "
                              f"got {type(memory).__name__}")
    if device is not None or memory.stage is not None:
        raise InvalidArgument("a device pool stages through memory of its own: leave memory= "
                              "out, and give no device pool's memory")
    if memory.nbytes < layout.nbytes:
        raise InvalidArgument(f"the pool's layout needs {layout.nbytes} bytes, memory= has "
                              f"{memory.nbytes}")
    return memory


def tries_direct(layout: KVLayout, device: Any, memory: Any, direct: bool | None) -> bool:
    """``kv_pool``'s arguments checked: whether to try the direct path
    (device memory, no ``memory=``, ``direct`` not False)."""
    if not isinstance(layout, KVLayout):
        raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
    if direct and (device is None or memory is not None):
        raise InvalidArgument("direct=True is for a device pool (device=) without memory=")
    return device is not None and memory is None and direct is not False


def direct_device(name: str, layout: KVLayout, device: Any, direct: bool | None,
                  takes: bool | None) -> DeviceMemory | None:
    """The device memory of a pool to take as is (``share_device`` next),
    or None where it stages. ``takes``: the daemon's ``status``
    ``device_memory`` (None: a daemon that predates ``share_device``, which
    must never be sent one). Where the daemon does not take device memory
    the pool stages without a driver call, unless ``direct`` insists: then
    the daemon is asked, and says why not. May load the driver (blocking)."""
    if takes is None or (not takes and not direct):
        staged_after(DeviceError("the daemon does not take device memory as is " + (
            "(it predates share_device)" if takes is None else
            "(status device_memory is false)")), direct, name)
        return None
    dev = device_memory(device)
    if dev is None:
        return None  # host memory: the staged path says what is wrong with it
    if dev.nbytes < layout.nbytes:
        raise InvalidArgument(f"device memory holds {dev.nbytes} bytes, the layout needs "
                              f"{layout.nbytes}")
    return dev


def pool_fields(layout: KVLayout, receive: bool, writers: Iterable[int] | None,
                kind: str) -> dict[str, Any]:
    """A ``kv_pool`` request's fields but its name and memory."""
    fields: dict[str, Any] = {"layout": layout.to_wire(), "receive": receive}
    if writers is not None:
        fields["writers"] = list(writers)
    if kind != "host":  # a daemon that predates the field still takes host pools
        fields["memory"] = kind
    return fields


def staged_after(exc: DeviceError, direct: bool | None, name: str) -> None:
    """Device memory cannot be taken as is (the daemon refused it, or CUDA
    cannot hand it over): raise where the caller insisted on the direct
    path, else the pool stages."""
    if direct:
        raise exc
    log.info("kv.pool_staged", pool=name, reason=str(exc))


async def open_pool(client: Client, name: str, layout: KVLayout, receive: bool,
                    writers: Iterable[int] | None = None, device: Any = None,
                    memory: SharedMemory | None = None, direct: bool | None = None) -> KVPool:
    dev = None
    if tries_direct(layout, device, memory, direct):
        takes = await client.takes_device_memory()
        # Off the loop: the first driver call loads the driver.
        dev = await anyio.to_thread.run_sync(direct_device, name, layout, device, direct, takes)
    if dev is not None:
        try:
            shared = await client.share_device(dev)
        except DeviceError as exc:
            staged_after(exc, direct, name)
        else:
            try:
                r = await client._conv.request("kv_pool", name=name, mem=shared.mem_id,
                                               **pool_fields(layout, receive, writers, "cuda"))
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await client.free(shared)
                raise
            desc = RegionDescriptor.from_wire(r["descriptor"]) if receive else None
            return KVPool(client, name, layout, shared, desc)
    mem = await client.alloc(layout.nbytes, name) if memory is None else \
        pool_memory(layout, device, memory, client._mems)
    stage = None
    try:
        if memory is None:  # the pool is used whole: its pages are ours, mapped by the daemon
            await anyio.to_thread.run_sync(mem.buffer.commit)
        stage = pool_stage(layout, device, mem)
        r = await client._conv.request("kv_pool", name=name, mem=mem.mem_id, **pool_fields(
            layout, receive, writers, "host" if stage is None else stage.kind))
    except BaseException:
        try:
            if stage is not None:
                stage.close()
        finally:
            if memory is None:  # the caller's memory stays the caller's
                await client.free(mem)
        raise
    mem.stage = stage
    desc = RegionDescriptor.from_wire(r["descriptor"]) if receive else None
    return KVPool(client, name, layout, mem, desc, stage)


def push_layer_list(src: KVPool, layers: Iterable[int] | None) -> list[int]:
    """A staged push's layers, checked here (each goes as its own push)."""
    n = src.layout.num_layers
    want = list(range(n)) if layers is None else list(layers)
    if not want or any(not is_int(k) or not 0 <= k < n for k in want):
        raise InvalidArgument(f"layers must be integers within 0..{n - 1}, got {want}")
    return sorted(set(want))


def push_fields(peer: str, pool: str, src: KVPool, src_blocks: Any, dst_blocks: Any,
                request: int, layers: Iterable[int] | None, deadline: float) -> dict[str, Any]:
    """A ``kv_push`` request's fields, checked (both clients send it)."""
    if not isinstance(src, KVPool):
        raise InvalidArgument(f"src must be a KVPool, got {type(src).__name__}")
    if deadline <= 0:
        raise InvalidArgument(f"deadline must be > 0 seconds, got {deadline}")
    fields: dict[str, Any] = {
        "peer": peer, "pool": pool, "src": src.name,
        "src_blocks": blocks_bin("src_blocks", src_blocks),
        "dst_blocks": blocks_bin("dst_blocks", dst_blocks), "request": request,
        "deadline_ms": max(1, int(deadline * 1000))}
    if layers is not None:
        fields["layers"] = blocks_bin("layers", list(layers))
    return fields


async def start_push(client: Client, peer: str, pool: str, src: KVPool, src_blocks: Any,
                     dst_blocks: Any, request: int, layers: Iterable[int] | None,
                     deadline: float) -> KVPush:
    if src.stage is None:
        pending = await client._conv.start("kv_push", **push_fields(
            peer, pool, src, src_blocks, dst_blocks, request, layers, deadline))
        return KVPush(client, pending, request)
    return await _start_staged(client, peer, pool, src, src_blocks, dst_blocks, request,
                               push_layer_list(src, layers), deadline)


async def _start_staged(client: Client, peer: str, pool: str, src: KVPool, src_blocks: Any,
                        dst_blocks: Any, request: int, layers: list[int],
                        deadline: float) -> KVPush:
    stage = src.stage
    assert stage is not None
    t0 = time.perf_counter()
    push_fields(peer, pool, src, src_blocks, dst_blocks, request, layers, deadline)  # checks
    staged = stage.staged(src_blocks, layers)
    parts: list[KVPush] = []
    try:
        k = 0
        while k < len(layers):
            await staged.ready(k)
            # Every layer already in the mirror goes in this push: one
            # request slot on the receiver per push, not per layer.
            group = layers[k:k + staged.ready_after(k)]
            pending = await client._conv.start("kv_push", **push_fields(
                peer, pool, src, src_blocks, dst_blocks, request, group, deadline))
            parts.append(KVPush(client, pending, request))
            k += len(group)
    except BaseException:
        await stop_parts(parts)
        raise
    finally:
        await staged.aclose()
    return StagedKVPush(client, parts, request, t0)
