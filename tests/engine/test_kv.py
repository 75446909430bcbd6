"""KV-cache page push (``p2pxfer.kv``) on real providers.

A sender engine pushes blocks of its ``KVPool`` into a receiver's pool with
``push_pages``; the receiver waits layer by layer with ``wait_layers``. Every
check verifies every byte of every pushed block against a reference built
here, independently of ``kv.py``'s strides (the pool seen as a
``[layer][plane][block][byte]`` array through numpy reshapes), and that every
other block of the destination is still zero.

Covered: every layout order x K/V planes x source/destination of different
orders and block counts (tcp and shm, in one process), one exchange between
two processes over tcp, ``wait_layers`` semantics (layer 0 before the rest,
subsets, timeouts, ``fail_request``, ``forget``, cancellation), coalescing
(fewer pieces, same bytes; ``expand_pages`` against a naive reference), a
sender that dies mid-request, bad input refused before anything is written,
numpy / client shared memory / CPU torch / CUDA torch memory as pools, descriptor wire round trips,
and ``examples/prefill_decode.py`` run with tiny sizes.

The last section holds regressions of bugs found while the API was young.

Every wait is bounded: a hang is a failure, not a stuck run. Children are
spawned (never forked: libfabric state must not be inherited) and always
killed and joined.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
import trio

from conftest import engine_config, engine_pair, returns_without_blocking, wait_until
from p2pxfer._kv_core import LayerArrivals
from p2pxfer.client import SharedMemory
from p2pxfer.engine import Engine, open_engine
from p2pxfer.engine._transfer import DRAIN_S
from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    P2PXferError,
    RegistrationError,
    TransferError,
    WaitTimeout,
)
from p2pxfer.kv import (
    MAX_LAYERS,
    MAX_REQUEST,
    ORDERS,
    KVLayout,
    KVPool,
    KVPoolDescriptor,
    decode_imm,
    encode_imm,
    expand_pages,
    push_pages,
)
from p2pxfer.kv_plan import layer_imm, request_base
from p2pxfer.memory import SharedBuffer

TCP = "tcp;ofi_rxm"
PROVIDERS = [TCP, "shm"]
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
ROOT = Path(__file__).resolve().parents[2]

STEP = 20.0  # bound of any single wait that should succeed
CHILD_STEP = 30.0  # bound of a child's waits (its start-up included)


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pair(provider: str, **kw: Any) -> AbstractAsyncContextManager[tuple[Engine, Engine]]:
    """(sender, receiver) engines in this process; ``kw`` configures the sender."""
    return engine_pair(provider, receiver={}, **kw)


# -- the reference: pools as [layer][plane][block][byte] arrays ------------------


def kv_view(array: U8, lay: KVLayout) -> U8:
    """``array`` seen as ``[layer][plane][block][byte]`` (a view), from the
    order's definition alone: layer_major is ``[layer][plane][block]``,
    block_major ``[block][layer][plane]``, plane_major ``[plane][layer][block]``."""
    nl, nb, npl, bb = lay.num_layers, lay.num_blocks, lay.planes, lay.block_bytes
    flat = array[: nl * nb * npl * bb]
    if lay.order == "layer_major":
        return flat.reshape(nl, npl, nb, bb)
    if lay.order == "block_major":
        return flat.reshape(nb, nl, npl, bb).transpose(1, 2, 0, 3)
    assert lay.order == "plane_major"
    return flat.reshape(npl, nl, nb, bb).transpose(1, 0, 2, 3)


def random_bytes(seed: Any, n: int) -> U8:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint8).copy()


def fill(pool: KVPool, seed: Any) -> None:
    pool.array[:] = random_bytes(seed, pool.array.nbytes)


def expected_image(src: U8, s_lay: KVLayout, d_lay: KVLayout, sb: Any, db: Any,
                   layers: Any, base: U8 | None = None) -> U8:
    """What the destination must hold after the push (zeros elsewhere)."""
    want = np.zeros(d_lay.nbytes, np.uint8) if base is None else base.copy()
    sv, wv = kv_view(src, s_lay), kv_view(want, d_lay)
    sb, db = np.asarray(sb), np.asarray(db)
    for layer in layers:
        wv[layer][:, db] = sv[layer][:, sb]
    return want


def assert_pool(got: U8, want: U8, lay: KVLayout) -> None:
    if np.array_equal(got, want):
        return
    bad = np.argwhere((kv_view(got, lay) != kv_view(want, lay)).any(axis=3))
    where = ", ".join(f"(layer {l_}, plane {p}, block {b})" for l_, p, b in bad[:8].tolist())
    raise AssertionError(f"{len(bad)} blocks differ, first: {where}")


def nic_totals(engine: Engine) -> tuple[int, int]:
    st = engine.statistics()
    return sum(n.bytes for n in st.nics), sum(n.pieces for n in st.nics)


def block_table(rng: np.random.Generator, num_blocks: int, n: int, runs: bool) -> I64:
    """``n`` distinct blocks: in random order, or as sorted runs (adjacent
    blocks listed one after another, so some pieces coalesce)."""
    picked = rng.choice(num_blocks, n, replace=False).astype(np.int64)
    return np.sort(picked) if runs else picked


# -- layouts x planes x orders ------------------------------------------------------


def test_kv_view_matches_pool_block_and_layout_size() -> None:
    """The reference and ``KVPool.block`` agree on where every block lives, and
    the blocks tile the layout's bytes exactly (no overlap, no gap)."""
    for order in ORDERS:
        for planes in (1, 2):
            lay = KVLayout(3, 5, 16, planes=planes, order=order)
            assert lay.nbytes == 3 * 5 * planes * 16
            assert lay.block_contiguous == (order != "block_major")
            arr = np.arange(lay.nbytes, dtype=np.int64)
            view = kv_view(arr, lay)  # type: ignore[arg-type]
            seen = np.zeros(lay.nbytes, np.int64)
            for layer in range(3):
                for p in range(planes):
                    for b in range(5):
                        off = int(view[layer, p, b, 0])
                        assert np.array_equal(view[layer, p, b], np.arange(off, off + 16))
                        seen[off:off + 16] += 1
            assert (seen == 1).all()


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dst_order", ORDERS)
@pytest.mark.parametrize("src_order", ORDERS)
async def test_push_every_layout(provider: str, src_order: str, dst_order: str,
                                 planes: int) -> None:
    seed = [ORDERS.index(src_order), ORDERS.index(dst_order), planes, len(provider)]
    rng = np.random.default_rng(seed)
    s_lay = KVLayout(4, 40, 512, planes=planes, order=src_order)
    d_lay = KVLayout(4, 72, 512, planes=planes, order=dst_order)
    async with pair(provider) as (a, b):
        src = KVPool(a, "src", s_lay)
        dst = KVPool(b, "dst", d_lay)
        fill(src, seed)
        desc = dst.describe()
        # Three requests: random order, sorted runs (coalescing), and a subset of
        # layers with a source block used twice.
        plans: list[tuple[I64, I64, list[int] | None]] = [
            (block_table(rng, 40, 17, False), block_table(rng, 72, 17, False), None),
            (block_table(rng, 40, 30, True), block_table(rng, 72, 30, True), None),
            (np.array([3, 3, 39, 0]), block_table(rng, 72, 4, False), [1, 3]),
        ]
        for rid, (sb, db, layers) in enumerate(plans, start=1):
            dst.array[:] = 0
            want_layers = list(range(4)) if layers is None else layers
            landed: list[list[int]] = []
            result: list[Any] = []

            async def sender(sb: I64 = sb, db: I64 = db, rid: int = rid,
                             layers: list[int] | None = layers,
                             result: list[Any] = result) -> None:
                result.append(await push_pages(a, src, desc, sb, db, request_id=rid,
                                               layers=layers))

            with trio.fail_after(STEP):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sender)
                    for layer in want_layers:
                        await dst.wait_layers(rid, layer, layers=[layer])
                        landed.append(dst.layers_done(rid))
            (res,) = result
            assert res.layers == tuple(want_layers)
            assert res.nbytes == len(sb) * planes * 512 * len(want_layers)
            assert sum(res.pieces) <= len(sb) * planes * len(want_layers)
            for k, layer in enumerate(want_layers):
                assert layer in landed[k]
            assert dst.layers_done(rid) == want_layers
            want = expected_image(src.array, s_lay, d_lay, sb, db, want_layers)
            assert_pool(dst.array, want, d_lay)
            # KVPool.block agrees with the reference on where blocks live.
            for layer in want_layers:
                for p in range(planes):
                    for i in (0, -1):
                        assert np.array_equal(dst.block(layer, int(db[i]), p),
                                              src.block(layer, int(sb[i]), p))
                        assert np.shares_memory(dst.block(layer, int(db[i]), p),
                                                kv_view(dst.array, d_lay)[layer, p, int(db[i])])
            dst.forget(rid)
        # Nothing failed, nothing is left in flight.
        st = a.statistics()
        assert st.failed == 0 and all(n.inflight == 0 and n.errors == 0 for n in st.nics)


# -- wait_layers semantics ----------------------------------------------------------


async def test_wait_layers_layer_by_layer(provider: str) -> None:
    lay = KVLayout(4, 32, 4096, planes=2)
    sb = dbl = np.arange(8, 24, dtype=np.int64)
    async with pair(provider) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 1)
        desc = dst.describe()
        # Layer 0 alone: wait_layers(.., 0) returns while layers 1..3 are not there.
        with trio.fail_after(STEP):
            await push_pages(a, src, desc, sb, dbl, request_id=5, layers=[0])
            await dst.wait_layers(5, 0)
        assert dst.layers_done(5) == [0]
        with pytest.raises(WaitTimeout, match=r"layers \[1, 2, 3\]"):
            await dst.wait_layers(5, 3, timeout=0.05)
        with pytest.raises(WaitTimeout, match=r"layers \[1\]"):
            await dst.wait_layers(5, 1, timeout=0.05)
        want0 = expected_image(src.array, lay, lay, sb, dbl, [0])
        assert_pool(dst.array, want0, lay)
        # A subset: layers 2 and 3 (and a waiter for 0..3 woken only at the end).
        order: list[str] = []

        async def full_waiter() -> None:
            await dst.wait_layers(5, 3)
            order.append("all")

        with trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(full_waiter)
                await push_pages(a, src, desc, sb, dbl, request_id=5, layers=[2, 3])
                await dst.wait_layers(5, 0, layers=[2, 3])
                order.append("subset")
                assert dst.layers_done(5) == [0, 2, 3]
                with pytest.raises(WaitTimeout, match=r"layers \[1\]"):
                    await dst.wait_layers(5, 3, timeout=0.05)
                await push_pages(a, src, desc, sb, dbl, request_id=5, layers=[1])
        assert order == ["subset", "all"]
        assert_pool(dst.array, expected_image(src.array, lay, lay, sb, dbl, range(4)), lay)
        # Once landed, every wait returns at once.
        for layer in range(4):
            await returns_without_blocking(partial(dst.wait_layers, 5, layer))


async def test_first_layer_lands_before_the_whole_push() -> None:
    """A big push: wait_layers(.., 0) returns no later than the last layer,
    and the sender's first layer completes first. (That layers *land* in
    order is pinned down by test_layers_land_in_order, a known bug.)"""
    lay = KVLayout(8, 64, 64 << 10)  # 32 MiB
    blocks = np.random.default_rng(3).permutation(64)
    async with pair(TCP) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 2)
        times: dict[int, float] = {}
        done_at: dict[int, list[int]] = {}
        result: list[Any] = []

        async def sender() -> None:
            result.append(await push_pages(a, src, dst.describe(), blocks, blocks,
                                           request_id=9))
            times[-1] = time.monotonic()

        with trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                for layer in range(8):
                    await dst.wait_layers(9, layer)
                    times[layer] = time.monotonic()
                    done_at[layer] = dst.layers_done(9)
        (res,) = result
        assert 0 < res.first_layer_seconds <= res.seconds
        assert all(times[k] <= times[k + 1] for k in range(7))
        assert all(layer in done for layer, done in done_at.items())
        assert_pool(dst.array, expected_image(src.array, lay, lay, blocks, blocks, range(8)),
                    lay)


async def test_fail_request_forget_and_cancel(provider: str) -> None:
    lay = KVLayout(2, 8, 1024)
    async with pair(provider) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 4)
        desc = dst.describe()
        errors: list[BaseException] = []

        async def waiter(layer: int) -> None:
            try:
                await dst.wait_layers(11, layer, timeout=STEP)
            except TransferError as exc:
                errors.append(exc)

        # fail_request ends every wait on the request with TransferError.
        with trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter, 0)
                nursery.start_soon(waiter, 1)
                await trio.sleep(0.02)
                dst.fail_request(11, "prefill node went away")
        assert len(errors) == 2
        assert all("request 11 failed: prefill node went away" in str(e) for e in errors)
        with pytest.raises(TransferError, match="prefill node went away"):
            await dst.wait_layers(11, 0, timeout=1)
        # ... even after layers landed: the failure sticks until forget().
        with trio.fail_after(STEP):
            await push_pages(a, src, desc, [1], [2], request_id=11)
        # The sender's completion can precede the receiver counting the
        # arrivals; forget() must come after, or late arrivals revive the id.
        await wait_until(lambda: dst.layers_done(11) == [0, 1], STEP, "both layers counted")
        with pytest.raises(TransferError):
            await dst.wait_layers(11, 1, timeout=1)
        # forget(): the id is fresh again.
        dst.forget(11)
        dst.forget(11)  # idempotent
        assert dst.layers_done(11) == []
        with pytest.raises(WaitTimeout):
            await dst.wait_layers(11, 0, timeout=0.05)
        dst.array[:] = 0
        with trio.fail_after(STEP):
            await push_pages(a, src, desc, [5, 6], [0, 7], request_id=11)
            await dst.wait_layers(11, 1)
        assert_pool(dst.array, expected_image(src.array, lay, lay, [5, 6], [0, 7], range(2)),
                    lay)
        dst.forget(11)

        # A cancelled wait leaves the bookkeeping: a later wait sees the arrivals.
        with trio.move_on_after(0.05) as cs:
            await dst.wait_layers(12, 1)
        assert cs.cancelled_caught
        with trio.fail_after(STEP):
            await push_pages(a, src, desc, [0], [0], request_id=12)
            await dst.wait_layers(12, 1)

        # Bad wait arguments.
        for upto in (-1, 2):
            with pytest.raises(InvalidArgument, match="upto_layer"):
                await dst.wait_layers(12, upto)


# -- coalescing ---------------------------------------------------------------------


async def test_coalescing_fewer_pieces_same_bytes(provider: str) -> None:
    s_lay = KVLayout(4, 64, 2048, planes=2)
    d_lay = KVLayout(4, 200, 2048, planes=2)
    sb = np.arange(64, dtype=np.int64)
    db = np.arange(100, 164, dtype=np.int64)
    async with pair(provider) as (a, b):
        src = KVPool(a, "src", s_lay)
        fill(src, 5)
        dst_on, dst_off = KVPool(b, "on", d_lay), KVPool(b, "off", d_lay)
        with trio.fail_after(STEP):
            before = nic_totals(a)[1]
            on = await push_pages(a, src, dst_on.describe(), sb, db, request_id=1)
            mid = nic_totals(a)[1]
            off = await push_pages(a, src, dst_off.describe(), sb, db, request_id=2,
                                   coalesce=False)
            after = nic_totals(a)[1]
            await dst_on.wait_layers(1, 3)
            await dst_off.wait_layers(2, 3)
        # The source's 64 blocks of both planes are one run (plane 1 follows plane
        # 0); on the destination the planes are apart: two pieces per layer.
        assert on.pieces == (2, 2, 2, 2)
        assert off.pieces == (128,) * 4
        # NIC pieces: the data's, plus each layer's one notification (notify mode)
        assert (mid - before, after - mid) == (8 + 4, 512 + 4)
        assert on.nbytes == off.nbytes == 4 * 2 * 64 * 2048
        assert np.array_equal(dst_on.array, dst_off.array)
        assert_pool(dst_on.array, expected_image(src.array, s_lay, d_lay, sb, db, range(4)),
                    d_lay)

        # A destination that is not block-contiguous (block_major) gets nothing
        # coalesced; the bytes are right either way.
        d_bm = KVLayout(4, 200, 2048, planes=2, order="block_major")
        dst_bm = KVPool(b, "bm", d_bm)
        with trio.fail_after(STEP):
            res = await push_pages(a, src, dst_bm.describe(), sb, db, request_id=3)
            await dst_bm.wait_layers(3, 3)
        assert res.pieces == (128,) * 4
        assert_pool(dst_bm.array, expected_image(src.array, s_lay, d_bm, sb, db, range(4)),
                    d_bm)


def naive_pieces(s: KVLayout, d: KVLayout, sb: Any, db: Any, layers: Any,
                 coalesce: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """One piece per (layer, plane, block) in that order from the order's
    definition (via ``kv_view`` offsets), merged by hand where both sides
    continue the previous piece within one layer."""
    s_off = kv_view(np.arange(s.nbytes, dtype=np.int64), s)[..., 0]  # type: ignore[arg-type]
    d_off = kv_view(np.arange(d.nbytes, dtype=np.int64), d)[..., 0]  # type: ignore[arg-type]
    so: list[int] = []
    do: list[int] = []
    ln: list[int] = []
    counts: list[int] = []
    bb = s.block_bytes
    for layer in layers:
        start = len(so)
        for p in range(s.planes):
            for sbk, dbk in zip(sb, db, strict=True):
                x, y = int(s_off[layer, p, sbk]), int(d_off[layer, p, dbk])
                if (coalesce and len(so) > start and so[-1] + ln[-1] == x
                        and do[-1] + ln[-1] == y):
                    ln[-1] += bb
                else:
                    so.append(x)
                    do.append(y)
                    ln.append(bb)
        counts.append(len(so) - start)
    return so, do, ln, counts


def test_expand_pages_matches_naive_reference() -> None:
    rng = np.random.default_rng(6)
    cases = 0
    for s_order in ORDERS:
        for d_order in ORDERS:
            for planes in (1, 2):
                s = KVLayout(3, 24, 64, planes=planes, order=s_order)
                d = KVLayout(3, 40, 64, planes=planes, order=d_order)
                for runs in (False, True):
                    n = int(rng.integers(1, 24))
                    sb = block_table(rng, 24, n, runs)
                    db = block_table(rng, 40, n, runs)
                    layers = sorted(rng.choice(3, int(rng.integers(1, 4)), replace=False))
                    for coalesce in (False, True):
                        got = expand_pages(s, d, sb, db, layers, coalesce=coalesce)
                        want = naive_pieces(s, d, sb.tolist(), db.tolist(), layers, coalesce)
                        for g, w in zip(got, want, strict=True):
                            assert g.dtype == np.int64
                            assert g.tolist() == w, (s_order, d_order, planes, runs, coalesce)
                        assert int(got[2].sum()) == len(layers) * planes * n * 64
                        cases += 1
    assert cases == 72
    # Whole contiguous runs: one piece per layer and plane boundary, and never
    # a piece across layers even where layers are adjacent on both sides.
    lay = KVLayout(4, 16, 32)
    all_blocks = np.arange(16, dtype=np.int64)
    so, do, ln, counts = expand_pages(lay, lay, all_blocks, all_blocks, range(4))
    assert counts.tolist() == [1, 1, 1, 1]
    assert ln.tolist() == [16 * 32] * 4
    assert so.tolist() == do.tolist() == [0, 512, 1024, 1536]
    so, do, ln, counts = expand_pages(lay, lay, all_blocks, all_blocks, range(4),
                                      coalesce=False)
    assert counts.tolist() == [16] * 4 and len(so) == 64 and set(ln.tolist()) == {32}
    # A run broken on one side only stays apart.
    _, _, ln, counts = expand_pages(lay, lay, np.array([0, 1, 2, 3]), np.array([0, 1, 5, 6]),
                                    [0])
    assert counts.tolist() == [2] and ln.tolist() == [64, 64]
    # Reversed order never coalesces.
    _, _, _, counts = expand_pages(lay, lay, np.array([3, 2, 1]), np.array([3, 2, 1]), [0])
    assert counts.tolist() == [3]


def test_immediate_encoding() -> None:
    for rid, layer in [(0, 0), (MAX_REQUEST, MAX_LAYERS - 1), (12345, 31)]:
        imm = encode_imm(rid, layer)
        assert 0 <= imm < 1 << 32  # fits 4 bytes of CQ data (EFA, verbs)
        assert decode_imm(imm) == (rid, layer)
    for args in [(-1, 0), (MAX_REQUEST + 1, 0), (0, -1), (0, MAX_LAYERS), (0, 1.5)]:
        with pytest.raises(InvalidArgument):
            encode_imm(*args)


def test_one_layer_encoding_for_every_base() -> None:
    """``layer_imm`` is the one (request, layer) encoding: the in-process base
    (``request_base``) and a daemon's request slot (``ImmTable.compose(slot,
    0)``) both take the layer in the low bits; a base that would overlap
    them is refused."""
    from p2pxfer.daemon._imms import SLOT_BITS, VALUE_BITS

    for rid, layer in [(0, 0), (MAX_REQUEST, MAX_LAYERS - 1), (77, 5)]:
        assert layer_imm(request_base(rid), layer) == encode_imm(rid, layer)
    slot_base = ((1 << SLOT_BITS) - 1) << VALUE_BITS  # a daemon's last slot, value 0
    imm = layer_imm(slot_base, MAX_LAYERS - 1)
    assert imm >> VALUE_BITS == (1 << SLOT_BITS) - 1 and imm & (MAX_LAYERS - 1) == MAX_LAYERS - 1
    for base, layer in [(1, 0), (request_base(3) | 7, 0), (0, MAX_LAYERS), (0, -1)]:
        with pytest.raises(InvalidArgument):
            layer_imm(base, layer)


async def test_layer_arrivals_count_in_either_order() -> None:
    """The one receiver bookkeeping (``LayerArrivals``): a layer is complete
    once as many notifications arrived as it brings, whether the count or
    the arrivals come first; waits see it, and ``end`` ends them."""
    rx = LayerArrivals.for_layers(3)
    assert not rx.arrive(0, 1)  # before its count: kept, not lost
    assert rx.announce(np.array([0, 1]), np.array([1, 2])) == 1
    assert not rx.arrive(1, 1) and rx.arrive(1, 1) and not rx.arrive(1, 1)
    assert not rx.arrive(7, 1)  # not a layer of this receiver
    assert rx.complete().tolist() == [True, True, False] and rx.prefix(0) == 2
    assert await rx.wait(np.array([0, 1]))
    assert not await rx.wait(np.array([2]), timeout=0)

    async def wait_all() -> None:
        await rx.wait(np.arange(3))

    with trio.fail_after(STEP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_all)
            await trio.sleep(0)
            rx.announce(np.array([2]), np.array([1]))
            assert rx.arrive(2, 1)  # completes it: the wait returns
    failed = LayerArrivals.for_layers(2, expected=1)
    failed.end(TransferError("gone"))
    with pytest.raises(TransferError, match="gone"):
        await failed.wait(np.array([0]))
    expired = LayerArrivals.for_layers(2, expected=1)
    expired.end(None)
    assert not await expired.wait(np.array([0]))


async def test_the_receiver_belongs_to_the_engines_trio_thread() -> None:
    """A pool's request bookkeeping is the engine's trio thread's: touched
    from another thread it refuses (``OwnershipError``) rather than race."""
    from p2pxfer.engine._owner import OwnershipError

    async with open_engine(engine_config("shm")) as e:
        pool = KVPool(e, "owned", KVLayout(2, 4, 256))
        assert pool.layers_done(3) == []
        with pytest.raises(OwnershipError, match="trio thread"):
            await trio.to_thread.run_sync(pool.layers_done, 3)


# -- bad input ----------------------------------------------------------------------


async def test_bad_input_refused_before_anything_is_written(provider: str) -> None:
    lay = KVLayout(4, 16, 256, planes=2)
    async with pair(provider) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 7)
        desc = dst.describe()
        other = {name: KVPool(b, f"other-{name}", KVLayout(**kw)).describe()  # type: ignore[arg-type]
                 for name, kw in [
                     ("block_bytes", {"num_layers": 4, "num_blocks": 16, "block_bytes": 512,
                                      "planes": 2}),
                     ("planes", {"num_layers": 4, "num_blocks": 16, "block_bytes": 256}),
                     ("num_layers", {"num_layers": 3, "num_blocks": 16, "block_bytes": 256,
                                     "planes": 2})]}
        ok = np.array([1, 2], np.int64)
        cases: list[tuple[type[P2PXferError], str, dict[str, Any]]] = [
            (InvalidArgument, "src_blocks holds block 16", {"src_blocks": [1, 16]}),
            (InvalidArgument, "dst_blocks holds block 99", {"dst_blocks": [99, 2]}),
            (InvalidArgument, "src_blocks holds block -1", {"src_blocks": [-1, 2]}),
            (InvalidArgument, "dst_blocks holds block -3", {"dst_blocks": [0, -3]}),
            (InvalidArgument, "1-D integer", {"src_blocks": np.array([1.0, 2.0])}),
            (InvalidArgument, "1-D integer", {"dst_blocks": np.array([True, False])}),
            (InvalidArgument, "1-D integer", {"src_blocks": np.array(["1", "2"])}),
            (InvalidArgument, "1-D integer", {"src_blocks": np.array([[1, 2]])}),
            (InvalidArgument, "1-D integer", {"dst_blocks": np.int64(3)}),
            (InvalidArgument, "equally long", {"src_blocks": [1, 2, 3]}),
            (InvalidArgument, "non-empty", {"src_blocks": np.array([], np.int64),
                                            "dst_blocks": np.array([], np.int64)}),
            (InvalidArgument, "block twice", {"dst_blocks": [4, 4]}),
            (InvalidArgument, "block_bytes differs", {"dst_pool": other["block_bytes"]}),
            (InvalidArgument, "planes differs", {"dst_pool": other["planes"]}),
            (InvalidArgument, "num_layers differs", {"dst_pool": other["num_layers"]}),
            (InvalidArgument, "layers must be integers within", {"layers": [4]}),
            (InvalidArgument, "layers must be integers within", {"layers": [-1, 0]}),
            (InvalidArgument, "layers must be integers within", {"layers": []}),
            (InvalidArgument, "request_id", {"request_id": MAX_REQUEST + 1}),
            (InvalidArgument, "request_id", {"request_id": -1}),
            (DescriptorError, "KVPoolDescriptor", {"dst_pool": desc.region}),
            (DescriptorError, "KVPoolDescriptor", {"dst_pool": desc.to_wire()}),
            (DescriptorError, "KVPoolDescriptor", {"dst_pool": dst}),
        ]
        wrong = []
        for exc_type, match, kw in cases:
            args: dict[str, Any] = {"dst_pool": desc, "src_blocks": ok, "dst_blocks": ok,
                                    "request_id": 1, **kw}
            try:
                with trio.fail_after(5):
                    await push_pages(a, src, args.pop("dst_pool"), args.pop("src_blocks"),
                                     args.pop("dst_blocks"), **args)
            except exc_type as exc:
                if match not in str(exc):
                    wrong.append(f"{kw}: message {str(exc)!r} lacks {match!r}")
            except BaseException as exc:
                wrong.append(f"{kw}: raised {exc!r}, want {exc_type.__name__}")
            else:
                wrong.append(f"{kw}: was accepted")
        assert not wrong, "\n".join(wrong)
        assert nic_totals(a) == (0, 0)
        st = a.statistics()
        assert st.completed == 0 and st.failed == 0 and st.in_flight == (0,)
        assert not dst.array.any()
        assert all(nic.received == 0 for nic in b.statistics().nics)
        # The engines still work.
        with trio.fail_after(STEP):
            await push_pages(a, src, desc, ok, ok, request_id=1)
            await dst.wait_layers(1, 3)
        assert_pool(dst.array, expected_image(src.array, lay, lay, ok, ok, range(4)), lay)


async def test_pool_construction_errors() -> None:
    async with open_engine(engine_config("shm")) as e:
        lay = KVLayout(2, 8, 1024, planes=2)
        with pytest.raises(InvalidArgument, match="pool memory holds 100 bytes"):
            KVPool(e, "small", lay, buffer=np.zeros(100, np.uint8))
        with pytest.raises(InvalidArgument, match=str(lay.nbytes)):
            KVPool(e, "small", lay, buffer=np.zeros(lay.nbytes - 1, np.uint8))
        assert "small" not in e.exported()
        # A bigger buffer is fine (the layout spans its start); any dtype will do.
        pool = KVPool(e, "big", lay, buffer=np.zeros(lay.nbytes // 2 + 8, np.float16))
        assert pool.array.nbytes == lay.nbytes + 16
        with pytest.raises(InvalidArgument, match="already exported"):
            KVPool(e, "big", lay)
        with pytest.raises(P2PXferError):
            KVPool(e, "ro", lay, buffer=bytes(lay.nbytes))
        assert set(e.exported()) == {"big"}


def test_layout_arguments() -> None:
    bad: list[dict[str, Any]] = [
        {"num_layers": 0}, {"num_layers": -2}, {"num_blocks": 0}, {"block_bytes": -1},
        {"planes": 0}, {"num_blocks": 2.0}, {"block_bytes": True}, {"planes": "2"},
        {"order": "row_major"}, {"order": ""}, {"num_layers": MAX_LAYERS + 1},
    ]
    for kw in bad:
        args = {"num_layers": 2, "num_blocks": 4, "block_bytes": 64, **kw}
        with pytest.raises(InvalidArgument):
            KVLayout(**args)
    assert KVLayout(MAX_LAYERS, 1, 1).num_layers == MAX_LAYERS
    # Explicit strides override the order's (a padded layer_major pool).
    lay = KVLayout(2, 4, 64, layer_stride=4096)
    assert (lay.layer_stride, lay.block_stride, lay.plane_stride) == (4096, 64, 256)
    assert lay.nbytes == 4096 + 3 * 64 + 64
    assert KVLayout(2, 4, 64).compatible(KVLayout(2, 9, 64, order="block_major")) is None
    assert "planes" in str(KVLayout(2, 4, 64).compatible(KVLayout(2, 4, 64, planes=2)))


# -- descriptors on the wire --------------------------------------------------------


async def test_descriptor_wire_round_trip_and_malformed() -> None:
    for order in ORDERS:
        for planes in (1, 2):
            lay = KVLayout(5, 7, 96, planes=planes, order=order)
            assert KVLayout.from_wire(msgpack.unpackb(msgpack.packb(lay.to_wire()))) == lay
    padded = KVLayout(2, 4, 64, layer_stride=4096)
    assert KVLayout.from_wire(padded.to_wire()) == padded

    async with open_engine(engine_config(TCP, node_name="decode-0", incarnation=3)) as e:
        lay = KVLayout(3, 8, 128, planes=2, order="block_major")
        pool = KVPool(e, "kv", lay)
        desc = pool.describe()
        assert desc.region.length == lay.nbytes and desc.region.name == "kv"
        wire = msgpack.packb(desc.to_wire(), use_bin_type=True)
        back = KVPoolDescriptor.from_wire(msgpack.unpackb(wire, raw=False))
        assert back == desc
        assert back.region.node == "decode-0" and back.region.incarnation == 3

        good = desc.to_wire()
        lw = lay.to_wire()
        malformed: list[Any] = [
            None, [], "kv", {}, {"region": good["region"]}, {"layout": lw},
            {**good, "extra": 1},
            {"region": good["region"], "layout": None},
            {"region": good["region"], "layout": {**lw, "strides": [1, 2]}},
            {"region": good["region"], "layout": {k: v for k, v in lw.items() if k != "planes"}},
            {"region": good["region"], "layout": {**lw, "layers": 0}},
            {"region": good["region"], "layout": {**lw, "order": "diagonal"}},
            {"region": good["region"], "layout": {**lw, "block_bytes": "128"}},
            {"region": {**good["region"], "v": 99}, "layout": lw},
            {"region": {**good["region"], "len": -1}, "layout": lw},
            {"region": None, "layout": lw},
        ]
        wrong = []
        for obj in malformed:
            try:
                KVPoolDescriptor.from_wire(obj)
            except DescriptorError:
                continue
            except BaseException as exc:
                wrong.append(f"{obj!r}: raised {exc!r}")
            else:
                wrong.append(f"{obj!r}: accepted")
        assert not wrong, "\n".join(wrong)


# -- numpy, torch and CUDA memory as pools --------------------------------------------


async def test_numpy_pools_of_other_dtypes(provider: str) -> None:
    lay = KVLayout(2, 16, 512, planes=2, order="plane_major")
    async with pair(provider) as (a, b):
        src_mem = np.random.default_rng(8).standard_normal(lay.nbytes // 4).astype(np.float32)
        dst_mem = np.zeros((lay.nbytes // 2,), np.float16)
        src = KVPool(a, "src", lay, buffer=src_mem)
        dst = KVPool(b, "dst", lay, buffer=dst_mem)
        assert np.shares_memory(src.array, src_mem) and np.shares_memory(dst.array, dst_mem)
        sb, db = np.array([0, 5, 15]), np.array([2, 3, 4])
        with trio.fail_after(STEP):
            await push_pages(a, src, dst.describe(), sb, db, request_id=3)
            await dst.wait_layers(3, 1)
        assert_pool(dst_mem.view(np.uint8),
                    expected_image(src_mem.view(np.uint8), lay, lay, sb, db, range(2)), lay)
        # Client shared memory (memfd-backed, as a daemon client allocates it).
        shared = SharedMemory(SharedBuffer(lay.nbytes), mem_id=0)
        try:
            dst2 = KVPool(b, "shared", lay, buffer=shared)
            assert np.shares_memory(dst2.array, shared.array)
            with trio.fail_after(STEP):
                await push_pages(a, src, dst2.describe(), sb, db, request_id=4)
                await dst2.wait_layers(4, 1)
            assert_pool(shared.array, expected_image(src_mem.view(np.uint8), lay, lay, sb, db,
                                                     range(2)), lay)
            b.unexport("shared")
        finally:
            shared.close()


# Sync fixtures: a skip raised inside a trio test loses its reason.
@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed (optional)")


@pytest.fixture
def cuda_torch(torch: Any) -> Any:
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda is not available on this machine")
    return torch


async def test_cpu_torch_tensors_as_pools(provider: str, torch: Any) -> None:
    lay = KVLayout(3, 16, 1024, planes=2)
    src_t = torch.randn(lay.nbytes // 2, dtype=torch.float16)
    dst_t = torch.zeros(3, 2, 16, 512, dtype=torch.bfloat16)  # [layer][plane][block][elem]
    async with pair(provider) as (a, b):
        src = KVPool(a, "src", lay, buffer=src_t)
        dst = KVPool(b, "dst", lay, buffer=dst_t)
        sb, db = np.array([1, 2, 3, 9]), np.array([15, 0, 1, 7])
        with trio.fail_after(STEP):
            await push_pages(a, src, dst.describe(), sb, db, request_id=4)
            await dst.wait_layers(4, 2)
        # The pool is the tensor's memory: the bits arrive in the tensor itself.
        got = dst_t.view(torch.int16)
        want = src_t.view(torch.int16).reshape(3, 2, 16, 512)
        for s, d in zip(sb.tolist(), db.tolist(), strict=True):
            assert torch.equal(got[:, :, d], want[:, :, s])
        untouched = [k for k in range(16) if k not in db.tolist()]
        assert not got[:, :, untouched].any()
        # Device tensors this build cannot register are refused up front.
        with pytest.raises(RegistrationError, match="meta tensor"):
            KVPool(b, "meta", lay, buffer=torch.zeros(lay.nbytes, device="meta"))
        # Non-contiguous tensors are refused.
        with pytest.raises(InvalidArgument, match="contiguous"):
            KVPool(b, "strided", lay, buffer=torch.zeros(lay.nbytes, 2, dtype=torch.uint8)[:, 0])


@pytest.mark.gpu
def test_cuda_tensor_pool(cuda_torch: Any) -> None:
    """A CUDA tensor as the destination pool, where the build and provider can
    register device memory (FI_HMEM); skipped with the engine's reason where not."""
    torch = cuda_torch
    lay = KVLayout(2, 8, 4096)

    async def body() -> str | None:
        async with pair(TCP) as (a, b):
            src = KVPool(a, "src", lay)
            fill(src, 9)
            dst_t = torch.zeros(lay.nbytes, dtype=torch.uint8, device="cuda")
            try:
                dst = KVPool(b, "dst", lay, buffer=dst_t)
            except RegistrationError as exc:
                return f"CUDA memory cannot be registered here: {exc}"
            with trio.fail_after(STEP):
                await push_pages(a, src, dst.describe(), [0, 1], [6, 7], request_id=1)
                await dst.wait_layers(1, 1)
            assert_pool(dst_t.cpu().numpy(),
                        expected_image(src.array, lay, lay, [0, 1], [6, 7], range(2)), lay)
        return None

    # Run here, not as a trio test: a skip raised inside trio loses its reason.
    if (why := trio.run(body)) is not None:
        pytest.skip(why)


# -- two processes ------------------------------------------------------------------

SEND_LAYOUT = KVLayout(6, 96, 8192, planes=2, order="layer_major")
RECV_LAYOUT = KVLayout(6, 128, 8192, planes=2, order="block_major")
SEED = 0x4B56


def sender_main(conn: Connection, mode: str) -> None:
    """The child: a prefill node. Gets the receiver's pool descriptor (msgpack
    bytes) and block tables through ``conn``, pushes, reports each push.
    ``mode="partial"`` pushes layers one push at a time, reporting each, then
    sleeps until it is killed."""
    try:
        trio.run(_sender, conn, mode)
    except BaseException:
        conn.send(msgpack.packb({"error": traceback.format_exc()}))
        raise SystemExit(1) from None


async def _sender(conn: Connection, mode: str) -> None:
    async with open_engine(engine_config(TCP)) as eng:
        lay = SEND_LAYOUT
        src = KVPool(eng, "prefill", lay)
        fill(src, SEED)
        while True:
            msg = msgpack.unpackb(await recv(conn, CHILD_STEP), raw=False)
            if msg == "stop":
                return
            desc = KVPoolDescriptor.from_wire(msg["pool"])
            sb = np.frombuffer(msg["src"], np.int64)
            db = np.frombuffer(msg["dst"], np.int64)
            rid = msg["id"]
            with trio.fail_after(CHILD_STEP):
                if mode == "partial":
                    for layer in msg["layers"]:
                        await push_pages(eng, src, desc, sb, db, request_id=rid,
                                         layers=[layer])
                        conn.send(msgpack.packb({"id": rid, "layer": layer}))
                    await trio.sleep(CHILD_STEP)  # "dies" here: the parent kills us
                    return
                res = await push_pages(eng, src, desc, sb, db, request_id=rid)
            conn.send(msgpack.packb({"id": rid, "pieces": list(res.pieces)}))


async def recv(conn: Connection, timeout: float) -> Any:
    """Receive one message without blocking trio; bounded."""
    if not await trio.to_thread.run_sync(conn.poll, timeout):
        raise AssertionError(f"nothing came through the pipe within {timeout} s")
    return conn.recv()


@asynccontextmanager
async def sender_child(mode: str) -> AsyncIterator[tuple[Connection, mp.process.BaseProcess]]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=sender_main, args=(there, mode), name=f"kv-sender-{mode}")
    proc.start()
    there.close()
    try:
        yield here, proc
    finally:
        if proc.is_alive():
            proc.kill()
        await trio.to_thread.run_sync(proc.join, 10)
        here.close()


def reply(data: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(data, raw=False)
    if "error" in msg:
        raise AssertionError(f"the sender failed:\n{msg['error']}")
    return msg  # type: ignore[no-any-return]


async def test_push_between_two_processes() -> None:
    """A spawned prefill child (layer_major, 96 blocks) pushes two requests
    into this process's block_major pool of 128 blocks over tcp; every layer is
    awaited in order and every byte checked, then the child stops cleanly."""
    s_lay = SEND_LAYOUT
    src_image = random_bytes(SEED, s_lay.nbytes)
    rng = np.random.default_rng(10)
    async with open_engine(engine_config(TCP)) as eng, sender_child("full") as (conn, proc):
        dst = KVPool(eng, "decode", RECV_LAYOUT)
        pool_wire = dst.describe().to_wire()
        want = np.zeros(RECV_LAYOUT.nbytes, np.uint8)
        free = rng.permutation(128)
        for rid, n in ((100, 40), (MAX_REQUEST, 64)):
            sb = block_table(rng, 96, n, rid == 100)
            db, free = free[:n].astype(np.int64), free[n:]
            conn.send(msgpack.packb({"pool": pool_wire, "id": rid, "src": sb.tobytes(),
                                     "dst": db.tobytes()}))
            with trio.fail_after(CHILD_STEP):
                for layer in range(6):
                    await dst.wait_layers(rid, layer)
                    assert layer in dst.layers_done(rid)
                msg = reply(await recv(conn, CHILD_STEP))
            assert msg["id"] == rid and len(msg["pieces"]) == 6
            want = expected_image(src_image, s_lay, RECV_LAYOUT, sb, db, range(6), base=want)
            assert_pool(dst.array, want, RECV_LAYOUT)
            dst.forget(rid)
        assert int(kv_view(want, RECV_LAYOUT).any(axis=(0, 1, 3)).sum()) == 104
        conn.send(msgpack.packb("stop"))
        await trio.to_thread.run_sync(proc.join, CHILD_STEP)
        assert proc.exitcode == 0


async def test_dead_sender_ends_wait_layers_with_an_error() -> None:
    """The sender pushes layers 0 and 1 of 6, then is SIGKILLed: waits for the
    landed layers return, waits for the rest end with WaitTimeout in bounded
    time (and fail_request turns every other wait into TransferError); the
    receiver keeps working."""
    s_lay = SEND_LAYOUT
    src_image = random_bytes(SEED, s_lay.nbytes)
    sb = np.arange(10, 30, dtype=np.int64)
    db = np.arange(50, 70, dtype=np.int64)[::-1].copy()
    async with open_engine(engine_config(TCP)) as eng, sender_child("partial") as (conn, proc):
        dst = KVPool(eng, "decode", RECV_LAYOUT)
        conn.send(msgpack.packb({"pool": dst.describe().to_wire(), "id": 7,
                                 "src": sb.tobytes(), "dst": db.tobytes(), "layers": [0, 1]}))
        with trio.fail_after(CHILD_STEP):
            await dst.wait_layers(7, 0)
            await dst.wait_layers(7, 1)
            for layer in (0, 1):
                assert reply(await recv(conn, CHILD_STEP)) == {"id": 7, "layer": layer}
        assert_pool(dst.array, expected_image(src_image, s_lay, RECV_LAYOUT, sb, db, [0, 1]),
                    RECV_LAYOUT)
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        await trio.to_thread.run_sync(proc.join, 10)
        assert proc.exitcode == -signal.SIGKILL

        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match=r"request 7: layers \[2, 3, 4, 5\]"):
            await dst.wait_layers(7, 5, timeout=0.5)
        assert time.monotonic() - t0 < 3
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                await dst.wait_layers(7, 5)  # unbounded: only fail_request ends it
            except TransferError as exc:
                errors.append(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(0.02)
                dst.fail_request(7, "sender died")
        assert len(errors) == 1 and "sender died" in str(errors[0])
        assert dst.layers_done(7) == [0, 1]
        # Nothing else landed; the receiver serves the next sender.
        assert_pool(dst.array, expected_image(src_image, s_lay, RECV_LAYOUT, sb, db, [0, 1]),
                    RECV_LAYOUT)
        dst.forget(7)
        async with open_engine(engine_config(TCP)) as other:
            src = KVPool(other, "src", SEND_LAYOUT)
            fill(src, SEED)
            dst.array[:] = 0
            with trio.fail_after(STEP):
                await push_pages(other, src, dst.describe(), sb, db, request_id=7)
                await dst.wait_layers(7, 5)
            assert_pool(dst.array, expected_image(src_image, s_lay, RECV_LAYOUT, sb, db,
                                                  range(6)), RECV_LAYOUT)


# -- the example --------------------------------------------------------------------


def test_prefill_decode_example_runs() -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "prefill_decode.py"), "--layers", "4",
           "--blocks", "64", "--block-kib", "4", "--prefill-blocks", "48", "--planes", "2",
           "--requests", "3", "--blocks-per-request", "12", "--timeout", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT,
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "verified" in proc.stdout, out
    assert proc.stdout.count("request") >= 3, out
    assert "overall" in proc.stdout, out


# -- regressions of bugs found early -------------------------------------------------


async def test_layers_land_in_order() -> None:
    lay = KVLayout(8, 64, 64 << 10)
    blocks = np.random.default_rng(3).permutation(64)
    for attempt in range(8):  # one fresh connection reorders ~half the time
        async with pair(TCP) as (a, b):
            src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
            done_at: list[list[int]] = []
            with trio.fail_after(STEP):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(push_pages, a, src, dst.describe(), blocks,
                                               blocks, request_id=attempt))
                    for layer in range(8):
                        await dst.wait_layers(attempt, layer)
                        done_at.append(dst.layers_done(attempt))
            # Whatever has landed when a layer's wait returns is a prefix 0..k.
            assert all(d == list(range(len(d))) for d in done_at), done_at


async def test_push_more_layers_than_inflight_slots() -> None:
    lay = KVLayout(8, 4, 256)
    async with pair(TCP, max_inflight=4) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        with trio.fail_after(3):
            await push_pages(a, src, dst.describe(), [0], [1], request_id=1)
            await dst.wait_layers(1, 7)


async def test_layout_larger_than_region_refused_before_writing() -> None:
    lay = KVLayout(4, 16, 256)
    async with pair(TCP) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 11)
        lying = KVPoolDescriptor(dst.region, KVLayout(4, 64, 256))
        with trio.fail_after(5), pytest.raises(InvalidArgument):
            await push_pages(a, src, lying, [0], [60], request_id=1)
        assert nic_totals(a) == (0, 0) and not dst.array.any()


async def test_non_integer_layers_refused_before_writing() -> None:
    lay = KVLayout(4, 16, 256)
    async with pair(TCP) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 12)
        for kw in ({"layers": [0, 1.5], "request_id": 1}, {"request_id": 1.0}):
            with trio.fail_after(5), pytest.raises(InvalidArgument):
                await push_pages(a, src, dst.describe(), [0], [1], **kw)
        assert nic_totals(a) == (0, 0) and not dst.array.any()


def test_layout_rejects_bad_strides() -> None:
    for kw in ({"layer_stride": -5}, {"block_stride": 128}, {"plane_stride": 1}):
        with pytest.raises(InvalidArgument):
            KVLayout(4, 16, 256, planes=2, **kw)  # type: ignore[arg-type]
    wire = KVLayout(4, 16, 256).to_wire()
    with pytest.raises(DescriptorError):
        KVLayout.from_wire({**wire, "strides": ["x", 1, 1]})


async def test_wait_layers_rejects_out_of_range_layers() -> None:
    async with open_engine(engine_config("shm")) as e:
        pool = KVPool(e, "kv", KVLayout(2, 4, 64))
        for layers in ([2], [-1], [0, 99]):
            with trio.fail_after(1), pytest.raises(InvalidArgument):
                await pool.wait_layers(1, 0, layers=layers)


async def test_wait_layers_timeout_zero_after_landing() -> None:
    lay = KVLayout(2, 4, 64)
    async with pair("shm") as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        with trio.fail_after(STEP):
            await push_pages(a, src, dst.describe(), [0], [0], request_id=1)
            await dst.wait_layers(1, 1)
        await dst.wait_layers(1, 1, timeout=0)


async def push_cancelled(a: Engine, src: KVPool, dst: KVPool, blocks: npt.NDArray[np.int64],
                         until: Any) -> None:
    """Push ``blocks`` of every layer as request 1, cancel it once ``until()``
    returned, and return once the push has ended."""
    async with trio.open_nursery() as nursery:

        async def pusher(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as cs:
                task_status.started(cs)
                await push_pages(a, src, dst.describe(), blocks, blocks, request_id=1,
                                 coalesce=False)

        cs = await nursery.start(pusher)
        await until()
        cs.cancel()


async def test_cancelled_push_stops_posting_later_layers() -> None:
    lay = KVLayout(16, 1024, 8 << 10)  # 128 MiB, 16384 pieces
    blocks = np.arange(1024, dtype=np.int64)
    async with pair(TCP) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        with trio.fail_after(STEP):
            await push_cancelled(a, src, dst, blocks, lambda: wait_until(
                lambda: sum(a.shards[0].pieces_done) > 0, STEP, "a completion"))
        posted = nic_totals(a)[1]
        # Only the layer being waited on (layer 0) may be cut short today.
        assert posted < 15 * 1024, f"{posted} pieces went out after the cancel"


async def test_a_cancelled_push_leaves_whole_layers_and_nothing_lands_after() -> None:
    """Cancelled midway, a push lets the layer under way go on to its end
    (its notification too) and cancels the layers not begun: once it has
    raised, every layer of the pool is either whole or untouched, each whole
    one was notified, and nothing lands afterwards. (Stopped midway, the
    layer's posted pieces were only known handed to tcp's socket: they could
    land after the push had raised, into blocks its receiver had given to
    another request by then.)"""
    n = 16
    lay = KVLayout(n, 512, 16 << 10)  # 8 MiB a layer
    blocks = np.arange(512, dtype=np.int64)
    async with pair(TCP) as (a, b):
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        fill(src, 5)
        with trio.fail_after(STEP):
            await push_cancelled(a, src, dst, blocks, lambda: dst.wait_layers(1, 0))
            landed = dst.array.copy()
            await trio.sleep(0.3)
        assert np.array_equal(dst.array, landed), "bytes landed after the push had ended"
        want = expected_image(src.array, lay, lay, blocks, blocks, range(n))
        notified = set(dst.layers_done(1))
        cut = []
        for layer in range(n):
            at = slice(layer * lay.layer_stride, (layer + 1) * lay.layer_stride)
            whole, untouched = np.array_equal(landed[at], want[at]), not landed[at].any()
            if not (whole or untouched):
                cut.append(layer)
            assert whole == (layer in notified), f"layer {layer}: whole {whole}, notified"
        assert not cut, f"layers {cut} were cut short"
        assert len(notified) < n, "the push ended before the cancel: nothing was tested"


async def test_push_to_dead_receiver_ends() -> None:
    lay = KVLayout(4, 8, 4096)
    async with open_engine(engine_config(TCP)) as a:
        src = KVPool(a, "src", lay)
        async with open_engine(engine_config(TCP)) as b:
            desc = KVPool(b, "dst", lay).describe()
            with trio.fail_after(STEP):
                await push_pages(a, src, desc, [0], [1], request_id=1)
        # b is closed now. A bounded push must end by itself (error or cancel).
        watchdog_fired = False

        async def watchdog() -> None:
            nonlocal watchdog_fired
            # Past the cancel, a piece under way may drain: beyond both is a
            # push that ignored its cancel scope, however slow the machine.
            await trio.sleep(0.5 + DRAIN_S + 5)
            watchdog_fired = True
            await a.aclose()  # fails the stuck transfers, so the test cannot hang

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog)
            try:
                with trio.move_on_after(0.5):
                    await push_pages(a, src, desc, [0], [1], request_id=2)
            except TransferError:
                pass  # a clear error is the best outcome
            finally:
                nursery.cancel_scope.cancel()
        assert not watchdog_fired, "the push ignored its cancel scope"


async def test_four_byte_immediates_cap_the_engine_and_carry_in_process_kv() -> None:
    """``imm_bytes = 4`` makes tcp carry what EFA and verbs carry: wider
    immediates are refused (never cut), and the in-process KV push (one
    32-bit notification per layer) runs as it does with 8 bytes."""
    from p2pxfer.scatter import ScatterList

    lay = KVLayout(2, 4, 256)
    async with pair(TCP, imm_bytes=4) as (a, b):
        assert a.imm_bits == 32
        src, dst = KVPool(a, "src", lay), KVPool(b, "dst", lay)
        src.array[:] = np.arange(src.array.nbytes, dtype=np.uint64).astype(np.uint8)
        with trio.fail_after(STEP):
            res = await push_pages(a, src, dst.describe(), [0, 3], [1, 2],
                                   request_id=MAX_REQUEST)
            await dst.wait_layers(MAX_REQUEST, 1)
        assert res.layers == (0, 1) and dst.layers_done(MAX_REQUEST) == [0, 1]
        for layer in range(2):
            assert np.array_equal(dst.block(layer, 1), src.block(layer, 0))
            assert np.array_equal(dst.block(layer, 2), src.block(layer, 3))
        assert not dst.block(0, 0).any() and not dst.block(1, 3).any()
        one = ScatterList(np.array([0]), np.array([0]), np.array([256]))
        with pytest.raises(InvalidArgument, match="32 bits"):
            await a.write(src.array, dst.region, one, imm=1 << 32)
        with pytest.raises(InvalidArgument, match="32 bits"):
            await a.wait_imm(1 << 32, 1)
        before = nic_totals(a)
        assert await a.write(src.array, dst.region, one, imm=(1 << 32) - 1) == 1
        assert nic_totals(a)[0] - before[0] == 256
