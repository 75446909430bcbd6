"""The C loops over page lists that need no fabric (``p2pxfer._pages``).

- :func:`check_scatter`: one-pass validation of a scatter list. numpy would
  need half a dozen reductions per list, each with a fixed cost of
  microseconds; a single C pass is cheaper for 1 piece and for 100,000.
- :func:`copy_scatter`: the daemon's same-node fast path, a write into a
  region of its own clients. One C call copies a whole range of pieces
  (``memmove`` each, every piece checked against both sizes again first) and
  releases the GIL while it runs, so several threads can share one list; a
  :class:`CopyStop` stops it between pieces, never inside one.
- :func:`device_copy` / :func:`device_copy_batch`: a page list issued as
  CUDA copies (the driver's entry points are handed in: this library links
  no CUDA), one call per run of adjacent pieces, or one batch.

Its extension links no libfabric, so the client library validates what it
sends without loading the fabric. What must not live here: anything that
touches libfabric (``p2pxfer.fabric``), or which pieces go to which thread
(``p2pxfer.daemon``). Stateless: safe from any thread.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from p2pxfer._pages import ffi, lib
from p2pxfer.errors import ScatterError

__all__ = ["INT64_MAX", "CopyStop", "ScatterCheck", "address_of", "check_scatter",
           "copy_scatter", "device_copy", "device_copy_batch"]


INT64_MAX = (1 << 63) - 1
REASONS = {
    1: "negative source offset",
    2: "negative destination offset",
    3: "length must be > 0",
    4: "ends past the source region",
    5: "ends past the destination region",
    6: "total length of the list overflows 64 bits",
}


def address_of(view: memoryview) -> int:
    """Address of a contiguous buffer's first byte (cheaper than numpy's)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(view)))


class ScatterCheck(NamedTuple):
    bad: int  # -1 when every piece fits
    reason: str
    total: int
    max_len: int
    src_end: int  # furthest byte read + 1
    dst_end: int  # furthest byte written + 1


def check_scatter(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                  length: npt.NDArray[np.int64], src_size: int = INT64_MAX,
                  dst_size: int = INT64_MAX) -> ScatterCheck:
    out = ffi.new("int64_t[4]")
    what = ffi.new("int32_t *")
    bad = lib.p2p_check_scatter(
        ffi.from_buffer("int64_t[]", src), ffi.from_buffer("int64_t[]", dst),
        ffi.from_buffer("int64_t[]", length), len(length), src_size, dst_size, what, out,
    )
    return ScatterCheck(int(bad), REASONS.get(int(what[0]), ""), *(int(v) for v in out))



class CopyStop:
    """A flag the copy reads between pieces; :meth:`set` (from any thread)
    makes every copy that shares it stop before its next piece."""

    def __init__(self) -> None:
        self._flag = ffi.new("int32_t *")

    def set(self) -> None:
        self._flag[0] = 1

    def is_set(self) -> bool:
        return bool(self._flag[0])


def copy_scatter(dst: Any, src: Any, src_off: npt.NDArray[np.int64],
                 dst_off: npt.NDArray[np.int64], length: npt.NDArray[np.int64],
                 start: int, end: int, stop: CopyStop) -> int:
    """Copy pieces ``[start, end)`` from ``src`` into ``dst`` (writable
    buffers of this process; the arrays int64, contiguous, as long as each
    other); the pieces copied, fewer than asked once ``stop`` is set.
    Blocks (without the GIL) for as long as the bytes take. A piece outside
    either buffer raises ``ScatterError`` naming it, after the pieces before
    it were copied."""
    if not (len(src_off) == len(dst_off) == len(length)) or not 0 <= start <= end <= len(length):
        raise ScatterError(f"copy of pieces [{start}, {end}) of a {len(length)}-piece list")
    d = ffi.from_buffer("char[]", dst, require_writable=True)
    s = ffi.from_buffer("char[]", src)
    bad = ffi.new("int64_t *")
    done = lib.p2p_copy_scatter(
        d, len(d), s, len(s), ffi.from_buffer("int64_t[]", src_off),
        ffi.from_buffer("int64_t[]", dst_off), ffi.from_buffer("int64_t[]", length),
        start, end, stop._flag, bad)
    if bad[0] >= 0:
        i = int(bad[0])
        raise ScatterError(f"piece {i} (source offset {int(src_off[i])}, destination offset "
                           f"{int(dst_off[i])}, length {int(length[i])}) does not fit a "
                           f"{len(s)}-byte source and a {len(d)}-byte destination")
    return int(done)


def _i64(a: npt.NDArray[np.int64]) -> Any:
    return ffi.cast("const int64_t *", a.ctypes.data)


def device_copy(memcpy_async: int, stream: int, dst: int, src: int,
                src_off: npt.NDArray[np.int64], dst_off: npt.NDArray[np.int64],
                length: npt.NDArray[np.int64]) -> tuple[int, int]:
    """Issue pieces (contiguous int64 arrays) as CUDA copies on ``stream``,
    one call of ``memcpy_async`` (the driver's ``cuMemcpyAsync``) per run of
    pieces adjacent on both sides: (copies issued, -1), or (-CUresult, the
    piece whose copy failed)."""
    failed = ffi.new("int64_t *")
    rc = lib.p2p_device_copy(ffi.cast("void *", memcpy_async), ffi.cast("void *", stream),
                             dst, src, _i64(src_off), _i64(dst_off), _i64(length), len(length),
                             failed)
    return int(rc), int(failed[0])


def device_copy_batch(memcpy_batch: int, stream: int, dst: int, src: int,
                      src_off: npt.NDArray[np.int64], dst_off: npt.NDArray[np.int64],
                      length: npt.NDArray[np.int64]) -> int:
    """The same as one ``cuMemcpyBatchAsync`` (CUDA 13's, at ``memcpy_batch``):
    the runs issued, or -CUresult."""
    scratch = np.empty(3 * len(length), np.uint64)
    return int(lib.p2p_device_copy_batch(
        ffi.cast("void *", memcpy_batch), ffi.cast("void *", stream), dst, src, _i64(src_off),
        _i64(dst_off), _i64(length), len(length), ffi.cast("uint64_t *", scratch.ctypes.data)))
