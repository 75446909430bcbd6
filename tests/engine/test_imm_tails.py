"""A piece carrying its immediate goes as two on shm (``FabricInfo.imm_tail``):
all but its last 64 bytes without the immediate, which the writer places
itself at its post (CMA), then those 64 bytes with it, inline. Neither waits
for the target's progress, so such a write completes while the target reads
nothing; the target still counts one arrival per piece of the caller's, once
the piece's every byte is there.

Two engines in this process over shm, and over tcp;ofi_rxm (which sends
pieces whole): every byte checked, every immediate counted exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from conftest import engine_pair as pair
from p2pxfer.fabric import IMM_TAIL_ABOVE
from p2pxfer.scatter import ScatterList
from p2pxfer.testing import scatter_at_random

REGION = 32 << 20
STEP = 30.0
TAIL = 64
#: lengths over shm's inject size, at rxm's eager boundary and past it
LENGTHS = [IMM_TAIL_ABOVE + 1, 8192, 16383, 16384, 16385, 65536, 1 << 20]


def _rails(engine: Any) -> list[Any]:
    return [r for s in engine.shards for r in s._group.rails]


@pytest.mark.parametrize(("provider", "config", "tail"), [
    ("shm", {}, TAIL),
    ("shm", {"delivery_complete": True}, 0),
    ("tcp;ofi_rxm", {}, 0),
])
async def test_which_rails_send_tails_apart(provider: str, config: dict[str, Any],
                                            tail: int) -> None:
    async with pair(provider, **config) as (a, _):
        assert [r.imm_tail for r in _rails(a)] == [tail] * len(_rails(a))


async def test_a_lone_write_with_its_immediate_completes_while_the_target_is_mute() -> None:
    """The target's poller held off its CQs reads nothing, so shm there
    copies nothing: a write that needed it would wait until the target reads
    again. Each of these completes first; its head is in place at once, its
    tail and immediate once the target reads."""
    rng = np.random.default_rng(27)
    src = rng.integers(0, 256, REGION, dtype=np.uint8)
    region = np.zeros(REGION, np.uint8)
    async with pair("shm") as (a, b):
        desc = b.export(region, "r")
        a.register(src)
        written = []
        with trio.fail_after(STEP):  # shm's first contact needs the target's progress
            await a.write(src, desc, ScatterList.contiguous(8, 0, REGION - 8), imm=9)
            await b.wait_imm(9, 1)
        for shard in b.shards:
            shard._poller.hold(True)  # test-only reach: a mute target
        try:
            with trio.fail_after(STEP):
                at = 0
                for k, n in enumerate(LENGTHS):
                    sl = ScatterList.contiguous(n, at, REGION - at - n)
                    assert await a.write(src, desc, sl, imm=10 + k) == 1
                    d = REGION - at - n
                    np.testing.assert_array_equal(region[d:d + n - TAIL], src[at:at + n - TAIL])
                    written.append(sl)
                    at += n
        finally:
            for shard in b.shards:
                shard._poller.hold(False)
        with trio.fail_after(STEP):
            for k in range(len(LENGTHS)):
                await b.wait_imm(10 + k, 1)
        for sl in written:
            s, d, n = int(sl.src[0]), int(sl.dst[0]), int(sl.length[0])
            np.testing.assert_array_equal(region[d:d + n], src[s:s + n])
        st = a.statistics()
        assert st.failed == 0 and st.express >= len(LENGTHS)


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
@pytest.mark.parametrize("path", ["express", "handed-over", "regular"])
async def test_heads_and_tails_land_every_byte_and_count_once(provider: str, path: str) -> None:
    """Per-piece immediates over random block tables: the express path, an
    express write that runs out of budget at once and finishes as a regular
    transfer from wherever its heads and tails were, and writes of more
    pieces than the express path takes (and writes submitted, which take
    the regular path too). Pieces at or under shm's inject size among them
    keep the whole write uncut. Each write returns and reports the caller's
    piece count, and the target counts exactly that
    many arrivals (a last write's arrival, behind the others on the same
    connection, shows none comes late)."""
    config: dict[str, Any] = ({"inline_poll_ns": 1, "inline_poll_max_ns": 0}
                              if path == "handed-over" else {})
    counts = [70, 130] if path == "regular" else [1, 2, 5, 17]
    rng = np.random.default_rng(28)
    src = rng.integers(0, 256, REGION, dtype=np.uint8)
    async with pair(provider, **config) as (a, b):
        a.register(src)
        want = {}
        for k, n in enumerate(counts * 2):
            dst = np.zeros(REGION, np.uint8)
            desc = b.export(dst, f"r{k}")
            lengths = rng.choice(LENGTHS[:-1] if n > 20 else LENGTHS, n)
            if k >= len(counts):  # the second round: one short piece among them
                lengths[rng.integers(n)] = IMM_TAIL_ABOVE
            sl = ScatterList(*scatter_at_random(rng, lengths.astype(np.int64), REGION))
            with trio.fail_after(STEP):
                if k % 2:
                    t = await a.submit(src, desc, sl, imm=100 + k)
                    assert (t.pieces, t.imms) == (n, n)
                    assert await t.wait() == n
                else:
                    assert await a.write(src, desc, sl, imm=100 + k) == n
                await b.wait_imm(100 + k, n)
            for s, d, m in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(),
                               strict=True):
                np.testing.assert_array_equal(dst[d:d + m], src[s:s + m])
            want[100 + k] = 0
            b.unexport(f"r{k}")
        last = b.export(np.zeros(1 << 20, np.uint8), "last")
        with trio.fail_after(STEP):
            await a.write(src, last, ScatterList.contiguous(1 << 20), imm=99)
            await b.wait_imm(99, 1)
        assert {imm: b.imm_count(imm) for imm in want} == want
        st = a.statistics()
        assert st.failed == 0 and [x.inflight for x in st.nics] == [0] * len(st.nics)
        assert sum(x.errors for x in st.nics) == 0
        # Statistics count the caller's pieces too, whichever path completed them.
        total = sum(counts) * 2 + 1
        assert sum(x.pieces for x in st.nics) == sum(x.completed for x in st.nics) == total
        if path == "handed-over":
            assert st.express_handed_over > 0
        elif path == "express":
            assert st.express > 0
