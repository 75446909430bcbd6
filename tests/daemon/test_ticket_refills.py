"""When a notify write's notification tickets come (``Regions``,
``daemon/_regions.py``): a write that finds none in hand waits for the
refill; a refill that failed is not asked again for ``TICKET_WAIT_S``
(writes meanwhile go without), except once the control link to the peer
goes another way (``rerouted``: a rail healed), when the next write asks
at once and waits for it. In-process on trio's autojump clock, with a
stand-in for the peer link below the fabric: nothing here moves bytes
(``test_notify_settle.py`` and the rail-cut scenario in
``tests/membership/test_membership_rails.py`` run the real thing)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from p2pxfer.daemon import _peers
from p2pxfer.daemon._imms import ImmTable
from p2pxfer.daemon._peers import PeerTable
from p2pxfer.daemon._regions import TICKET_BATCH, Regions
from p2pxfer.errors import PeerUnreachable
from p2pxfer.memory import RailDescriptor, RegionDescriptor
from p2pxfer.testing import LOOPBACK

DESC = RegionDescriptor("r", 4096, (RailDescriptor("tcp;ofi_rxm", b"\x02" * 16, 7, 0),),
                        "node-b", 1)


class _Link:
    """The peer's answers to ``imm_tickets``: unreachable while ``cut``."""

    def __init__(self, slot: int, tag_bits: int) -> None:
        self.cut = True
        self.delay = 0.1  # seconds each answer takes
        self.asked = 0
        self._next = 1
        self._slot, self._tag_bits = slot, tag_bits

    async def request(self, peer: str, kind: str, **fields: Any) -> dict[str, Any]:
        assert kind == "imm_tickets"
        self.asked += 1
        await trio.sleep(self.delay)
        if self.cut:
            raise PeerUnreachable(f"peer {peer}: TooSlowError")
        tickets = [self._slot | (self._next + i) for i in range(fields["n"])]
        self._next += fields["n"]
        return {"tickets": tickets}


def _spent() -> tuple[ImmTable, int, _Link, Regions]:
    """A region on node-b whose batch of tickets is spent, behind ``_Link``."""
    table = ImmTable(SimpleNamespace(imm_bits=64, route_imms=lambda *a: None))  # type: ignore[arg-type]
    assert table.tag_bits > 0
    slot = 5 << table.tag_bits
    link = _Link(slot, table.tag_bits)
    regions = Regions("node-a", link, SimpleNamespace(on_remove=[], settle_remove=[]),  # type: ignore[arg-type]
                      lambda: table)
    regions._slots["node-b", "r"] = slot
    regions._tickets["node-b", "r"] = (slot, [])
    return table, slot, link, regions


async def test_a_refill_that_failed_is_asked_again_at_once_after_a_reroute(
        autojump_clock: trio.testing.MockClock) -> None:
    table, slot, link, regions = _spent()
    async with trio.open_nursery() as nursery:
        regions.nursery = nursery
        until = trio.current_time() + 60
        # The control link is cut: the write waits for the refill, which fails.
        assert await regions.ticket_for_write("node-b", "r", until) is None
        assert link.asked == 1
        # Right after: not asked again, the write goes without at once.
        t0 = trio.current_time()
        assert await regions.ticket_for_write("node-b", "r", until) is None
        assert link.asked == 1 and trio.current_time() == t0
        # The link heals and goes another way: the next write asks at once
        # and waits for the answer.
        link.cut = False
        regions.rerouted("node-b")
        ticket = await regions.ticket_for_write("node-b", "r", until)
        assert ticket is not None and ticket >> table.tag_bits == slot >> table.tag_bits
        assert link.asked == 2
        nursery.cancel_scope.cancel()


async def test_a_slow_refill_is_waited_for_within_the_writes_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    """A refill that takes longer than ``TICKET_WAIT_S`` (a busy host:
    the peer's daemon answers late) is waited for while the write has time:
    the write gets a ticket, not None (its notification could not be
    settled). Giving up on it after a fixed 2 s made 150 notify writes at
    once beside two busy loops end ``NotificationUnknown``."""
    _, slot, link, regions = _spent()
    link.cut, link.delay = False, 4.0
    async with trio.open_nursery() as nursery:
        regions.nursery = nursery
        t0 = trio.current_time()
        ticket = await regions.ticket_for_write("node-b", "r", t0 + 60)
        assert ticket is not None and trio.current_time() - t0 == pytest.approx(4.0)
        # Within a shorter deadline, the write goes without when it ends.
        regions._tickets["node-b", "r"] = (slot, [])
        assert await regions.ticket_for_write("node-b", "r", trio.current_time() + 1) is None
        nursery.cancel_scope.cancel()


async def test_a_refill_behind_a_held_link_gives_up_within_peer_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another request holds the link until its write's deadline (a settle
    on a silent peer): the refill waits for its turn at most PEER_TIMEOUT_S,
    so writes after it ask again rather than wait on it until that deadline.
    The peer here is a real listener on loopback that accepts and never
    answers, behind a real ``PeerTable``."""
    monkeypatch.setattr(_peers, "PEER_TIMEOUT_S", 0.3)
    table = ImmTable(SimpleNamespace(imm_bits=64, route_imms=lambda *a: None))  # type: ignore[arg-type]
    slot = 5 << table.tag_bits
    key = ("slow", "r")

    async def hold(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, hold, 0, host=LOOPBACK))
            peers = PeerTable("me", (), auth=None, max_frame=1 << 20)
            peers.add("slow", f"{LOOPBACK}:{listeners[0].socket.getsockname()[1]}")
            regions = Regions("me", peers, SimpleNamespace(on_remove=[], settle_remove=[]),  # type: ignore[arg-type]
                              lambda: table)
            regions.nursery = nursery
            regions._slots[key] = slot
            regions._tickets[key] = (slot, [])  # the batch spent

            async def settle() -> None:  # holds the link for 20 s
                with pytest.raises(PeerUnreachable):
                    await peers.request("slow", "notify_settle", ticket=1, imm=1,
                                        until=trio.current_time() + 20)

            nursery.start_soon(settle)
            await trio.sleep(0.05)
            t0 = trio.current_time()
            assert await regions.ticket_for_write("slow", "r", t0 + 60) is None
            # The refill gave up: nothing is left waiting for the link's turn.
            assert key not in regions._refilling
            assert trio.current_time() - t0 < 5
            nursery.cancel_scope.cancel()


async def test_a_burst_of_writes_to_a_region_not_resolved_yet_resolves_it_once(
        autojump_clock: trio.testing.MockClock) -> None:
    """150 writes at once to a region not resolved yet: one ``resolve`` goes
    to the peer, the others wait for its answer, and its batch of tickets
    is the one in hand. Each write used to send its own, each batch
    replacing the last (tickets the peer counted as ours, lost here): past
    the peer's cap its answers brought none, the region was marked as one
    that gives none, and writes went without (a busy fresh-clone run: one
    ended ``NotificationUnknown``)."""
    table = ImmTable(SimpleNamespace(imm_bits=64, route_imms=lambda *a: None))  # type: ignore[arg-type]
    slot = 5 << table.tag_bits
    asked: list[int] = []
    issued = iter(range(1, 1 << 20))

    class Peer:
        async def request(self, peer: str, kind: str, **fields: Any) -> dict[str, Any]:
            assert kind == "resolve"
            asked.append(fields["tickets"])
            await trio.sleep(0.5)  # a busy peer
            return {"descriptor": DESC.to_wire(), "slot": slot,
                    "tickets": [slot | next(issued) for _ in range(fields["tickets"])]}

    regions = Regions("node-a", Peer(), SimpleNamespace(on_remove=[], settle_remove=[]),  # type: ignore[arg-type]
                      lambda: table)
    got = []

    async def write() -> None:
        got.append(await regions.resolve("node-b", "r", until=trio.current_time() + 60))

    async with trio.open_nursery() as nursery:
        regions.nursery = nursery
        for _ in range(150):
            nursery.start_soon(write)
    assert asked == [TICKET_BATCH]
    assert len(got) == 150 and all(d == DESC for d in got)
    assert len(regions._tickets["node-b", "r"][1]) == TICKET_BATCH
    assert ("node-b", "r") not in regions._barren
