"""Pieces without an immediate go out several per RMA write on tcp;ofi_rxm
(``fi_writemsg`` with up to four iovs each side, ``P2P_GROUP_MAX``), and the
completion of such a write counts all its pieces (the count rides in its
operation context, ``fabric/_batch.py``).

Through real providers on loopback: random scatter lists (lengths across
shm's 4 KiB inject size and rxm's 16 KiB eager buffer, counts that are no
multiple of four) written plainly, with one notification, and with an
immediate on every piece; every byte checked, every count exact. Which
writes group is checked on the cursors themselves: on shm none do (a
grouped shm write goes through the target's queue; see ``Rail.group``).
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from conftest import engine_pair as pair
from conftest import wait_until
from p2pxfer.fabric import WriteBatch
from p2pxfer.fabric._batch import GROUP_SHIFT, context_of, group_of, split_context
from p2pxfer.fabric._binding import ffi
from p2pxfer.scatter import ScatterList
from p2pxfer.testing import scatter_at_random

PROVIDERS = ["tcp;ofi_rxm", "shm"]
REGION = 32 << 20
STEP = 30.0


def _scatter(rng: np.random.Generator, n: int) -> ScatterList:
    lengths = rng.choice([1, 8, 4095, 4096, 4097, 16383, 16384, 16385, 65536], n)
    return ScatterList(*scatter_at_random(rng, lengths.astype(np.int64), REGION))


def _placed(src: np.ndarray, dst: np.ndarray, sl: ScatterList) -> bool:
    return all(np.array_equal(src[s:s + n], dst[d:d + n]) for s, d, n in zip(
        sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(), strict=True))


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_grouped_writes_land_every_byte_and_count_every_piece(provider: str) -> None:
    rng = np.random.default_rng(26)
    src = rng.integers(0, 256, REGION, dtype=np.uint8)
    async with pair(provider) as (a, b):
        a.register(src)
        assert a.shards[0]._group.rails[0].group == (1 if provider == "shm" else 4)
        for k, n in enumerate((1, 3, 5, 401, 1023)):
            for mode in ("plain", "notify", "imm"):
                dst = np.zeros(REGION, np.uint8)
                desc = b.export(dst, f"r{k}{mode}")
                sl = _scatter(rng, n)
                with trio.fail_after(STEP):
                    if mode == "plain":
                        assert await a.write(src, desc, sl) == n
                        await wait_until(lambda d=dst, s=sl: _placed(src, d, s), STEP,
                                         f"{n} plain pieces to land")
                    elif mode == "notify":
                        assert await a.write(src, desc, sl, imm=100 + k, notify=True) == 1
                        await b.wait_imm(100 + k, 1)
                        assert _placed(src, dst, sl)  # a notified write has landed
                    else:
                        assert await a.write(src, desc, sl, imm=200 + k) == n
                        await b.wait_imm(200 + k, n)  # one arrival per piece, as ever
                        assert _placed(src, dst, sl)
                b.unexport(f"r{k}{mode}")
        st = a.statistics()
        assert st.failed == 0 and [x.inflight for x in st.nics] == [0] * len(st.nics)
        assert sum(x.errors for x in st.nics) == 0


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_which_writes_group(provider: str) -> None:
    """A cursor without an immediate groups on tcp (a notified write's
    delivery-complete tail stays single, in C), none does on shm;
    ``write_group=1`` turns it off; a rail whose every write is
    delivery-complete never groups."""
    async with pair(provider) as (a, _):
        rail = a.shards[0]._group.rails[0]
        arrays = tuple(np.zeros(8, np.int64) for _ in range(3))
        batch = WriteBatch(*arrays, context=7, imm=None, capacity=2)  # type: ignore[misc]
        plain = batch.add(0, rail, 0, 0, 8, 0, ffi.NULL, 0, 0)
        notified = batch.add(0, rail, 0, 0, 8, 0, ffi.NULL, 0, 0, dc_from=7)
        want = 1 if provider == "shm" else 4
        assert batch._c[plain].group == batch._c[notified].group == want
    async with pair(provider, write_group=1) as (a, _):
        assert a.shards[0]._group.rails[0].group == 1
    async with pair(provider, delivery_complete=True) as (a, _):
        assert a.shards[0]._group.rails[0].group == 1


def test_a_grouped_write_context_says_its_pieces() -> None:
    ctx = context_of(123456, 5)
    for pieces in (1, 2, 3, 4):
        raw = ctx | ((pieces - 1) << GROUP_SHIFT)
        assert group_of(raw) == (ctx, pieces)
        assert split_context(raw) == (123456, 5)
