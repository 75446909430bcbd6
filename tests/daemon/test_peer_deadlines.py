"""Control requests made for a write are bounded by that write's deadline,
not by a fixed timeout (a write with 15 s of its 20 s left failed after
exactly ``PEER_TIMEOUT_S`` when its peer's control connection was slow);
requests made for nobody in particular keep ``PEER_TIMEOUT_S``.

The peer is a real TCP listener on loopback that accepts and never answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from p2pxfer.daemon import _peers
from p2pxfer.daemon._peers import PeerTable
from p2pxfer.errors import RemoteClosed
from p2pxfer.testing import LOOPBACK


@asynccontextmanager
async def silent_peer() -> AsyncIterator[PeerTable]:
    """A peer table that knows one peer, ``slow``: a listener that accepts
    and then says nothing."""
    async def hold(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, hold, 0, host=LOOPBACK))
        port = listeners[0].socket.getsockname()[1]
        table = PeerTable("me", (), auth=None, max_frame=1 << 20)
        table.add("slow", f"{LOOPBACK}:{port}")
        yield table
        nursery.cancel_scope.cancel()


async def test_a_request_for_a_write_has_the_writes_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peers, "PEER_TIMEOUT_S", 0.3)
    async with silent_peer() as table:
        with trio.fail_after(30):
            t0 = trio.current_time()
            with pytest.raises(RemoteClosed, match="slow"):
                await table.request("slow", "resolve", region="kv")
            plain = trio.current_time() - t0
            t0 = trio.current_time()
            with pytest.raises(RemoteClosed, match="slow"):
                await table.request("slow", "resolve", region="kv", until=t0 + 8.0)
            for_write = trio.current_time() - t0
    # Lower bounds decide (late timers on a busy host only add); the plain
    # one's upper bound leaves a starved test seconds, and still fails one
    # that waited any longer fixed timeout (the real PEER_TIMEOUT_S: 5 s).
    assert 0.25 <= plain < 3, plain
    assert for_write >= 7.95, for_write


async def test_a_write_waiting_its_turn_on_a_busy_link_keeps_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Another request holds the link (the peer says nothing): a request made
    # for a write with little time left fails when that time is up, not
    # after the other's.
    monkeypatch.setattr(_peers, "PEER_TIMEOUT_S", 5.0)
    async with silent_peer() as table:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                async def hog() -> None:
                    with pytest.raises(RemoteClosed):
                        await table.request("slow", "resolve", region="a")

                nursery.start_soon(hog)
                await trio.sleep(0.1)
                t0 = trio.current_time()
                with pytest.raises(RemoteClosed, match="no turn"):
                    await table.request("slow", "resolve", region="b", until=t0 + 0.5)
                took = trio.current_time() - t0
                nursery.cancel_scope.cancel()
    assert 0.45 <= took < 4.5, took  # not after the other's 5 s


def test_a_degraded_member_is_rerouted_not_forgotten() -> None:
    """Membership says one of a member's rails stopped answering: our link
    to its control port moves to a rail that answers (ticket refills and
    the settling of a notification whose rail failed go on), and back when
    it is alive again; nothing we know of it (descriptors, tickets it holds
    for us) is forgotten, as it is when a member really moves."""
    from p2pxfer.daemon._follow import Follower
    from p2pxfer.membership import Member, MemberAlive, MemberDegraded

    table = PeerTable("me", (), auth=None, max_frame=1 << 20)
    forgotten: list[str] = []
    table.on_forget = forgotten.append
    rails = ("10.9.1.2:7700", "10.9.2.2:7700")
    table.up("h2", rails[0], rails)
    forgotten.clear()
    follower = Follower.__new__(Follower)  # only its event routing, no backend
    follower.node, follower.peers = "me", table
    follower.log = type("Log", (), {"record": lambda self, ev: None})()
    m = Member("h2", rails[0], 7, addresses=rails, unreachable=rails[:1])
    follower.on_event(MemberDegraded(m))
    assert table.peers["h2"].address == rails[1]
    follower.on_event(MemberAlive(Member("h2", rails[0], 7, addresses=rails)))
    assert table.peers["h2"].address == rails[0]
    assert forgotten == []
    table.up("h2", "10.9.3.2:7700", ("10.9.3.2:7700",))  # it moved: what we knew is void
    assert forgotten == ["h2"]
