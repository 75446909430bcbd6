"""What a receiving daemon remembers of requests their sender abandoned
(``KV.abandon``) before anyone waited for them or pushed them: kept for
the first wait, which hears it, and forgotten after ``ABANDONED_KEEP_S``
otherwise, so a word that came late (the receiver had already forgotten
the request) cannot fail a later request of that number. In-process, on
trio's autojump clock: nothing here moves bytes (``test_kv_daemon.py``
abandons through two daemons)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pxfer.daemon._kv import ABANDONED_KEEP_S, KV, Pool
from p2pxfer.errors import TransferAborted
from p2pxfer.kv_plan import KVLayout


class _Exports:
    def __init__(self) -> None:
        self.on_remove: list[Any] = []


def receiver() -> tuple[KV, object]:
    """A KV with one receiving pool ``kv``, owned by the returned session."""
    kv = KV("node-b", _Exports(), imm_slots=lambda: None)  # type: ignore[arg-type,return-value]
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
