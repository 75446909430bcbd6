"""Serving engines' own KV tensors as blocks p2pxfer can move: where block
``b`` of plane ``p`` (K, V, or MLA's one latent plane) of one layer's
tensor sits, described as a one-layer ``KVLayout``, and the copies between
such a tensor and a daemon-shared staging pool (``KVLayout`` ``layer_major``,
the same block ids), for exactly the blocks being moved.

Accepted tensors: torch tensors of any dtype on the CPU or a CUDA device,
and numpy arrays, arranged as vLLM allocates them per layer:

- ``planes_first``: ``(2, num_blocks, ...)`` (K plane, then V plane);
- ``blocks_first``: ``(num_blocks, 2, ...)`` (K and V of a block together);
- ``single``: ``(num_blocks, ...)`` (MLA: one latent plane).

Within a block the rest (``block_size x heads x head_size`` in NHD, or
``heads x block_size x head_size`` in HND) must be one contiguous run of
bytes: whole blocks move, so NHD and HND are the same to a copy of whole
blocks (they differ only for head slices, which this module does not cut).

A CUDA tensor's blocks are copied between the device and the staging pool
(host memory, pinned by its owner) as asynchronous copies on a stream the
caller names (:class:`DeviceCopies`): issued here, waited for by the
caller, never by this module.

What must not live here: posting or waiting (the client), vLLM's objects
(``p2pxfer.integrations.vllm``), or a Python loop over blocks: offsets come
from ``kv_plan.expand_pages`` (numpy) and the copy is one C call
(``p2pxfer.pages.copy_scatter``, GIL released; for a device, the CUDA
driver's batched copy, ``p2pxfer.cuda``). Stateless apart from the views
each ``LayerTensor`` holds: safe from any thread, as long as no two threads
copy into the same blocks.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from p2pxfer.cuda import address_of_array, driver
from p2pxfer.errors import InvalidArgument
from p2pxfer.kv_plan import KVLayout, expand_pages
from p2pxfer.pages import CopyStop, copy_scatter

if TYPE_CHECKING:
    from p2pxfer.client import SharedMemory

__all__ = ["ARRANGEMENTS", "DeviceCopies", "HeadSlices", "LayerTensor", "checksum_blocks",
           "copy_blocks", "head_layout_of", "kernel_regrouped", "layer_tensor", "move_into",
           "placed_layout", "shared_layout", "staging_layout"]

ARRANGEMENTS = ("planes_first", "blocks_first", "single")

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class LayerTensor:
    """One layer's KV tensor: the ``span`` bytes from ``address`` it
    covers, and where its blocks sit there (``layout``: one layer; offsets
    from ``address``). In host memory, ``memory`` is those bytes (uint8,
    writable); on a CUDA device (``device``: its ordinal) it is None."""

    memory: U8 | None
    layout: KVLayout
    arrangement: str
    dtype: str
    owner: Any  # the tensor itself: keeps its memory alive
    address: int = 0
    span: int = 0
    device: int | None = None


@dataclass(frozen=True)
class DeviceCopies:
    """Where a device tensor's copies go: a CUDA ``stream`` (a ``CUstream``
    handle; 0 is the legacy default stream) of ``device``."""

    stream: int
    device: int


def _shape_strides(t: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, str, int,
                                    int | None]:
    """(shape, strides in elements, element size, dtype name, address,
    CUDA device ordinal or None for host memory)."""
    if type(t).__module__.startswith("torch"):
        device = None
        if t.device.type == "cuda":
            device = t.device.index if t.device.index is not None else 0
        elif t.device.type != "cpu":
            raise InvalidArgument(f"a {t.device.type} KV tensor: p2pxfer moves KV tensors in "
                                  "host memory or on a CUDA device")
        return (tuple(t.shape), tuple(t.stride()), int(t.element_size()),
                str(t.dtype).removeprefix("torch."), int(t.data_ptr()), device)
    if isinstance(t, np.ndarray):
        if not t.flags.writeable:
            raise InvalidArgument("the KV array is read-only")
        es = t.dtype.itemsize
        if any(s % es for s in t.strides) or any(s < 0 for s in t.strides):
            raise InvalidArgument("the KV array's strides are not whole, positive elements")
        return (t.shape, tuple(s // es for s in t.strides), es, str(t.dtype),
                int(t.ctypes.data), None)
    raise InvalidArgument(f"a KV tensor must be a torch tensor (CPU or CUDA) or a numpy "
                          f"array, got {type(t).__name__}")


def layer_tensor(t: Any, arrangement: str | None = None) -> LayerTensor:
    """Describe one layer's KV tensor (``arrangement``: one of
    :data:`ARRANGEMENTS`; by default guessed from the shape: a leading 2
    is K/V planes, a 2 second is K/V inside each block, else one plane)."""
    shape, strides, es, dtype, addr, device = _shape_strides(t)
    if len(shape) < 2:
        raise InvalidArgument(f"a KV tensor has at least 2 dimensions, got shape {shape}")
    if arrangement is None:
        arrangement = ("planes_first" if shape[0] == 2 and len(shape) >= 3 else
                       "blocks_first" if len(shape) >= 3 and shape[1] == 2 else "single")
    if arrangement not in ARRANGEMENTS:
        raise InvalidArgument(f"arrangement must be one of {ARRANGEMENTS}, got {arrangement!r}")
    if arrangement == "single":
        planes, block_dim, plane_dim = 1, 0, None
    elif arrangement == "planes_first":
        planes, block_dim, plane_dim = 2, 1, 0
    else:
        planes, block_dim, plane_dim = 2, 0, 1
    if plane_dim is not None and shape[plane_dim] != 2:
        raise InvalidArgument(f"{arrangement}: dimension {plane_dim} must hold K and V (2), "
                              f"shape is {shape}")
    inner = [d for d in range(len(shape)) if d not in (block_dim, plane_dim)]
    # A block must be one run of bytes: its dimensions, innermost first, each
    # step over exactly what the ones inside it hold.
    run = 1
    for d in sorted(inner, key=lambda d: strides[d]):
        if shape[d] > 1 and strides[d] != run:
            raise InvalidArgument(
                f"the KV tensor's blocks are not contiguous (shape {shape}, strides "
                f"{strides}): a permuted view (e.g. HND over an NHD allocation) cannot be "
                "moved as whole blocks")
        run *= shape[d]
    block_bytes = run * es
    num_blocks = shape[block_dim]
    span = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * es
    memory = None if device is not None else \
        np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(addr))
    layout = KVLayout(1, num_blocks, block_bytes, planes, "layer_major",
                      block_stride=strides[block_dim] * es,
                      plane_stride=0 if plane_dim is None else strides[plane_dim] * es)
    if layout.nbytes > span:
        raise InvalidArgument(f"the KV tensor spans {span} bytes, its blocks need "
                              f"{layout.nbytes}")
    return LayerTensor(memory, layout, arrangement, dtype, t, addr, span, device)


@dataclass(frozen=True)
class HeadSlices:
    """A block cut into ``k`` slices of its KV heads (heterogeneous tensor
    parallelism: a rank with ``k`` times the heads of its peer's ranks).
    A slice of a block plane is ``runs`` pieces of ``run_bytes``,
    ``run_stride`` apart: one piece in HND (heads outermost in the block),
    one per token in NHD (heads inside each token's row)."""

    k: int
    runs: int
    run_bytes: int
    run_stride: int

    @classmethod
    def of(cls, block_bytes: int, k: int, head_layout: str, block_size: int,
           kernel_blocks: int = 1) -> HeadSlices:
        """``kernel_blocks``: the block is that many kernel blocks one after
        another, each laid out alike (in HND a slice is then one piece per
        kernel block)."""
        if k == 1:
            return cls(1, 1, block_bytes, 0)
        if head_layout == "HND":
            kernel = block_bytes // kernel_blocks
            if block_bytes % kernel_blocks or kernel % k:
                raise InvalidArgument(f"a {kernel}-byte kernel block does not split in {k}")
            return cls(k, kernel_blocks, kernel // k, kernel)
        if head_layout == "NHD":
            row = block_bytes // block_size
            if block_bytes % block_size or row % k:
                raise InvalidArgument(f"a token's {row} bytes of heads do not split in {k}")
            return cls(k, block_size, row // k, row)
        raise InvalidArgument(f"head layout must be NHD or HND, got {head_layout!r}")


def staging_layout(first: LayerTensor, num_layers: int, k: int = 1) -> KVLayout:
    """A staging pool for ``num_layers`` layers like ``first``: every block
    of every layer, ``[layer][plane][block]``, the engine's block ids (with
    ``k`` head slices, block ``b`` is staging blocks ``b*k .. b*k+k-1``)."""
    lay = first.layout
    return KVLayout(num_layers, lay.num_blocks * k, lay.block_bytes // k, lay.planes,
                    "layer_major")


def shared_layout(layers: list[LayerTensor]) -> KVLayout:
    """A pool that holds every layer's whole tensor, one after another (each
    at a page-aligned offset), its blocks where the tensor has them: the
    engine's tensors can then live in it (:func:`move_into`)."""
    lay = layers[0].layout
    for lt in layers:
        if (lt.layout.block_stride, lt.layout.plane_stride) != (lay.block_stride,
                                                                lay.plane_stride):
            raise InvalidArgument("the KV tensors' strides differ from layer to layer: they "
                                  "cannot share one pool layout")
    if any(lt.device is not None for lt in layers):
        raise InvalidArgument("KV tensors on a CUDA device cannot live in memory the daemon "
                              "shares: use staging")
    span = max(lt.span for lt in layers)
    return KVLayout(len(layers), lay.num_blocks, lay.block_bytes, lay.planes, "layer_major",
                    layer_stride=-(-span // 4096) * 4096, block_stride=lay.block_stride,
                    plane_stride=lay.plane_stride)


def kernel_regrouped(lt: LayerTensor, num_blocks: int) -> LayerTensor:
    """``lt`` with its rows read as ``num_blocks`` blocks: an engine whose
    kernels take smaller blocks than its scheduler hands out views of
    ``ratio`` kernel blocks per block (vLLM: ``num_blocks * ratio`` rows,
    dense). A block is then ``ratio`` adjacent rows, one run of bytes."""
    lay = lt.layout
    if lay.num_blocks == num_blocks:
        return lt
    ratio = lay.num_blocks // num_blocks
    if ratio < 2 or lay.num_blocks != ratio * num_blocks or lay.planes != 1 \
            or lay.block_stride != lay.block_bytes:
        raise InvalidArgument(f"the KV tensor has {lay.num_blocks} blocks where the engine "
                              f"schedules {num_blocks}, and they are not {num_blocks} runs of "
                              "whole kernel blocks")
    return replace(lt, layout=KVLayout(1, num_blocks, lay.block_bytes * ratio, 1, "layer_major",
                                       block_stride=lay.block_stride * ratio))


def head_layout_of(lt: LayerTensor) -> str | None:
    """Where the heads sit in ``lt``'s blocks, when its strides say: a
    one-plane 4-D tensor is read as vLLM's per-layer view ``[blocks, heads,
    tokens, K|V]``, HND when its heads step over more bytes than its
    tokens, else NHD. None for any other shape (the caller says)."""
    shape, strides = _shape_strides(lt.owner)[:2]
    if lt.arrangement != "single" or len(shape) != 4 or shape[1] < 2 or shape[2] < 2:
        return None
    return "HND" if strides[1] > strides[2] else "NHD"


def placed_layout(layers: list[LayerTensor], mems: list[SharedMemory]
                  ) -> tuple[KVLayout, SharedMemory] | str:
    """A pool layout over the shared memory in ``mems`` that already holds
    every layer's tensor (the engine allocated them there), and that
    memory; or why there is none: the tensors are elsewhere, or not at
    one layer stride from the memory's first byte, or strided unlike each
    other."""
    for mem in mems:
        base = int(mem.array.ctypes.data)
        if all(base <= lt.address and lt.address + lt.span <= base + mem.nbytes
               for lt in layers):
            break
    else:
        return "the KV tensors are not all in one allocation the allocation context placed"
    offsets = [lt.address - base for lt in layers]
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    if offsets != [i * stride for i in range(len(offsets))] or (len(offsets) > 1 and stride <= 0):
        return (f"the KV layers do not start one stride apart from the placed memory's first "
                f"byte (offsets {offsets[:4]}...)")
    first = layers[0].layout
    if any((lt.layout.block_stride, lt.layout.plane_stride) !=
           (first.block_stride, first.plane_stride) for lt in layers):
        return "the KV tensors' strides differ from layer to layer"
    try:
        layout = KVLayout(len(layers), first.num_blocks, first.block_bytes, first.planes,
                          "layer_major", layer_stride=stride, block_stride=first.block_stride,
                          plane_stride=first.plane_stride)
    except InvalidArgument as exc:
        return f"the placed KV tensors are no pool layout: {exc}"
    if layout.nbytes > mem.nbytes:
        return f"the pool layout needs {layout.nbytes} bytes, the placed memory has {mem.nbytes}"
    return layout, mem


def move_into(lt: LayerTensor, memory: U8, offset: int) -> LayerTensor:
    """Zero copy from here on: the torch tensor of ``lt`` is rebound
    (``Tensor.set_``) onto ``memory[offset:]`` (memory the daemon maps),
    with its shape, strides, dtype and contents. The same tensor object,
    which the engine's attention layers hold, then reads and writes there;
    its old storage is no longer used by it."""
    t = lt.owner
    if not type(t).__module__.startswith("torch"):
        raise InvalidArgument("only a torch tensor can be moved into shared memory (a numpy "
                              "array cannot be rebound): use staging")
    torch = importlib.import_module("torch")  # only here: torch is optional
    es = int(t.element_size())
    if offset % es or memory.nbytes % es or offset + lt.span > memory.nbytes:
        raise InvalidArgument(f"a {lt.span}-byte tensor of {es}-byte elements does "
                              f"not fit at offset {offset} of {memory.nbytes} bytes")
    moved = torch.from_numpy(memory).view(t.dtype).as_strided(t.shape, t.stride(), offset // es)
    moved.copy_(t)
    t.set_(moved)
    return layer_tensor(t, lt.arrangement)


def _pieces(tensor: LayerTensor, staging: KVLayout, layer: int,
            blocks: I64) -> tuple[I64, I64, I64]:
    """(tensor offsets, staging offsets, lengths) of ``blocks`` of ``layer``,
    adjacent blocks merged."""
    t_off, s_off, length, _ = expand_pages(tensor.layout, staging, blocks, blocks, [0])
    return t_off, s_off + layer * staging.layer_stride, length


def _sliced(tensor: LayerTensor, staging: KVLayout, layer: int, blocks: I64,
            hs: HeadSlices) -> tuple[I64, I64, I64]:
    """The pieces of every head slice of ``blocks`` (staging block
    ``b*k + j`` is slice ``j`` of block ``b``), by broadcasting."""
    tl = tensor.layout
    planes = np.arange(tl.planes, dtype=np.int64)[:, None, None, None]
    j = np.arange(hs.k, dtype=np.int64)[None, None, :, None]
    t = np.arange(hs.runs, dtype=np.int64)[None, None, None, :]
    b = blocks[None, :, None, None]
    t_off = planes * tl.plane_stride + b * tl.block_stride + j * hs.run_bytes + t * hs.run_stride
    s_off = (layer * staging.layer_stride + planes * staging.plane_stride
             + (b * hs.k + j) * staging.block_stride + t * hs.run_bytes)
    t_off, s_off = (np.broadcast_to(x, np.broadcast_shapes(t_off.shape, s_off.shape))
                    .reshape(-1).copy() for x in (t_off, s_off))
    return t_off, s_off, np.full(len(t_off), hs.run_bytes, np.int64)


def copy_blocks(tensor: LayerTensor, staging: U8, layout: KVLayout, layer: int, blocks: Any,
                *, to_staging: bool, slices: HeadSlices | None = None,
                on: DeviceCopies | None = None) -> int:
    """Copy ``blocks`` of one layer between the engine's tensor and the
    staging pool (``to_staging``: tensor -> staging), whole or as head
    ``slices``; the bytes copied. For a tensor on a device the copies are
    only issued, on ``on``'s stream: the caller waits for that stream
    before it reads (or lets the engine read) what they wrote."""
    ids = np.asarray(blocks, dtype=np.int64)
    if len(ids) == 0:
        return 0
    if ids.min() < 0 or ids.max() >= tensor.layout.num_blocks:
        raise InvalidArgument(f"block ids must be within 0..{tensor.layout.num_blocks - 1}")
    if slices is not None and slices.k > 1:
        t_off, s_off, length = _sliced(tensor, layout, layer, ids, slices)
    else:
        t_off, s_off, length = _pieces(tensor, layout, layer, ids)
    if tensor.memory is None:
        if on is None or on.device != tensor.device:
            raise InvalidArgument(f"a KV tensor on CUDA device {tensor.device} is copied on a "
                                  f"stream of that device, got {on}")
        cuda = driver()  # loaded on first use: only a device tensor gets here
        host = address_of_array(staging)
        if to_staging:
            cuda.copy(on.stream, on.device, host, tensor.address, t_off, s_off, length)
        else:
            cuda.copy(on.stream, on.device, tensor.address, host, s_off, t_off, length)
    elif to_staging:
        copy_scatter(staging, tensor.memory, t_off, s_off, length, 0, len(length), CopyStop())
    else:
        copy_scatter(tensor.memory, staging, s_off, t_off, length, 0, len(length), CopyStop())
    return int(length.sum())


def checksum_blocks(pool: U8, layout: KVLayout, layer: int, blocks: Any) -> int:
    """CRC-32 of ``blocks`` of ``layer`` in a pool, planes outer and blocks
    inner in the order given: the sender over its source blocks and the
    receiver over the destination blocks they were written to agree byte
    for byte. One gather (C copy) and one ``zlib.crc32`` (GIL released)."""
    ids = np.asarray(blocks, dtype=np.int64)
    one = KVLayout(1, len(ids) or 1, layout.block_bytes, layout.planes, "layer_major")
    so, do, length, _ = expand_pages(layout, one, ids, np.arange(len(ids), dtype=np.int64),
                                     [layer])
    gathered = np.empty(math.prod((layout.planes, len(ids), layout.block_bytes)), np.uint8)
    # expand_pages put the layer's offset on both sides; the gather has one layer.
    copy_scatter(gathered, pool, so, do - layer * one.layer_stride, length, 0, len(length),
                 CopyStop())
    return zlib.crc32(gathered.data) & 0xFFFFFFFF
