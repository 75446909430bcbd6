"""A notify write's notification is never "unknown" while the control path
to its peer works (issue 22, item 3).

Two daemons in their own processes (tcp on loopback). A notify write's one
notification goes through a *ticket* of the region (``_imms``); when its
outcome is unknown (its rail broke before the ack), the writer's daemon asks
the target's over the control connection (``notify_settle``): if it landed,
nothing more; if not, the target counts it then. The daemons run with
``fault_notify``, which sends every notification ("landed") or none
("lost") and then reports its outcome as unknown, so both answers are
exercised on every write; the owner must count exactly one arrival per
write, and every byte must be there. (A notification that landed may be
read by the target's poller only after the writer asked: it is counted on
asking then, and the late arrival is dropped: still once.) Where the CQ data has no room for
tickets (4-byte immediates) the outcome stays unknown, and says so.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import trio

import p2pxfer
from daemon_helpers import DaemonProc, RawControl, daemon_pair
from p2pxfer.errors import NotificationUnknown, WaitTimeout
from p2pxfer.scatter import ScatterList

TIMEOUT = 60.0
WRITES = 100  # more than a batch of tickets (64): refills come in the background


Pair = tuple[DaemonProc, DaemonProc, str]


@pytest.fixture(scope="module", params=["landed", "lost"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pair]:
    with daemon_pair(tmp_path_factory.mktemp("settle"), fault_notify=request.param,
                     local_copy=False) as (a, b):
        yield a, b, request.param


def scattered(rng: np.random.Generator, n: int, size: int, blocks: int) -> ScatterList:
    """``n`` pieces of ``size`` bytes at random distinct blocks of both sides."""
    src = rng.choice(blocks, n, replace=False).astype(np.int64) * size
    dst = rng.choice(blocks, n, replace=False).astype(np.int64) * size
    return ScatterList(src, dst, np.full(n, size, np.int64))


async def test_unknown_notifications_are_settled_once(pair: Pair) -> None:
    """Every write returns 1 (not NotificationUnknown), its notification
    counts exactly once, and its bytes are there when it does; the writer's
    daemon says which way each was settled."""
    a, b, fault = pair
    rng = np.random.default_rng(22)
    size, blocks = 16 << 10, 64
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(a.socket) as writer, p2pxfer.connect(b.socket) as owner:
            dst = await owner.alloc(blocks * size, "settle-dst")
            await owner.export("settle", dst)
            src = await writer.alloc(blocks * size, "settle-src")
            for i in range(WRITES):
                src.array[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
                sl = scattered(rng, int(rng.integers(1, 24 if i < 12 else 3)), size, blocks)
                assert await writer.write("node-b", "settle", sl, src=src, imm=i,
                                          notify=True) == 1
                await owner.wait_imm(i, 1, region="settle", timeout=20)
                for s, d, n in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(),
                                   strict=True):
                    assert np.array_equal(dst.array[d:d + n], src.array[s:s + n]), (i, d)
            for i in (0, WRITES - 1):  # one count per write, never a second
                with pytest.raises(WaitTimeout):
                    await owner.wait_imm(i, 1, region="settle", timeout=0.3)
    settled = a.status()["notifications"]
    assert settled["landed"] + settled["counted_on_ask"] == WRITES, settled
    assert settled["unknown"] == 0, settled
    if fault == "lost":  # never sent: every one counted on asking
        assert settled["counted_on_ask"] == WRITES, settled
    # "landed": the writer may ask before the target's poller has read the
    # arrival; then it is counted on asking, and the arrival is dropped.


async def test_a_burst_beyond_the_tickets_in_hand_is_settled_too(pair: Pair) -> None:
    """150 notify-mode writes at once, more than the batch of tickets in
    hand (64): those that find none wait for the refill instead of going
    without (a notification without a ticket cannot be settled), so every
    one returns 1 and counts once."""
    a, b, _ = pair
    size, n = 4096, 150
    before = a.status()["notifications"]
    with trio.fail_after(TIMEOUT):
        async with p2pxfer.connect(a.socket) as writer, p2pxfer.connect(b.socket) as owner:
            dst = await owner.alloc(n * size, "burst-dst")
            await owner.export("burst", dst)
            src = await writer.alloc(n * size, "burst-src")
            src.array[:] = np.random.default_rng(23).integers(0, 256, src.nbytes, np.uint8)
            results: list[int] = []

            async def one(i: int) -> None:
                results.append(await writer.write(
                    "node-b", "burst", ScatterList.contiguous(size, i * size, i * size),
                    src=src, imm=i, notify=True))

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            assert results == [1] * n
            for i in range(n):
                await owner.wait_imm(i, 1, region="burst", timeout=20)
            assert np.array_equal(dst.array, src.array)
    after = a.status()["notifications"]
    assert after["unknown"] == before["unknown"], after
    assert (after["landed"] + after["counted_on_ask"]
            - before["landed"] - before["counted_on_ask"]) == n, (before, after)


def test_settle_refuses_what_is_not_the_callers(pair: Pair) -> None:
    """``notify_settle`` for a ticket nobody was given, or given to another
    peer, is ``unknown_region``; a caller outside the peer table gets no
    tickets; ``imm_tickets`` bounds ``n``."""
    b = pair[1]
    with p2pxfer.SyncClient(b.socket) as owner:
        dst = owner.alloc(4096, "settle-raw")
        owner.export("settle-raw", dst)
        raw = RawControl(b.control)
        try:
            raw.hello("node-a")
            reply = raw.request({"t": "resolve", "id": 1, "region": "settle-raw",
                                 "tickets": 64})
            assert reply is not None and reply["t"] == "ok", reply
            tickets = reply["result"]["tickets"]
            slot = reply["result"]["slot"]
            assert len(tickets) == 64 and len(set(tickets)) == 64
            assert all(t >> 32 == slot >> 32 and t != slot for t in tickets)
            reply = raw.request({"t": "imm_tickets", "id": 2, "region": "settle-raw", "n": 65})
            assert reply is not None and reply["code"] == "bad_request", reply
            reply = raw.request({"t": "notify_settle", "id": 3, "ticket": slot ^ 1, "imm": 1})
            assert reply is not None and reply["code"] == "unknown_region", reply
            # An unspent ticket settles as not arrived: counted now, once.
            reply = raw.request({"t": "notify_settle", "id": 4, "ticket": tickets[0],
                                 "imm": 5})
            assert reply is not None and reply["result"] == {"arrived": False}, reply
            owner.wait_imm(5, 1, region="settle-raw", timeout=10)
            reply = raw.request({"t": "notify_settle", "id": 5, "ticket": tickets[0],
                                 "imm": 5})
            assert reply is not None and reply["code"] == "unknown_region", reply
            with pytest.raises(WaitTimeout):
                owner.wait_imm(5, 1, region="settle-raw", timeout=0.3)
        finally:
            raw.close()
        raw = RawControl(b.control)
        try:
            raw.hello("node-z")  # not in b's peer table
            reply = raw.request({"t": "resolve", "id": 1, "region": "settle-raw",
                                 "tickets": 64})
            assert reply is not None and "tickets" not in reply["result"], reply
            reply = raw.request({"t": "notify_settle", "id": 2, "ticket": tickets[1],
                                 "imm": 5})
            assert reply is not None and reply["code"] == "unknown_region", reply
        finally:
            raw.close()


def test_without_tickets_the_outcome_stays_unknown(tmp_path_factory: pytest.TempPathFactory
                                                   ) -> None:
    """4-byte immediates leave no room for a ticket's tag: the writer hears
    ``NotificationUnknown`` (every byte landed), as before."""
    with daemon_pair(tmp_path_factory.mktemp("settle4"), fault_notify="lost", imm_bytes=4,
                     local_copy=False) as (a, b), \
            p2pxfer.SyncClient(b.socket) as owner, p2pxfer.SyncClient(a.socket) as writer:
        dst = owner.alloc(8 * 4096, "settle4-dst")
        owner.export("settle4", dst)
        src = writer.alloc(8 * 4096, "settle4-src")
        src.array[:] = 3
        off = np.arange(8, dtype=np.int64) * 4096
        with pytest.raises(NotificationUnknown, match="outcome is unknown"):
            writer.write("node-b", "settle4", ScatterList(off, off, np.full(8, 4096, np.int64)),
                         src=src, imm=2, notify=True)
        assert (dst.array == 3).all()
