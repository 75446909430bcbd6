"""Scatter copies between two buffers of this process (``p2p_copy_scatter``):
the daemon's same-node fast path, a write into a region of its own clients.

One C call copies a whole range of pieces (``memmove`` each, every piece
checked against both sizes again first) and releases the GIL while it runs,
so several threads can share one list. A :class:`CopyStop` stops it between
pieces, never inside one. What must not live here: which pieces go to which
thread, or anything about sessions and regions (``p2pxfer.daemon``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import ScatterError

from ._binding import ffi, lib

__all__ = ["CopyStop", "copy_scatter"]


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
