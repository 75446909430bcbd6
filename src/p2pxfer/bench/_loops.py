"""The C-to-C reference loops (``native/src/baseline.c``, built as
``p2pxfer.bench._cref``), one call per end.

``reference_target`` busy-polls a rail's CQ until a number of remote-CQ-data
arrivals landed, ``reference_write`` posts a whole scatter list and counts its
completions, ``reference_pingpong`` bounces one write each way. Each runs
entirely in C with the GIL released; the benchmark runs the two ends in two
processes, as fabtests' ``fi_rma_bw`` does. Not a user API, and nothing the
engine uses: the production binding does not carry them. The rails' fabric
objects are handed to them as plain addresses (the two extensions do not
share cffi types). Stateless.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.fabric import Rail, check, raw_address

from ._cref import ffi, lib

__all__ = ["reference_pingpong", "reference_target", "reference_write", "writes_of"]


def _ns(seconds: float) -> int:
    return max(1, int(seconds * 1e9))


def _ep(rail: Rail) -> Any:
    return ffi.cast("struct fid_ep *", raw_address(rail.endpoint.handle))


def _cq(rail: Rail) -> Any:
    return ffi.cast("struct fid_cq *", raw_address(rail.cq.handle))


def _desc(desc: Any) -> Any:
    return ffi.cast("void *", raw_address(desc))


def reference_target(rail: Rail, expected: int, timeout: float) -> int:
    """Busy-poll ``rail``'s CQ until ``expected`` writes with immediate data
    have landed or ``timeout`` seconds passed; returns how many landed."""
    return check(lib.p2p_ref_target(_cq(rail), expected, _ns(timeout)), "p2p_ref_target")


def reference_write(rail: Rail, dest: int, src_off: npt.NDArray[np.int64],
                    dst_off: npt.NDArray[np.int64], length: npt.NDArray[np.int64],
                    src_base: int, src_desc: Any, dst_base: int, dst_key: int,
                    imm: int | None, timeout: float) -> None:
    """Post every piece, up to the rail's ``group`` per write, each write
    with ``imm`` where given (the target counts writes: ``writes_of``), and
    return once all completed here. Raises ``FabricError`` (``-FI_ETIMEDOUT``
    after ``timeout`` seconds)."""
    n = len(length)
    if not len(src_off) == len(dst_off) == n:
        raise ValueError("src_off, dst_off and length must have the same length")
    rc = lib.p2p_ref_write(
        _ep(rail), _cq(rail), dest,
        ffi.from_buffer("int64_t[]", src_off), ffi.from_buffer("int64_t[]", dst_off),
        ffi.from_buffer("int64_t[]", length), n, src_base, _desc(src_desc), dst_base, dst_key,
        0 if imm is None else imm, imm is not None, rail.group, _ns(timeout))
    check(rc, "p2p_ref_write")


def writes_of(rail: Rail, pieces: int) -> int:
    """How many writes ``reference_write`` makes of ``pieces`` on ``rail``:
    what a target counts."""
    return -(-pieces // rail.group)


def reference_pingpong(rail: Rail, dest: int, src_base: int, src_desc: Any, dst_base: int,
                       dst_key: int, length: int, iters: int, initiator: bool,
                       timeout: float) -> npt.NDArray[np.int64]:
    """``iters`` round trips of one ``length``-byte write with immediate each
    way, busy polling. The initiator gets each round trip's nanoseconds; the
    other side (which answers every arrival) an empty array."""
    rtt = np.zeros(iters if initiator else 0, np.int64)
    out = ffi.from_buffer("int64_t[]", rtt) if initiator else ffi.NULL
    rc = lib.p2p_ref_pingpong(_ep(rail), _cq(rail), dest, src_base, _desc(src_desc),
                              dst_base, dst_key, length, iters, initiator, _ns(timeout), out)
    check(rc, "p2p_ref_pingpong")
    return rtt
