"""The KV core that needs no fabric: where block ``b`` of layer ``l``, plane
``p`` sits in a pool (``KVLayout``), what a peer needs to push into a pool
(``KVPoolDescriptor``), the one immediate encoding of (request, layer), and
the one plan of a push (``plan_push``: block tables -> ``PushPlan``, pieces
per layer, coalesced, vectorized). Used by the in-process API
(``p2pxfer.kv``), the daemon's KV pushes and the client library alike; the
part that posts and counts is ``p2pxfer._kv_core``.

What must not live here: posting, waiting, registration (``p2pxfer.kv``,
``p2pxfer._kv_core``, ``p2pxfer.daemon``), or a Python loop over blocks or
pieces (numpy does the expansion). No mutable state.

Immediates: a layer's notification carries ``base | layer``, the layer in
the low ``LAYER_BITS`` bits and the request in the bits above, named by a
*base* whose low bits are zero (``layer_imm``). The base is whatever routes
to the receiver's bookkeeping of that request: in-process
``tag:4 | request:16`` (``request_base``; the engine routes the tag), through
daemons the request slot the receiver handed out in ``kv_begin`` (its
``ImmTable`` routes the slot). 32 bits either way, so it runs where the
fabric carries 4 bytes of CQ data (EFA, verbs, ``imm_bytes = 4``) as well
as 8.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from p2pxfer.buffers import RegionDescriptor
from p2pxfer.errors import DescriptorError, InvalidArgument

__all__ = [
    "KVLayout",
    "KVPoolDescriptor",
    "PushPlan",
    "decode_imm",
    "encode_imm",
    "expand_pages",
    "layer_imm",
    "plan_push",
    "request_base",
]

I64 = npt.NDArray[np.int64]

KV_TAG = 0xA
REQUEST_BITS, LAYER_BITS = 16, 12
TAG_SHIFT = REQUEST_BITS + LAYER_BITS  # 28: the tag is the top 4 of 32 bits
MAX_REQUEST = (1 << REQUEST_BITS) - 1
MAX_LAYERS = 1 << LAYER_BITS
#: pieces one push may expand to before coalescing (layers x planes x
#: blocks): expanding is vectorized but takes memory and time in the caller's
#: thread (the daemon's event loop), ~100 bytes and a few ns per piece; the
#: largest shapes serving engines send (80 layers x 2 planes x 16k blocks)
#: stay well under it
MAX_PUSH_PIECES = 1 << 22
LAYER_MASK = MAX_LAYERS - 1

ORDERS = ("layer_major", "block_major", "plane_major")


def is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def layer_imm(base: int, layer: int) -> int:
    """The immediate of ``layer`` of the request whose base is ``base``."""
    if base & LAYER_MASK:
        raise InvalidArgument(f"a KV request's base {base:#x} must leave the low "
                              f"{LAYER_BITS} bits to the layer")
    if not is_int(layer) or not 0 <= layer < MAX_LAYERS:
        raise InvalidArgument(f"layer {layer} must be in 0..{MAX_LAYERS - 1}")
    return base | int(layer)


def request_base(request_id: int) -> int:
    """The base of an in-process request (``tag:4 | request:16``, then the layer)."""
    if not is_int(request_id) or not 0 <= request_id <= MAX_REQUEST:
        raise InvalidArgument(f"request_id {request_id} must be in 0..{MAX_REQUEST}")
    return (KV_TAG << TAG_SHIFT) | (int(request_id) << LAYER_BITS)


def encode_imm(request_id: int, layer: int) -> int:
    """The in-process immediate of ``layer`` of ``request_id``."""
    return layer_imm(request_base(request_id), layer)


def decode_imm(imm: int) -> tuple[int, int]:
    """(request_id, layer) of an in-process KV immediate."""
    return (imm >> LAYER_BITS) & MAX_REQUEST, imm & LAYER_MASK


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
            if not is_int(v) or v < 0:
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


class PushPlan(NamedTuple):
    """A checked push, expanded: its layers in order, every piece (source
    offset, destination offset, length) layer after layer, and how many
    pieces each layer has."""

    layers: list[int]
    src: I64
    dst: I64
    length: I64
    counts: I64

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def per_layer(self) -> Iterator[tuple[int, slice]]:
        """(layer, the slice of its pieces), in layer order."""
        bounds = np.concatenate([[0], np.cumsum(self.counts)]).tolist()
        for k, layer in enumerate(self.layers):
            yield layer, slice(bounds[k], bounds[k + 1])


def plan_push(s_lay: KVLayout, d_lay: KVLayout, src_blocks: Any, dst_blocks: Any,
              layers: Iterable[int] | None, *, src_size: int, dst_size: int,
              coalesce: bool = True) -> PushPlan:
    """Check a push (layouts, block indices, layers, pool sizes) and expand
    it. The one planner of the in-process ``push_pages`` and the daemon's KV
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
    if not req_layers or any(not is_int(n) or not 0 <= n < s_lay.num_layers
                             for n in req_layers):
        raise InvalidArgument(f"layers must be integers within 0..{s_lay.num_layers - 1}, "
                              f"got {req_layers}")
    lays = sorted({int(n) for n in req_layers})
    pieces = len(lays) * s_lay.planes * len(sb)
    if pieces > MAX_PUSH_PIECES:
        raise InvalidArgument(f"a push of {len(lays)} layers x {s_lay.planes} planes x "
                              f"{len(sb)} blocks is {pieces} pieces, more than "
                              f"{MAX_PUSH_PIECES}: split it into several pushes")
    for what, lay, size in (("source", s_lay, src_size), ("destination", d_lay, dst_size)):
        if lay.nbytes > size:
            raise InvalidArgument(f"the {what} pool's layout spans {lay.nbytes} bytes but "
                                  f"its memory holds {size}")
    return PushPlan(lays, *expand_pages(s_lay, d_lay, sb, db, lays, coalesce=coalesce))
