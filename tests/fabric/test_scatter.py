"""ScatterList: splitting and striping properties (hypothesis), bounds checks,
and an engine striping across two real rails on loopback."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import numpy.typing as npt
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LOOPBACK
from p2pxfer.engine import EngineConfig, open_engine_on, plan_stripes
from p2pxfer.engine._plan import Stripe
from p2pxfer.errors import ScatterError
from p2pxfer.fabric import getinfo
from p2pxfer.pages import INT64_MAX
from p2pxfer.scatter import ScatterList
from p2pxfer.topology import Nic, Topology
from p2pxfer.topology import Shard as TopologyShard

# No deadline: these VMs are noisy, and a slow example is not a wrong one.
quick = settings(deadline=None, max_examples=150)

I64 = npt.NDArray[np.int64]

piece = st.tuples(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 300))
piece_lists = st.lists(piece, min_size=1, max_size=40).map(
    lambda ps: ScatterList(*(np.array(col, np.int64) for col in zip(*ps, strict=True)))
)


def expand(start: I64, length: I64) -> I64:
    """Every byte offset the pieces touch, piece after piece, in order."""
    if len(length) == 0:
        return np.zeros(0, np.int64)
    first = np.repeat(start - (np.cumsum(length) - length), length)
    return first + np.arange(int(length.sum()), dtype=np.int64)


# -- split ------------------------------------------------------------------------------

@quick
@given(piece_lists, st.integers(1, 400))
def test_split_preserves_bytes_and_coverage(sl: ScatterList, max_piece: int) -> None:
    out = sl.split(max_piece)
    assert out.nbytes == sl.nbytes
    assert int(out.length.min()) > 0 and int(out.length.max()) <= max_piece
    assert len(out) == int(((sl.length + max_piece - 1) // max_piece).sum())
    # Byte for byte, in order: each source byte still goes to the same place.
    assert np.array_equal(expand(out.src, out.length), expand(sl.src, sl.length))
    assert np.array_equal(expand(out.dst, out.length), expand(sl.dst, sl.length))
    for col in (out.src, out.dst, out.length):
        assert col.dtype == np.int64 and col.flags.c_contiguous


@quick
@given(piece_lists, st.integers(1, 400))
def test_split_is_deterministic_and_idempotent(sl: ScatterList, max_piece: int) -> None:
    a, b = sl.split(max_piece), sl.split(max_piece)
    for col in ("src", "dst", "length"):
        assert np.array_equal(getattr(a, col), getattr(b, col))
    assert a.split(max_piece) is a


def test_split_cuts_at_exact_multiples() -> None:
    sl = ScatterList(np.array([10, 0], np.int64), np.array([1000, 0], np.int64),
                     np.array([250, 100], np.int64))
    out = sl.split(100)
    assert out.src.tolist() == [10, 110, 210, 0]
    assert out.dst.tolist() == [1000, 1100, 1200, 0]
    assert out.length.tolist() == [100, 100, 50, 100]
    assert sl.split(250) is sl


@pytest.mark.parametrize("bad", [0, -1])
def test_split_rejects_non_positive_sizes(bad: int) -> None:
    with pytest.raises(ScatterError, match=f"max_piece must be > 0, got {bad}"):
        ScatterList.contiguous(10).split(bad)


# -- stripes ----------------------------------------------------------------------------

@quick
@given(piece_lists, st.integers(1, 8))
def test_stripes_are_contiguous_and_cover_all_pieces(sl: ScatterList, weights: int) -> None:
    ranges = sl.stripes(weights)
    assert len(ranges) == weights
    assert ranges[0][0] == 0 and ranges[-1][1] == len(sl)
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start
    assert all(s <= e for s, e in ranges)


@quick
@given(piece_lists, st.integers(2, 8))
def test_stripes_are_balanced_in_bytes(sl: ScatterList, weights: int) -> None:
    ends = np.concatenate([[0], np.cumsum(sl.length)])
    got = [int(ends[e] - ends[s]) for s, e in sl.stripes(weights)]
    assert sum(got) == sl.nbytes
    # Cutting only between pieces, a stripe can miss its share by at most one piece.
    share, longest = sl.nbytes / weights, int(sl.length.max())
    assert all(abs(g - share) <= longest + 1 for g in got), (got, share, longest)


def test_stripes_of_equal_pieces_are_equal() -> None:
    sl = ScatterList(np.arange(12, dtype=np.int64) * 10, np.arange(12, dtype=np.int64) * 10,
                     np.full(12, 10, np.int64))
    assert sl.stripes(4) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert sl.stripes(1) == [(0, 12)]
    assert sl.stripes(0) == [(0, 12)]


def test_stripes_may_be_empty_when_one_piece_dominates() -> None:
    sl = ScatterList(np.zeros(3, np.int64), np.array([0, 1000, 1001], np.int64),
                     np.array([1000, 1, 1], np.int64))
    ranges = sl.stripes(4)
    assert ranges[0] == (0, 1) and ranges[-1][1] == 3
    assert any(s == e for s, e in ranges)


# -- plan_stripes: what write() posts and the target must count --------------------------

@quick
@given(piece_lists, st.integers(1, 4), st.integers(1, 1 << 20))
def test_plan_stripes_covers_everything_once(sl: ScatterList, nrails: int, max_msg: int) -> None:
    out, stripes = plan_stripes(sl, nrails, max_msg)
    assert out.nbytes == sl.nbytes
    assert int(out.length.max()) <= max_msg
    assert np.array_equal(expand(out.dst, out.length), expand(sl.dst, sl.length))
    assert all(isinstance(s, Stripe) and s.end > s.start for s in stripes)
    assert [s.rail for s in stripes] == sorted({s.rail for s in stripes})
    assert all(0 <= s.rail < nrails for s in stripes)
    covered = [i for s in stripes for i in range(s.start, s.end)]
    assert covered == list(range(len(out)))
    again, stripes2 = plan_stripes(sl, nrails, max_msg)
    assert stripes2 == stripes and np.array_equal(again.length, out.length)


def test_plan_stripes_splits_big_pieces_to_balance_rails() -> None:
    sl = ScatterList.contiguous(8 << 20)
    out, stripes = plan_stripes(sl, 2, 1 << 62)
    assert len(out) == 8  # 8 MiB / (4 pieces per rail * 2 rails) = 1 MiB each
    assert [(s.rail, s.start, s.end) for s in stripes] == [(0, 0, 4), (1, 4, 8)]
    one, single = plan_stripes(sl, 1, 1 << 62)
    assert one is sl and single == [Stripe(0, 0, 1)]
    small, _ = plan_stripes(sl, 1, 3 << 20)
    assert small.length.tolist() == [3 << 20, 3 << 20, 2 << 20]


# -- construction and bounds ---------------------------------------------------------------

def test_construction_copies_strided_input_to_contiguous() -> None:
    base = np.arange(20, dtype=np.int64)
    sl = ScatterList(base[::2], base[::2], base[1::2])
    assert all(c.flags.c_contiguous for c in (sl.src, sl.dst, sl.length))
    assert sl.src.tolist() == list(range(0, 20, 2))
    assert len(sl) == 10 and sl.nbytes == sum(range(1, 20, 2))


def test_scatter_list_is_frozen() -> None:
    sl = ScatterList.contiguous(10, src=1, dst=2)
    assert (sl.src.tolist(), sl.dst.tolist(), sl.length.tolist()) == ([1], [2], [10])
    with pytest.raises(dataclasses.FrozenInstanceError):
        sl.length = np.ones(1, np.int64)  # type: ignore[misc]


def test_check_bounds_accepts_exact_fits() -> None:
    sl = ScatterList(np.array([0, 90], np.int64), np.array([190, 0], np.int64),
                     np.array([10, 10], np.int64))
    sl.check_bounds(100, 200)
    with pytest.raises(ScatterError) as exc:
        sl.check_bounds(99, 200)
    for words in ("piece 1", "source offset 90", "length 10", "source region", "99 bytes"):
        assert words in str(exc.value)
    with pytest.raises(ScatterError) as exc:
        sl.check_bounds(100, 199)
    for words in ("piece 0", "destination offset 190", "destination region", "199 bytes"):
        assert words in str(exc.value)


# -- striping over two real rails (two endpoints on the same loopback interface) -----------

@pytest.mark.parametrize(("name", "node", "domain"),
                         [("tcp;ofi_rxm", LOOPBACK, "lo"), ("shm", None, "shm")],
                         ids=["tcp;ofi_rxm", "shm"])
async def test_write_stripes_across_two_rails(name: str, node: str | None,
                                              domain: str) -> None:
    # Discovery never offers one interface twice: build the shard's topology here.
    info = getinfo(name, node=node, domain=domain)[0]
    nic = Nic(info.provider, info.domain_name, info.fabric_name, 0, info)
    topo = Topology((nic, nic), (TopologyShard(0, (nic, nic), ()),))
    async with open_engine_on(topo, EngineConfig(provider=name, node=node)) as t:
        assert len(t.statistics().nics) == 2
        size = 8 << 20
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, np.uint8)
        desc = t.export(dst, "striped")
        assert len(desc.rails) == 2
        t.register(src)
        sl = ScatterList(np.array([0, 3 << 20, 5 << 20], np.int64),
                         np.array([4 << 20, 0, (1 << 20) + 7], np.int64),
                         np.array([3 << 20, 1 << 20, 12345], np.int64))
        expected_pieces = len(plan_stripes(sl, 2, min(INT64_MAX, info.max_msg_size))[0])
        with trio.fail_after(20):
            n = await t.write(src, desc, sl, imm=11)
            assert n == expected_pieces > len(sl)
            await t.wait_imm(11, n)
        nics = t.statistics().nics
        assert all(nic.pieces > 0 for nic in nics), nics
        assert sum(nic.bytes for nic in nics) == sl.nbytes
        assert abs(nics[0].bytes - nics[1].bytes) <= (1 << 20) + 12345
        want = np.zeros(size, np.uint8)
        for s, d, k in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(), strict=True):
            want[d:d + k] = src[s:s + k]
        assert np.array_equal(dst, want)


def test_total_length_past_int64_is_refused_or_exact() -> None:
    half = np.full(2, 1 << 62, np.int64)
    try:
        sl = ScatterList(np.zeros(2, np.int64), np.zeros(2, np.int64), half)
    except ScatterError as exc:
        assert "length" in str(exc)
    else:
        assert sl.nbytes == 1 << 63


def test_scatter_list_owns_read_only_copies() -> None:
    """Bounds are checked once, at construction: a caller changing its arrays
    afterwards must not move a piece out of bounds."""
    src = np.array([0, 100], np.int64)
    dst = np.array([0, 200], np.int64)
    length = np.array([10, 20], np.int64)
    sl = ScatterList(src, dst, length)
    assert (sl.src_end, sl.dst_end, sl.nbytes) == (120, 220, 30)
    dst[1] = 1 << 40
    length[0] = 1 << 30
    assert sl.dst.tolist() == [0, 200] and sl.length.tolist() == [10, 20]
    for arr in (sl.src, sl.dst, sl.length):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 5
        with pytest.raises(ValueError):
            arr.flags.writeable = True  # not even on purpose
    sl.check_bounds(120, 220)
    with pytest.raises(ScatterError, match=r"piece 1 .*past the destination region of 219"):
        sl.check_bounds(120, 219)
    with pytest.raises(ScatterError, match=r"piece 1 .*past the source region of 119"):
        sl.check_bounds(119, 220)
