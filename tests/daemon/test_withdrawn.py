"""Regions withdrawn with a reason (``unexport(name, reason=...)``, or
``withdraw`` of a name never exported): a writer that comes later hears
``RegionWithdrawn`` and why, instead of ``UnknownRegion``, through the
peer and on the owner's own node, from trio, asyncio and blocking callers;
a new export of the name ends it, and a plain unexport leaves nothing.
Two real daemons (tcp;ofi_rxm on loopback); the tombstones' time and cap
in-process, on trio's autojump clock. Only uids the region admitted hear
the reason: ``test_isolation.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import trio

import p2pxfer
from daemon_helpers import DaemonProc, daemon_pair
from p2pxfer.daemon import _exports
from p2pxfer.daemon._exports import WITHDRAWN_KEEP_S, Exports
from p2pxfer.errors import Forbidden, InvalidArgument, NameTaken, RegionWithdrawn, UnknownRegion
from p2pxfer.protocol import MAX_REASON
from p2pxfer.scatter import ScatterList

ONE = ScatterList.contiguous(4096)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    with daemon_pair(tmp_path_factory.mktemp("withdrawn")) as daemons:
        yield daemons


def plainly_unknown(exc: BaseException) -> bool:
    return isinstance(exc, UnknownRegion) and not isinstance(exc, RegionWithdrawn)


async def test_a_late_writer_hears_why_a_region_was_withdrawn(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    async with p2pxfer.connect(a.socket) as writer, p2pxfer.connect(b.socket) as owner:
        dst, src, own = await owner.alloc(1 << 16), await writer.alloc(4096), \
            await owner.alloc(4096)
        for name in ("gone", "plain"):
            await owner.export(name, dst)
        await owner.unexport("gone", reason="prefill request 'r1' was aborted")
        await owner.unexport("plain")
        # Through the peer (never resolved there before), and on its own node.
        with pytest.raises(RegionWithdrawn, match="'gone' on node-b was withdrawn by its "
                                                  "owner: prefill request 'r1' was aborted"):
            await writer.write("node-b", "gone", ONE, src=src)
        with pytest.raises(RegionWithdrawn, match="'r1' was aborted"):
            await owner.write("node-b", "gone", ONE, src=own)
        with pytest.raises(UnknownRegion) as plain:
            await writer.write("node-b", "plain", ONE, src=src)
        assert plainly_unknown(plain.value), plain.value

        # A new export of the name ends the tombstone; a plain unexport after
        # it leaves none.
        await owner.export("gone", dst)
        assert await writer.write("node-b", "gone", ONE, src=src) == 1
        await owner.unexport("gone")
        with pytest.raises(UnknownRegion) as again:
            await owner.write("node-b", "gone", ONE, src=own)
        assert plainly_unknown(again.value), again.value

        # A reason too long is refused by the client, and by the daemon
        # (asked directly): the region stays exported.
        await owner.export("long", dst)
        with pytest.raises(InvalidArgument, match=f"at most {MAX_REASON}"):
            await owner.unexport("long", reason="x" * (MAX_REASON + 1))
        with pytest.raises(InvalidArgument, match=f"at most {MAX_REASON}"):
            await owner._conv.request("unexport", name="long", reason="x" * (MAX_REASON + 1))
        assert await writer.write("node-b", "long", ONE, src=src) == 1
        await owner.unexport("long", reason="x" * MAX_REASON)
        with pytest.raises(RegionWithdrawn, match="withdrawn by its owner: xxx"):
            await owner.write("node-b", "long", ONE, src=own)


async def test_a_name_never_exported_can_be_withdrawn(pair: tuple[DaemonProc, DaemonProc]
                                                      ) -> None:
    """``withdraw``: a name this client may export, not exported now."""
    a, b = pair
    async with p2pxfer.connect(a.socket) as writer, p2pxfer.connect(b.socket) as owner:
        src, dst = await writer.alloc(4096), await owner.alloc(1 << 16)
        await owner.withdraw("never", "its request was aborted while it waited")
        with pytest.raises(RegionWithdrawn, match="aborted while it waited"):
            await writer.write("node-b", "never", ONE, src=src)
        # Exported after all: written as usual.
        await owner.export("never", dst)
        assert await writer.write("node-b", "never", ONE, src=src) == 1
        with pytest.raises(NameTaken):
            await owner.withdraw("never", "it is exported")
        with pytest.raises(Forbidden):
            await owner.withdraw("~4242/theirs", "not this uid's name")
        with pytest.raises(InvalidArgument, match=f"at most {MAX_REASON}"):
            await owner.withdraw("long", "x" * (MAX_REASON + 1))


def test_withdrawn_from_blocking_and_asyncio_callers(pair: tuple[DaemonProc, DaemonProc]
                                                     ) -> None:
    """A ``SyncClient`` withdraws; an asyncio caller and a blocking one hear why."""
    a, b = pair

    async def late_write() -> str:
        assert asyncio.get_running_loop() is not None
        async with p2pxfer.connect(a.socket) as c:
            try:
                await c.write("node-b", "sync-gone", ONE, src=await c.alloc(4096))
            except RegionWithdrawn as exc:
                return str(exc)
            return "written"

    with p2pxfer.SyncClient(b.socket) as owner, p2pxfer.SyncClient(a.socket) as writer:
        owner.export("sync-gone", owner.alloc(1 << 16))
        owner.unexport("sync-gone", reason="its lease passed")
        assert "withdrawn by its owner: its lease passed" in asyncio.run(late_write())
        with pytest.raises(RegionWithdrawn, match="its lease passed"):
            writer.write("node-b", "sync-gone", ONE, src=writer.alloc(4096))
        owner.withdraw("sync-never", "never scheduled")
        with pytest.raises(RegionWithdrawn, match="never scheduled"):
            writer.write("node-b", "sync-never", ONE, src=writer.alloc(4096))


def test_one_uid_cannot_flush_the_others_tombstones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its own cap, a uid's oldest goes, not another uid's."""
    monkeypatch.setattr(_exports, "MAX_WITHDRAWN_PER_UID", 2)

    async def main() -> None:
        ex = Exports("n", engine=None, imm_slots=lambda: None)  # type: ignore[arg-type,return-value]
        ex.withdraw("root's", "why", 0, frozenset())
        for i in range(50):
            ex.withdraw(f"~1000/{i}", "flood", 1000, frozenset())
        assert isinstance(ex.absent("root's"), RegionWithdrawn)
        assert [isinstance(ex.absent(f"~1000/{i}"), RegionWithdrawn) for i in (47, 48, 49)] == [
            False, True, True]
        # A name withdrawn again, or exported, is counted once.
        ex.withdraw("~1000/49", "again", 1000, frozenset())
        ex.withdraw("~1000/50", "new", 1000, frozenset())
        assert isinstance(ex.absent("~1000/49"), RegionWithdrawn)
        assert plainly_unknown(ex.absent("~1000/48"))

    trio.run(main)


async def test_tombstones_last_their_time_and_the_oldest_go_first(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_exports, "MAX_WITHDRAWN", 3)
    ex = Exports("n", engine=None, imm_slots=lambda: None)  # type: ignore[arg-type,return-value]
    for name in ("a", "b", "c"):
        ex.withdraw(name, f"why {name}", 1000, frozenset({1001}))
    # The uid rule: the owner, a uid it granted, a privileged one; not another.
    assert isinstance(ex.absent("a"), RegionWithdrawn)  # a peer asks
    assert "why a" in str(ex.absent("a", 1000))
    assert isinstance(ex.absent("a", 1001), RegionWithdrawn)
    assert isinstance(ex.absent("a", 0, privileged=True), RegionWithdrawn)
    assert plainly_unknown(ex.absent("a", 1002))
    # Past the cap, the oldest goes; withdrawing a name again makes it the newest.
    ex.withdraw("a", "why a again", 1000, frozenset())
    ex.withdraw("d", "why d", 1000, frozenset())
    assert plainly_unknown(ex.absent("b"))
    assert [str(ex.absent(n)).rsplit(": ", 1)[1] for n in ("c", "a", "d")] == [
        "why c", "why a again", "why d"]
    # Each lasts its time, then is forgotten.
    await trio.sleep(WITHDRAWN_KEEP_S / 2)
    ex.withdraw("e", "why e", 1000, frozenset())  # past the cap: c goes
    assert plainly_unknown(ex.absent("c"))
    assert isinstance(ex.absent("a"), RegionWithdrawn)
    await trio.sleep(WITHDRAWN_KEEP_S / 2 + 1)
    assert plainly_unknown(ex.absent("a")) and plainly_unknown(ex.absent("d"))
    assert isinstance(ex.absent("e"), RegionWithdrawn)
    await trio.sleep(WITHDRAWN_KEEP_S / 2)
    assert plainly_unknown(ex.absent("e"))
