"""The raw C baseline that benchmarks measure the Python paths against.

``baseline_write`` runs the whole post-and-drain loop inside
``p2p_baseline_write``; it exists for ``bench/`` and is not a user API.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._binding import check, ffi, lib
from ._rail import Rail


def baseline_write(
    rail: Rail,
    dest: int,
    src_off: npt.NDArray[np.int64],
    dst_off: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    src_base: int,
    src_desc: Any,
    dst_base: int,
    dst_key: int,
    imm: int | None,
) -> None:
    rc = lib.p2p_baseline_write(
        rail.endpoint.handle, rail.cq.handle, dest,
        ffi.from_buffer("int64_t[]", src_off),
        ffi.from_buffer("int64_t[]", dst_off),
        ffi.from_buffer("int64_t[]", length),
        len(length), src_base, src_desc, dst_base, dst_key,
        0 if imm is None else imm, imm is not None,
    )
    check(rc, "p2p_baseline_write")


def now_ns() -> int:
    return int(lib.p2p_now_ns())


def baseline_pingpong(rail: Rail, dest: int, src_base: int, src_desc: Any, dst_base: int,
                      dst_key: int, length: int, iters: int, initiator: bool) -> float:
    """Round trips of ``length``-byte writes with immediates, all in C, busy
    polling on both sides. Returns seconds per round trip (initiator) or 0."""
    ns = lib.p2p_baseline_pingpong(rail.endpoint.handle, rail.cq.handle, dest, src_base,
                                   src_desc, dst_base, dst_key, length, iters, initiator)
    check(ns, "p2p_baseline_pingpong")
    return int(ns) / 1e9 / iters if initiator else 0.0
