"""KV-cache page push: prefill nodes write KV blocks into decode nodes' pools,
layer by layer, and decode waits per layer.

What lives here: ``KVPool`` (a registered, exported pool plus the receiving
side's requests) and ``push_pages`` (a planned push on an ``Engine``). The
layout, the plan and the immediate encoding are ``p2pxfer.kv_plan`` (no
fabric; re-exported here); posting a push layer by layer and counting a
request's layers are ``p2pxfer._kv_core``'s, the same as the daemon's. What
must not: a Python loop over blocks or pieces, a second push loop or layer
count. Engine-side state here is the engine's trio thread's (``_Receiver``
checks it).

Each layer is one transfer in the engine's notify mode: its immediate
(``request_base(request) | layer``) arrives once, after every piece of the
layer is in the receiver's memory, so every layer brings exactly one
notification (striping may split pieces; the receiver needs no piece
count), and a layer whose rail breaks fails over intact.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer._kv_core import LayerArrivals, LayerSend, push_layers
from p2pxfer.devmem import DeviceStage, device_memory, driver
from p2pxfer.engine import Engine
from p2pxfer.engine._owner import ThreadOwner
from p2pxfer.errors import (
    DescriptorError,
    FabricError,
    InvalidArgument,
    RegistrationError,
    TransferError,
    WaitTimeout,
)
from p2pxfer.kv_plan import (
    KV_TAG,
    MAX_LAYERS,
    MAX_REQUEST,
    ORDERS,
    TAG_SHIFT,
    KVLayout,
    KVPoolDescriptor,
    decode_imm,
    encode_imm,
    expand_pages,
    is_int,
    layer_imm,
    plan_push,
    request_base,
)
from p2pxfer.log import get_logger
from p2pxfer.scatter import ScatterList

__all__ = [
    "MAX_LAYERS",
    "MAX_REQUEST",
    "ORDERS",
    "KVLayout",
    "KVPool",
    "KVPoolDescriptor",
    "PushResult",
    "decode_imm",
    "encode_imm",
    "expand_pages",
    "plan_push",
    "push_pages",
]

log = get_logger("p2pxfer.kv")

I64 = npt.NDArray[np.int64]


def _host_buffer(buffer: Any) -> Any:
    """A buffer-protocol view of numpy arrays, CPU torch tensors (any dtype,
    through a uint8 view), client shared memory, or anything with a buffer."""
    mod = type(buffer).__module__
    if mod.startswith("torch"):
        if buffer.device.type != "cpu":
            raise RegistrationError(f"a {buffer.device.type} tensor is neither host nor CUDA "
                                    "memory: pass either")
        if not buffer.is_contiguous():
            raise InvalidArgument("the torch tensor must be contiguous")
        torch = importlib.import_module("torch")  # only here: torch is optional
        return buffer.view(-1).view(torch.uint8).numpy()
    if hasattr(buffer, "mem_id") and hasattr(buffer, "array"):  # client SharedMemory
        return buffer.array
    return buffer


class _Receiver:
    """Per-engine bookkeeping of KV arrivals, keyed by request id (request ids
    are the receiving node's: the decode side hands them out). Every layer
    brings one notification (notify mode), known in advance."""

    def __init__(self, engine: Engine) -> None:
        self.requests: dict[int, LayerArrivals] = {}
        self._owner = ThreadOwner("the engine's trio thread")
        engine.route_imms(TAG_SHIFT, KV_TAG, self.arrival)

    def get(self, request_id: int, layers: int = 0) -> LayerArrivals:
        self._owner.require("KV request bookkeeping")
        req = self.requests.get(request_id)
        if req is None:
            req = self.requests[request_id] = LayerArrivals.for_layers(layers, expected=1)
        req.widen(layers, expected=1)
        return req

    def arrival(self, imm: int, count: int) -> None:
        request_id, layer = decode_imm(imm)
        self.get(request_id, layer + 1).arrive(layer, count)


def _receiver(engine: Engine) -> _Receiver:
    rx = engine.attachments.get("kv")
    if not isinstance(rx, _Receiver):
        rx = engine.attachments["kv"] = _Receiver(engine)
    return rx


class KVPool:
    """A paged KV pool registered with an engine and exported as ``name``.

    Wraps existing host memory (numpy, CPU torch tensors, client shared
    memory) or allocates it. As a destination, :meth:`wait_layers` tells
    decode when a request's layers have landed.

    Device memory (a CUDA tensor, ``__cuda_array_interface__`` or DLPack
    object laid out as ``layout``) takes the staged path
    (``p2pxfer.devmem``): the pool gets a pinned host mirror of the same
    layout, which is what is registered and exported; a push copies its
    blocks device -> mirror layer by layer while earlier layers are on the
    wire, and ``wait_layers(..., blocks=)`` copies each landed layer mirror
    -> device. ``kind`` says which (``"host"`` or ``"cuda"``); ``array`` and
    :meth:`block` are the mirror then. An engine opened with
    ``EngineConfig.hmem`` on a provider that registers CUDA memory
    (``FI_HMEM``) takes the device memory as is instead (``direct``: peers
    write straight into it, no mirror, no copies, no ``blocks=``); where the
    provider refuses it, the pool is staged.
    """

    def __init__(self, engine: Engine, name: str, layout: KVLayout,
                 buffer: Any = None) -> None:
        self.engine = engine
        self.name = name
        self.layout = layout
        dev = None if buffer is None else device_memory(buffer)
        self.stage: DeviceStage | None = None  #: a device pool's staged copies
        self.direct = False  #: device memory registered as is (FI_HMEM)
        self._device = dev
        if dev is not None and dev.nbytes < layout.nbytes:
            raise InvalidArgument(f"device memory holds {dev.nbytes} bytes, the layout "
                                  f"needs {layout.nbytes}")
        if dev is not None and engine.config.hmem:
            try:
                self.region = engine.export(dev, name)
            except (RegistrationError, FabricError) as exc:
                log.info("kv.pool_staged", pool=name, reason=str(exc))
            else:
                self.direct = True
        mem: Any = dev if self.direct else (
            np.zeros(layout.nbytes, np.uint8) if buffer is None or dev is not None
            else _host_buffer(buffer))
        self.kind = "host" if dev is None else dev.kind
        self.buffer = mem
        self.nbytes = dev.nbytes if self.direct and dev is not None else \
            memoryview(mem).nbytes
        if self.nbytes < layout.nbytes:
            raise InvalidArgument(f"pool memory holds {self.nbytes} bytes, the layout "
                                  f"needs {layout.nbytes}")
        self._array: npt.NDArray[np.uint8] | None = None
        if not self.direct:
            self._array = np.frombuffer(memoryview(mem).cast("B"), np.uint8)
        if dev is not None and self._array is not None:
            self.stage = DeviceStage(dev, self._array, layout)
        if not self.direct:
            try:
                self.region = engine.export(mem, name)
            except BaseException:
                self.close()
                raise
        self._rx = _receiver(engine)
        log.info("kv.pool", pool=name, kind=self.kind, direct=self.direct,
                 nbytes=layout.nbytes)

    def close(self) -> None:
        """Stop exporting the pool; a device pool's mirror is unpinned."""
        if getattr(self, "region", None) is not None and self.name in self.engine.exported():
            self.engine.unexport(self.name)
        if self.stage is not None:
            self.stage.close()

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The pool's host bytes (a staged device pool's mirror)."""
        if self._array is None:
            raise InvalidArgument(f"pool {self.name!r} is device memory registered as is: it "
                                  "has no host view")
        return self._array

    def describe(self) -> KVPoolDescriptor:
        return KVPoolDescriptor(self.region, self.layout)

    def block(self, layer: int, block: int, plane: int = 0) -> npt.NDArray[np.uint8]:
        """A view of one block (for filling and checking)."""
        lay = self.layout
        off = layer * lay.layer_stride + block * lay.block_stride + plane * lay.plane_stride
        return self.array[off:off + lay.block_bytes]

    async def wait_layers(self, request_id: int, upto_layer: int, *,
                          layers: Iterable[int] | None = None,
                          timeout: float | None = None, blocks: Any = None) -> None:
        """Return once every block of layers ``0..upto_layer`` (or of
        ``layers``) of ``request_id`` has landed here. Raises ``TransferError``
        if the request was failed (:meth:`fail_request`), ``WaitTimeout`` if
        ``timeout`` passes first (a sender that died sends nothing more).
        Cancellation leaves the bookkeeping as it was.

        A device pool needs ``blocks`` (the request's block ids here): each
        layer is copied to the device as soon as it has landed, while later
        layers are still arriving, and the call returns once the last copy
        is done."""
        n_layers = self.layout.num_layers
        if not is_int(upto_layer) or not 0 <= upto_layer < n_layers:
            raise InvalidArgument(f"upto_layer {upto_layer!r} is outside 0..{n_layers - 1}")
        want = sorted(set(range(upto_layer + 1) if layers is None else layers))
        if any(not is_int(n) or not 0 <= n < n_layers for n in want):
            raise InvalidArgument(f"layers must be within 0..{n_layers - 1}, got {want}")
        if timeout is not None and timeout < 0:
            raise InvalidArgument(f"timeout must be >= 0, got {timeout}")
        if self.stage is not None and blocks is None:
            raise InvalidArgument(f"pool {self.name!r} is device memory: wait_layers needs "
                                  "blocks= (the block ids to copy to the device)")
        req = self._rx.get(request_id, n_layers)
        deadline = trio.current_time() + (math.inf if timeout is None else timeout)
        steps = [want] if self.stage is None else [[n] for n in want]
        events: list[int] = []
        try:
            for step in steps:
                left = max(0.0, deadline - trio.current_time())
                if not await req.wait(np.asarray(step, np.int64), left):
                    gap = [n for n in want if not req.complete()[n]]
                    raise WaitTimeout(f"request {request_id}: layers {gap} had not landed "
                                      f"after {timeout} s")
                if self.stage is not None:  # issued off the loop (see DeviceStage.copy_in)
                    events += await trio.to_thread.run_sync(self.stage.to_device, blocks, step)
            if self.stage is not None and events:
                await self.stage.wait(events[-1])  # one stream: the last covers all
            if self.direct and self._device is not None:
                # What the NIC placed must be visible to the kernels that
                # read it next (GPUDirect RDMA writes are not ordered with them).
                driver().flush_rdma_writes(self._device.device)
        finally:
            if self.stage is not None:
                self.stage.release(events)
        await trio.lowlevel.checkpoint()

    def layers_done(self, request_id: int) -> list[int]:
        req = self._rx.get(request_id)
        return [int(n) for n in np.flatnonzero(req.complete())]  # a row per layer

    def fail_request(self, request_id: int, reason: str) -> None:
        """End every wait on ``request_id`` with ``TransferError(reason)``."""
        req = self._rx.get(request_id)
        req.error = TransferError(f"request {request_id} failed: {reason}")  # the latest stands
        req.wake()

    def forget(self, request_id: int) -> None:
        """Drop a finished request's bookkeeping (its id may then be reused)."""
        self._rx.requests.pop(request_id, None)


@dataclass(frozen=True)
class PushResult:
    request_id: int
    layers: tuple[int, ...]
    pieces: tuple[int, ...]  # per layer, after coalescing and striping
    nbytes: int
    seconds: float
    first_layer_seconds: float


async def push_pages(engine: Engine, src_pool: KVPool, dst_pool: KVPoolDescriptor,
                     src_blocks: Any, dst_blocks: Any, *, request_id: int,
                     layers: Iterable[int] | None = None, coalesce: bool = True
                     ) -> PushResult:
    """Write blocks ``src_blocks`` of ``src_pool`` into blocks ``dst_blocks``
    of the peer's pool, one transfer per layer, posted in layer order so the
    receiver can start on layer 0 while later layers are in flight.

    Everything is validated before anything is posted (block indices, layers,
    layouts). Returns when every layer has completed; a failure raises
    ``TransferError`` after the posted pieces have finished.
    """
    if not isinstance(dst_pool, KVPoolDescriptor):
        raise DescriptorError(f"dst_pool must be a KVPoolDescriptor, got {type(dst_pool)}")
    base = request_base(request_id)
    plan = plan_push(
        src_pool.layout, dst_pool.layout, src_blocks, dst_blocks, layers,
        src_size=src_pool.nbytes, dst_size=dst_pool.region.length, coalesce=coalesce)
    t0 = time.perf_counter()
    # A device pool: its layers are copied to the mirror one after another
    # (issued by a thread), and each goes out once its own copy is done.
    staged = None if src_pool.stage is None else src_pool.stage.staged(src_blocks, plan.layers)
    index = {layer: k for k, layer in enumerate(plan.layers)}

    async def submit(layer: int, sl: ScatterList) -> LayerSend:
        if staged is not None:
            await staged.ready(index[layer])
        # A layer is pushed once per request: its notification may go early.
        return await engine.submit(src_pool.buffer, dst_pool.region, sl,
                                   imm=layer_imm(base, layer), notify=True, notify_early=True)

    try:
        pieces, first = await push_layers(plan, submit)
    finally:
        if staged is not None:
            await staged.aclose()
    seconds = time.perf_counter() - t0
    log.debug("kv.push_complete", request_id=request_id, layers=len(plan.layers),
              nbytes=plan.nbytes, seconds=seconds)
    return PushResult(request_id, tuple(plan.layers), tuple(pieces), plan.nbytes, seconds,
                      first - t0)
