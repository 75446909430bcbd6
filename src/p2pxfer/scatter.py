"""Scatter lists: three ``int64`` arrays (source offset, destination offset,
length), validated as a whole in one C pass before anything is posted.

What lives here: construction from arrays, bounds checks against both regions,
splitting over-long pieces and striping pieces across rails by bytes. What must
not: any Python loop over pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import ScatterError
from p2pxfer.pages import INT64_MAX, check_scatter

__all__ = ["ScatterList"]

I64 = npt.NDArray[np.int64]


def _column(name: str, value: object) -> I64:
    if not isinstance(value, np.ndarray):
        raise ScatterError(f"{name} must be a numpy int64 array, got {type(value).__name__}")
    if value.dtype != np.int64:
        raise ScatterError(f"{name} must have dtype int64, got {value.dtype}")
    if value.ndim != 1:
        raise ScatterError(f"{name} must be one-dimensional, got shape {value.shape}")
    # A copy of our own, contiguous (C reads raw memory) and immutable: the
    # bounds found at construction must stay true while posting, whatever the
    # caller does afterwards. Backed by ``bytes``, so not even
    # ``flags.writeable = True`` can make it writable again.
    return np.frombuffer(np.ascontiguousarray(value).tobytes(), np.int64)


@dataclass(frozen=True, eq=False)
class ScatterList:
    """Pieces ``i``: copy ``length[i]`` bytes from ``src[i]`` to ``dst[i]``.

    Construction copies the arrays (read-only copies: later changes to the
    caller's arrays cannot move a piece out of bounds) and checks shapes,
    dtypes, and that offsets are >= 0 and lengths > 0, recording how far the
    pieces reach; :meth:`check_bounds` then checks two region sizes in O(1).
    """

    src: I64
    dst: I64
    length: I64

    def __init__(self, src: I64, dst: I64, length: I64) -> None:
        s, d, n = _column("src offsets", src), _column("dst offsets", dst), _column(
            "lengths", length
        )
        if not (len(s) == len(d) == len(n)):
            raise ScatterError(
                f"scatter arrays differ in length: src={len(s)} dst={len(d)} lengths={len(n)}"
            )
        if len(n) == 0:
            raise ScatterError("scatter list is empty")
        chk = check_scatter(s, d, n)
        if chk.bad >= 0:
            raise ScatterError(self._describe(chk.bad, chk.reason, s, d, n))
        object.__setattr__(self, "src", s)
        object.__setattr__(self, "dst", d)
        object.__setattr__(self, "length", n)
        object.__setattr__(self, "nbytes", chk.total)
        object.__setattr__(self, "max_length", chk.max_len)
        object.__setattr__(self, "src_end", chk.src_end)
        object.__setattr__(self, "dst_end", chk.dst_end)

    nbytes: int
    max_length: int
    #: one past the furthest source / destination byte a piece touches
    src_end: int
    dst_end: int

    @staticmethod
    def _describe(i: int, reason: str, s: I64, d: I64, n: I64) -> str:
        return (f"piece {i} (source offset {int(s[i])}, destination offset {int(d[i])}, "
                f"length {int(n[i])}): {reason}")

    @classmethod
    def contiguous(cls, nbytes: int, src: int = 0, dst: int = 0) -> ScatterList:
        return cls(np.array([src], np.int64), np.array([dst], np.int64),
                   np.array([nbytes], np.int64))

    def __len__(self) -> int:
        return len(self.length)

    def check_bounds(self, src_size: int, dst_size: int) -> None:
        """Raise :class:`ScatterError` naming the first piece that does not fit."""
        if self.src_end <= src_size and self.dst_end <= dst_size:
            return  # known since construction: the arrays are ours and immutable
        chk = check_scatter(self.src, self.dst, self.length, src_size, dst_size)
        if chk.bad >= 0:
            region = "source" if "source" in chk.reason else "destination"
            size = src_size if region == "source" else dst_size
            raise ScatterError(self._describe(chk.bad, chk.reason, self.src, self.dst,
                                              self.length) + f" of {size} bytes")

    def split(self, max_piece: int) -> ScatterList:
        """Cut pieces longer than ``max_piece`` into ``max_piece`` chunks
        (deterministic, so both sides can count the pieces)."""
        if max_piece <= 0:
            raise ScatterError(f"max_piece must be > 0, got {max_piece}")
        if self.max_length <= max_piece:
            return self
        chunks = (self.length + (max_piece - 1)) // max_piece
        idx = np.repeat(np.arange(len(self)), chunks)
        first = np.cumsum(chunks) - chunks
        k = np.arange(len(idx), dtype=np.int64) - np.repeat(first, chunks)
        step = k * max_piece
        length = np.minimum(self.length[idx] - step, max_piece)
        return ScatterList(self.src[idx] + step, self.dst[idx] + step, length)

    @cached_property
    def min_length(self) -> int:
        return int(self.length.min())

    def stripe(self, parts: int, max_piece: int = INT64_MAX
               ) -> tuple[ScatterList, list[tuple[int, int]]]:
        """The one stripe planner (rails of a write, threads of a copy, the
        bench's C loops): cut pieces longer than ``max_piece`` (what the
        provider takes in one message); with several ``parts``, also cut
        pieces too large to balance (aim for >= 4 pieces per part, never
        below 64 KiB); then give each part a contiguous range of about equal
        bytes. Returns the pieces and ``parts`` ranges (some may be empty).
        Deterministic, so a target can compute the count."""
        sl = self.split(max_piece)
        if parts <= 1:
            return sl, [(0, len(sl))]
        sl = sl.split(max(1 << 16, -(-sl.nbytes // (4 * parts))))
        return sl, sl.stripes(parts)

    def stripes(self, weights: int) -> list[tuple[int, int]]:
        """Split pieces ``[0, n)`` into ``weights`` contiguous ranges of about
        equal bytes (one per rail). Ranges may be empty."""
        if weights <= 1 or len(self) == 1:
            return [(0, len(self))] + [(len(self), len(self))] * max(0, weights - 1)
        ends = np.cumsum(self.length)
        total = int(ends[-1])
        cuts = np.searchsorted(ends, [total * (k + 1) // weights for k in range(weights - 1)],
                               side="left")
        bounds = [0, *[min(len(self), int(c) + 1) for c in cuts], len(self)]
        bounds = list(np.maximum.accumulate(np.array(bounds)))
        return [(int(bounds[k]), int(bounds[k + 1])) for k in range(weights)]
