"""KV-cache page push: prefill nodes write KV blocks into decode nodes' pools,
layer by layer, and decode waits per layer.

What lives here: ``KVLayout`` (where block ``b`` of layer ``l``, plane ``p``
sits in a pool), ``KVPool`` (a registered, exported pool plus the receiving
side's per-layer bookkeeping), ``push_pages`` (block tables -> one scatter list
per layer, coalesced, posted in layer order) and the immediate encoding that
tells the receiver which layer of which request has landed. What must not: a
Python loop over blocks or pieces (numpy does the expansion).

Each layer is one transfer in the engine's notify mode: its immediate arrives
once, after every piece of the layer is in the receiver's memory, so the
receiver needs no piece count (striping may split pieces), and a layer whose
rail breaks fails over intact. Immediate layout, 32 bits so it runs where
the fabric carries 4 bytes of CQ data (EFA, verbs, ``imm_bytes = 4``) as
well as 8: ``tag:4 | request:16 | layer:12``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog
import trio

from p2pxfer.engine import Engine, Transfer
from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    RegistrationError,
    TransferError,
    WaitTimeout,
)
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

__all__ = [
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

log = structlog.get_logger("p2pxfer.kv")

I64 = npt.NDArray[np.int64]

KV_TAG = 0xA
REQUEST_BITS, LAYER_BITS = 16, 12
TAG_SHIFT = REQUEST_BITS + LAYER_BITS  # 28: the tag is the top 4 of 32 bits
MAX_REQUEST = (1 << REQUEST_BITS) - 1
MAX_LAYERS = 1 << LAYER_BITS

ORDERS = ("layer_major", "block_major", "plane_major")


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def encode_imm(request_id: int, layer: int) -> int:
    if not _is_int(request_id) or not 0 <= request_id <= MAX_REQUEST:
        raise InvalidArgument(f"request_id {request_id} must be in 0..{MAX_REQUEST}")
    if not _is_int(layer) or not 0 <= layer < MAX_LAYERS:
        raise InvalidArgument(f"layer {layer} must be in 0..{MAX_LAYERS - 1}")
    return (KV_TAG << TAG_SHIFT) | (request_id << LAYER_BITS) | layer


def decode_imm(imm: int) -> tuple[int, int]:
    """(request_id, layer) of a KV immediate."""
    return (imm >> LAYER_BITS) & MAX_REQUEST, imm & (MAX_LAYERS - 1)


@dataclass(frozen=True)
class KVLayout:
    """Where every block of a paged KV pool lives.

    A pool holds ``num_layers`` x ``planes`` x ``num_blocks`` blocks of
    ``block_bytes`` each (``planes=2`` keeps K and V apart). ``order`` picks
    the strides: ``layer_major`` is ``[layer][plane][block]``, ``block_major``
    ``[block][layer][plane]``, ``plane_major`` ``[plane][layer][block]``
    (K and V as two big planes). Explicit strides override the order's.
    """

    num_layers: int
    num_blocks: int
    block_bytes: int
    planes: int = 1
    order: str = "layer_major"
    layer_stride: int = 0
    block_stride: int = 0
    plane_stride: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_bytes", "planes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be an integer > 0, got {v!r}")
        if self.order not in ORDERS:
            raise InvalidArgument(f"KVLayout.order must be one of {ORDERS}, got {self.order!r}")
        if self.num_layers > MAX_LAYERS:
            raise InvalidArgument(f"at most {MAX_LAYERS} layers, got {self.num_layers}")
        nl, nb, bb, npl = self.num_layers, self.num_blocks, self.block_bytes, self.planes
        layer, block, plane = {
            "layer_major": (npl * nb * bb, bb, nb * bb),
            "block_major": (npl * bb, nl * npl * bb, bb),
            "plane_major": (nb * bb, bb, nl * nb * bb),
        }[self.order]
        for name, default in (("layer_stride", layer), ("block_stride", block),
                              ("plane_stride", plane)):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise InvalidArgument(f"KVLayout.{name} must be an integer >= 0, got {v!r}")
            object.__setattr__(self, name, int(v) or default)
        # No two blocks may overlap: nest the dimensions by stride and check
        # each stride clears everything below it.
        extent = bb
        for stride, count in sorted([(self.layer_stride, nl), (self.block_stride, nb),
                                     (self.plane_stride, npl)]):
            if count > 1:
                if stride < extent:
                    raise InvalidArgument(f"KVLayout strides overlap: a stride of {stride} "
                                          f"bytes is smaller than the {extent} bytes it "
                                          "must step over")
                extent = stride * (count - 1) + extent

    @property
    def nbytes(self) -> int:
        """Bytes the pool must span (last block's end)."""
        return ((self.num_layers - 1) * self.layer_stride + (self.num_blocks - 1)
                * self.block_stride + (self.planes - 1) * self.plane_stride + self.block_bytes)

    @property
    def block_contiguous(self) -> bool:
        """Consecutive blocks of one layer and plane are adjacent in memory."""
        return self.block_stride == self.block_bytes

    def compatible(self, other: KVLayout) -> str | None:
        """Why blocks of ``self`` cannot be copied into ``other`` (None if they can)."""
        for name in ("num_layers", "block_bytes", "planes"):
            if getattr(self, name) != getattr(other, name):
                return (f"{name} differs: source {getattr(self, name)}, destination "
                        f"{getattr(other, name)}")
        return None

    def to_wire(self) -> dict[str, Any]:
        return {"layers": self.num_layers, "blocks": self.num_blocks, "block_bytes":
                self.block_bytes, "planes": self.planes, "order": self.order,
                "strides": [self.layer_stride, self.block_stride, self.plane_stride]}

    @classmethod
    def from_wire(cls, obj: Any) -> KVLayout:
        try:
            ls, bs, ps = obj["strides"]
            return cls(obj["layers"], obj["blocks"], obj["block_bytes"], obj["planes"],
                       obj["order"], ls, bs, ps)
        except (KeyError, TypeError, ValueError) as exc:
            raise DescriptorError(f"malformed KV layout: {exc!r}") from exc


@dataclass(frozen=True)
class KVPoolDescriptor:
    """What a sender needs to push into a pool: its region and its layout."""

    region: RegionDescriptor
    layout: KVLayout

    def to_wire(self) -> dict[str, Any]:
        return {"region": self.region.to_wire(), "layout": self.layout.to_wire()}

    @classmethod
    def from_wire(cls, obj: Any) -> KVPoolDescriptor:
        if not isinstance(obj, dict) or set(obj) != {"region", "layout"}:
            raise DescriptorError("malformed KV pool descriptor: want {region, layout}")
        return cls(RegionDescriptor.from_wire(obj["region"]), KVLayout.from_wire(obj["layout"]))


def _host_buffer(buffer: Any) -> Any:
    """A buffer-protocol view of numpy arrays, CPU torch tensors (any dtype,
    through a uint8 view), client shared memory, or anything with a buffer."""
    mod = type(buffer).__module__
    if mod.startswith("torch"):
        if buffer.device.type != "cpu":
            raise RegistrationError(
                f"a {buffer.device.type} tensor needs FI_HMEM device registration, which "
                "this build does not do yet: pass host memory")
        if not buffer.is_contiguous():
            raise InvalidArgument("the torch tensor must be contiguous")
        torch = importlib.import_module("torch")  # only here: torch is optional
        return buffer.view(-1).view(torch.uint8).numpy()
    if hasattr(buffer, "mem_id") and hasattr(buffer, "array"):  # client SharedMemory
        return buffer.array
    return buffer


@dataclass
class _Request:
    arrived: set[int] = field(default_factory=set)  # layers whose notification came
    error: str | None = None
    changed: trio.Event = field(default_factory=trio.Event)


class _Receiver:
    """Per-engine bookkeeping of KV arrivals, keyed by request id (request ids
    are the receiving node's: the decode side hands them out)."""

    def __init__(self, engine: Engine) -> None:
        self.requests: dict[int, _Request] = {}
        engine.route_imms(TAG_SHIFT, KV_TAG, self.arrival)

    def get(self, request_id: int) -> _Request:
        return self.requests.setdefault(request_id, _Request())

    def arrival(self, imm: int, count: int) -> None:
        request_id, layer = decode_imm(imm)
        req = self.get(request_id)
        req.arrived.add(layer)
        req.changed.set()
        req.changed = trio.Event()


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
    """

    def __init__(self, engine: Engine, name: str, layout: KVLayout,
                 buffer: Any = None) -> None:
        self.engine = engine
        self.name = name
        self.layout = layout
        mem: Any = np.zeros(layout.nbytes, np.uint8) if buffer is None else _host_buffer(buffer)
        self.buffer = mem
        self.array: npt.NDArray[np.uint8] = np.frombuffer(memoryview(mem).cast("B"), np.uint8)
        if self.array.nbytes < layout.nbytes:
            raise InvalidArgument(f"pool memory holds {self.array.nbytes} bytes, the layout "
                                  f"needs {layout.nbytes}")
        self.region = engine.export(mem, name)
        self._rx = _receiver(engine)

    def describe(self) -> KVPoolDescriptor:
        return KVPoolDescriptor(self.region, self.layout)

    def block(self, layer: int, block: int, plane: int = 0) -> npt.NDArray[np.uint8]:
        """A view of one block (for filling and checking)."""
        lay = self.layout
        off = layer * lay.layer_stride + block * lay.block_stride + plane * lay.plane_stride
        return self.array[off:off + lay.block_bytes]

    async def wait_layers(self, request_id: int, upto_layer: int, *,
                          layers: Iterable[int] | None = None,
                          timeout: float | None = None) -> None:
        """Return once every block of layers ``0..upto_layer`` (or of
        ``layers``) of ``request_id`` has landed here. Raises ``TransferError``
        if the request was failed (:meth:`fail_request`), ``WaitTimeout`` if
        ``timeout`` passes first (a sender that died sends nothing more).
        Cancellation leaves the bookkeeping as it was."""
        n_layers = self.layout.num_layers
        if not _is_int(upto_layer) or not 0 <= upto_layer < n_layers:
            raise InvalidArgument(f"upto_layer {upto_layer!r} is outside 0..{n_layers - 1}")
        want = sorted(set(range(upto_layer + 1) if layers is None else layers))
        if any(not _is_int(n) or not 0 <= n < n_layers for n in want):
            raise InvalidArgument(f"layers must be within 0..{n_layers - 1}, got {want}")
        if timeout is not None and timeout < 0:
            raise InvalidArgument(f"timeout must be >= 0, got {timeout}")
        req = self._rx.get(request_id)

        def missing() -> list[int]:
            if req.error is not None:
                raise TransferError(f"request {request_id} failed: {req.error}")
            return [n for n in want if n not in req.arrived]

        with trio.move_on_after(float("inf") if timeout is None else timeout):
            while missing():
                await req.changed.wait()
        if gap := missing():
            raise WaitTimeout(f"request {request_id}: layers {gap} had not landed after "
                              f"{timeout} s")
        await trio.lowlevel.checkpoint()

    def layers_done(self, request_id: int) -> list[int]:
        req = self._rx.get(request_id)
        return sorted(req.arrived)

    def fail_request(self, request_id: int, reason: str) -> None:
        """End every wait on ``request_id`` with ``TransferError(reason)``."""
        req = self._rx.get(request_id)
        req.error = reason
        req.changed.set()
        req.changed = trio.Event()

    def forget(self, request_id: int) -> None:
        """Drop a finished request's bookkeeping (its id may then be reused)."""
        self._rx.requests.pop(request_id, None)


def _blocks(name: str, blocks: Any, num_blocks: int) -> I64:
    arr = np.asarray(blocks)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got {arr.dtype} "
                              f"shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        bad = int(arr[(arr < 0) | (arr >= num_blocks)][0])
        raise InvalidArgument(f"{name} holds block {bad}, outside 0..{num_blocks - 1}")
    return arr


def expand_pages(src: KVLayout, dst: KVLayout, src_blocks: I64, dst_blocks: I64,
                 layers: Sequence[int], *, coalesce: bool = True
                 ) -> tuple[I64, I64, I64, I64]:
    """Pieces of every (layer, plane, block) pair, vectorized: returns
    (src offsets, dst offsets, lengths, pieces per layer). Adjacent blocks
    that are adjacent on both sides become one piece (never across layers)."""
    lay = np.asarray(layers, np.int64)
    planes = np.arange(src.planes, dtype=np.int64)
    n = len(src_blocks)
    so = (lay[:, None, None] * src.layer_stride + planes[None, :, None] * src.plane_stride
          + src_blocks[None, None, :] * src.block_stride).reshape(-1)
    do = (lay[:, None, None] * dst.layer_stride + planes[None, :, None] * dst.plane_stride
          + dst_blocks[None, None, :] * dst.block_stride).reshape(-1)
    bb = src.block_bytes
    per_layer = src.planes * n
    if not coalesce or len(so) == 0:
        return so, do, np.full(len(so), bb, np.int64), np.full(len(lay), per_layer, np.int64)
    brk = np.ones(len(so), bool)
    brk[1:] = (so[1:] != so[:-1] + bb) | (do[1:] != do[:-1] + bb)
    brk[::per_layer] = True  # a layer is its own transfer
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(so))) * bb
    counts = np.bincount(starts // per_layer, minlength=len(lay)).astype(np.int64)
    return so[starts], do[starts], lengths.astype(np.int64), counts


def plan_push(s_lay: KVLayout, d_lay: KVLayout, src_blocks: Any, dst_blocks: Any,
              layers: Iterable[int] | None, *, src_size: int, dst_size: int,
              coalesce: bool = True) -> tuple[list[int], I64, I64, I64, I64]:
    """Check a push (layouts, block indices, layers, pool sizes) and expand
    it: (layers in order, src offsets, dst offsets, lengths, pieces per
    layer). Shared by the in-process ``push_pages`` and the daemon's KV
    push; raises ``InvalidArgument`` naming what is wrong, before anything
    is posted."""
    if (why := s_lay.compatible(d_lay)) is not None:
        raise InvalidArgument(f"pool layouts do not match: {why}")
    sb = _blocks("src_blocks", src_blocks, s_lay.num_blocks)
    db = _blocks("dst_blocks", dst_blocks, d_lay.num_blocks)
    if len(sb) != len(db) or len(sb) == 0:
        raise InvalidArgument(f"src_blocks and dst_blocks must be equally long and non-empty "
                              f"({len(sb)} vs {len(db)})")
    if len(np.unique(db)) != len(db):
        raise InvalidArgument("dst_blocks names a block twice")
    req_layers = list(range(s_lay.num_layers) if layers is None else layers)
    if not req_layers or any(not _is_int(n) or not 0 <= n < s_lay.num_layers
                             for n in req_layers):
        raise InvalidArgument(f"layers must be integers within 0..{s_lay.num_layers - 1}, "
                              f"got {req_layers}")
    lays = sorted({int(n) for n in req_layers})
    for what, lay, size in (("source", s_lay, src_size), ("destination", d_lay, dst_size)):
        if lay.nbytes > size:
            raise InvalidArgument(f"the {what} pool's layout spans {lay.nbytes} bytes but "
                                  f"its memory holds {size}")
    so, do, ln, counts = expand_pages(s_lay, d_lay, sb, db, lays, coalesce=coalesce)
    return lays, so, do, ln, counts


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
    encode_imm(request_id, 0)  # validates request_id
    lays, so, do, ln, counts = plan_push(
        src_pool.layout, dst_pool.layout, src_blocks, dst_blocks, layers,
        src_size=src_pool.array.nbytes, dst_size=dst_pool.region.length, coalesce=coalesce)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    t0 = time.perf_counter()
    transfers: list[Transfer] = []

    first = 0.0
    try:
        for k, layer in enumerate(lays):
            a, b = int(bounds[k]), int(bounds[k + 1])
            sl = ScatterList(so[a:b], do[a:b], ln[a:b])
            transfers.append(await engine.submit(src_pool.buffer, dst_pool.region, sl,
                                                 imm=encode_imm(request_id, layer),
                                                 notify=True))
        for k, t in enumerate(transfers):
            await t.wait()
            if k == 0:
                first = time.perf_counter() - t0
    except BaseException:
        # Stop what has not gone out; what was posted must finish before the
        # source is reusable.
        for t in transfers:
            t.cancel()
        with trio.CancelScope(shield=True):
            for t in transfers:
                try:
                    await t.wait()
                except Exception as exc:  # already failing; keep the first error
                    log.debug("kv.layer_failed", error=str(exc))
        raise
    seconds = time.perf_counter() - t0
    nbytes = int(ln.sum())
    log.debug("kv.push_complete", request_id=request_id, layers=len(lays), nbytes=nbytes,
              seconds=seconds)
    return PushResult(request_id, tuple(lays), tuple(t.pieces for t in transfers), nbytes,
                      seconds, first)
