"""What a receiving daemon remembers of requests their sender abandoned
(``KV.abandon``) before anyone waited for them or pushed them: kept for
the first wait, which hears it, and forgotten after ``ABANDONED_KEEP_S``
otherwise, so a word that came late (the receiver had already forgotten
the request) cannot fail a later request of that number; and an abandon
that overtook notifications its sender saw land (its ``landed``) does not
end a request they complete. In-process, on trio's autojump clock: nothing
here moves bytes (``test_kv_daemon.py`` abandons through two daemons)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pxfer.daemon._imms import ImmTable
from p2pxfer.daemon._kv import ABANDONED_KEEP_S, KV, Pool, pack_i64
from p2pxfer.errors import InvalidArgument, TransferAborted
from p2pxfer.kv_plan import KVLayout, layer_imm


class _Exports:
    def __init__(self) -> None:
        self.on_remove: list[Any] = []


class _Routes:
    """What ``ImmTable`` asks of the engine: its immediates' width."""

    imm_bits = 64

    def route_imms(self, *_: Any) -> None:
        """Nothing to route: arrivals come through ``ImmTable.deliver`` here,
        not from a CQ."""


def receiver(imms: ImmTable | None = None) -> tuple[KV, object]:
    """A KV with one receiving pool ``kv``, owned by the returned session."""
    kv = KV("node-b", _Exports(), imm_slots=lambda: imms)  # type: ignore[arg-type,return-value]
    owner = object()
    lay = KVLayout(4, 8, 4096)
    kv.pools["kv"] = Pool("kv", owner, 1, lay, memoryview(bytearray(lay.nbytes)),  # type: ignore[arg-type]
                          receive=True)
    return kv, owner


async def test_an_abandon_is_kept_for_the_first_wait_then_forgotten(
        autojump_clock: trio.testing.MockClock) -> None:
    kv, owner = receiver()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kv.reap)
        # Heard by the first wait within the time it is kept; then gone.
        assert kv.abandon("node-a", "kv", 6, "aborted") == {"ended": True}
        await trio.sleep(ABANDONED_KEEP_S / 2)
        with pytest.raises(TransferAborted, match="node-a gave it up: aborted"):
            await kv.wait(owner, "kv", 6, 0, 3, 1.0)  # type: ignore[arg-type]
        assert await kv.wait(owner, "kv", 6, 0, 3, 1.0) == {  # type: ignore[arg-type]
            "done": 0, "expired": True}
        # Heard by nobody: forgotten after the time it is kept, so request 5
        # is a request like any other again.
        assert kv.abandon("node-a", "kv", 5, "late") == {"ended": True}
        await trio.sleep(ABANDONED_KEEP_S + 1)
        assert await kv.wait(owner, "kv", 5, 0, 3, 1.0) == {  # type: ignore[arg-type]
            "done": 0, "expired": True}
        # A wait under way hears it at once, whenever it comes.
        async with trio.open_nursery() as waits:
            async def wait_7() -> None:
                with pytest.raises(TransferAborted, match="gone"):
                    await kv.wait(owner, "kv", 7, 0, 3, 3 * ABANDONED_KEEP_S)  # type: ignore[arg-type]
            waits.start_soon(wait_7)
            await trio.sleep(2 * ABANDONED_KEEP_S)
            assert kv.abandon("node-a", "kv", 7, "gone") == {"ended": True}
        nursery.cancel_scope.cancel()


async def test_an_abandon_that_overtook_landed_notifications_ends_nothing_they_complete(
        autojump_clock: trio.testing.MockClock) -> None:
    imms = ImmTable(_Routes())  # type: ignore[arg-type]
    kv, owner = receiver(imms)

    def push(request: int, layers: list[int]) -> int:
        slot = kv.begin("node-a", "kv", request, pack_i64(layers), 60_000)["slot"]
        kv.expect("node-a", slot, pack_i64([1] * len(layers)))
        return imms.compose(slot, 0)

    def land(base: int, *layers: int) -> None:
        for layer in layers:
            imms.deliver(layer_imm(base, layer), 1)

    every = pack_i64([x for layer in range(4) for x in (layer, 1)])
    # All four layers landed at the sender; two are counted here so far.
    base = push(1, [0, 1, 2, 3])
    land(base, 0, 1)
    assert kv.abandon("node-a", "kv", 1, "late", every) == {"ended": False}
    land(base, 2, 3)
    assert await kv.wait(owner, "kv", 1, 0, 3, 1.0) == {"done": 4}  # type: ignore[arg-type]
    # Without the sender's word the same overtaking ends it (as before).
    base = push(2, [0, 1, 2, 3])
    land(base, 0, 1)
    assert kv.abandon("node-a", "kv", 2, "late") == {"ended": True}
    land(base, 2, 3)
    with pytest.raises(TransferAborted, match="late"):
        await kv.wait(owner, "kv", 2, 0, 3, 1.0)  # type: ignore[arg-type]
    # What landed does not complete the request: it ends.
    base = push(3, [0, 1, 2, 3])
    land(base, 0)
    assert kv.abandon("node-a", "kv", 3, "gave up", pack_i64([0, 1, 1, 1])) == {"ended": True}
    with pytest.raises(TransferAborted, match="gave up"):
        await kv.wait(owner, "kv", 3, 0, 1, 1.0)  # type: ignore[arg-type]
    # A hostile landed is refused by name, and ends nothing.
    push(4, [0, 1])
    for bad, why in ((b"\x00" * 7, "whole number of int64"), (pack_i64([0]), "pairs"),
                     (pack_i64([4, 1]), "within 0..3"), (pack_i64([0, 0]), "counts > 0"),
                     (pack_i64([-1, 1]), "within 0..3")):
        with pytest.raises(InvalidArgument, match=why):
            kv.abandon("node-a", "kv", 4, "bad", bad)
    assert kv.arrived("node-a", "kv", 4, 0) == {"arrived": 0, "expected": 1}


async def test_kv_begin_says_whether_a_request_number_starts_afresh(
        autojump_clock: trio.testing.MockClock) -> None:
    """``kv_begin``'s ``first``: no layer of the request was pushed before.
    A sender starts its record of landed layers (``kv_abandoned``'s
    ``landed``) afresh on it, so a number used again after its receiver
    forgot it cannot carry the old request's layers into an abandon."""
    imms = ImmTable(_Routes())  # type: ignore[arg-type]
    kv, owner = receiver(imms)
    assert kv.begin("node-a", "kv", 3, pack_i64([0, 1]), 60_000)["first"] is True
    assert kv.begin("node-a", "kv", 3, pack_i64([2]), 60_000)["first"] is False
    await kv.forget(owner, "kv", 3)  # type: ignore[arg-type]
    assert kv.begin("node-a", "kv", 3, pack_i64([0]), 60_000)["first"] is True


async def test_kv_begin_takes_the_layers_counts_so_no_kv_expect_follows(
        autojump_clock: trio.testing.MockClock) -> None:
    """``kv_begin`` with ``pieces`` (a daemon pushing through its engine
    knows each layer brings one notification before it posts): the answer
    says they were taken, layers complete as their notifications land with
    no ``kv_expect``, a ``kv_expect`` for them is refused, and the slot goes
    back once all landed. Bad counts are refused by name and claim
    nothing."""
    imms = ImmTable(_Routes())  # type: ignore[arg-type]
    kv, owner = receiver(imms)
    begun = kv.begin("node-a", "kv", 1, pack_i64([2, 0, 3]), 60_000, pack_i64([1, 1, 1]))
    assert begun["expected"] is True and begun["first"] is True
    slot = begun["slot"]
    base = imms.compose(slot, 0)
    imms.deliver(layer_imm(base, 2), 1)
    # done: the first layer from 2 not complete (3 has not landed)
    assert await kv.wait(owner, "kv", 1, 2, 2, 1.0) == {"done": 3}  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="sent already"):
        kv.expect("node-a", slot, pack_i64([1]), 0)
    imms.deliver(layer_imm(base, 0), 1)
    imms.deliver(layer_imm(base, 3), 1)
    assert await kv.wait(owner, "kv", 1, 2, 3, 1.0) == {"done": 4}  # type: ignore[arg-type]
    assert await kv.wait(owner, "kv", 1, 0, 0, 1.0) == {"done": 1}  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not a request"):  # the slot went back
        kv.expect("node-a", slot, pack_i64([1]), 0)
    # Without counts the answer is as it was: kv_expect follows.
    assert "expected" not in kv.begin("node-a", "kv", 2, pack_i64([0]), 60_000)
    for bad, why in ((pack_i64([1]), "a piece count > 0 for each of the push's 2"),
                     (pack_i64([1, 0]), "a piece count > 0"),
                     (b"\x01" * 9, "whole number of int64")):
        with pytest.raises(InvalidArgument, match=why):
            kv.begin("node-a", "kv", 3, pack_i64([0, 1]), 60_000, bad)
    assert kv.begin("node-a", "kv", 3, pack_i64([0, 1]), 60_000)["first"] is True
