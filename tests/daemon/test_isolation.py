"""Issue 24: isolation against a hostile local user and a hostile key holder.

Real daemons in their own processes (tcp on loopback); a second local uid is
a forked child under ``nobody`` (``as_uid``), as in ``test_security_local``.
Each test failed before the fix it names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from p2pxfer._waiters import Tally
from p2pxfer.errors import LimitExceeded
from p2pxfer.protocol import encode_frame
from p2pxfer.testing import DaemonProc, RawConn, start_daemon


@pytest.fixture
def daemons() -> Iterator[list[DaemonProc]]:
    started: list[DaemonProc] = []
    yield started
    for d in started:
        d.stop()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (scheduling delays on a
    busy machine do not count)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- finding 2: waiters withdrawn and served in O(1), and bounded per client ---------------

async def test_waiters_withdraw_in_linear_time() -> None:
    """Cancelling every one of many waiters on one key: linear in them (a
    list withdrew each with ``list.remove``: quadratic)."""

    async def cancel_all(n: int) -> float:
        tally = Tally[int]()
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(tally.wait, 7, 1)
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.process_time()
            nursery.cancel_scope.cancel()
        took = time.process_time() - t0
        assert tally.waiting == 0 and not tally.awaited(7)
        return took

    small, large = await cancel_all(2_000), await cancel_all(40_000)
    # 20 times the waiters: linear is about 20 times the work, quadratic 400.
    assert large < 80 * max(small, 0.005), (small, large)


async def test_a_waiter_served_as_it_is_cancelled_gives_back() -> None:
    tally = Tally[str](limit=2, what="waits")
    got: list[str] = []

    async def wait(name: str, want: int) -> None:
        await tally.wait("k", want)
        got.append(name)

    async with trio.open_nursery() as nursery:
        first = trio.CancelScope()

        async def first_waiter() -> None:
            with first:
                await wait("first", 3)

        nursery.start_soon(first_waiter)
        nursery.start_soon(wait, "second", 3)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(LimitExceeded, match="limit 2"):
            await tally.wait("k", 1)
        tally.add("k", 3)  # serves the first...
        first.cancel()  # ...which is cancelled before it runs: the 3 go to the second
        await trio.testing.wait_all_tasks_blocked()
    assert got == ["second"] and tally.count("k") == 0 and tally.waiting == 0


def _leave_waiters(d: DaemonProc, n: int) -> float:
    """A client leaves ``n`` ``wait_imm`` calls waiting on one value and hangs
    up; a new client says hello and waits until the daemon has let the old one
    go. The daemon's CPU seconds from the hang-up to then."""
    with RawConn(d.socket, timeout=120) as c:
        c.hello()
        c.send_raw(b"".join(encode_frame({"t": "wait_imm", "id": 2 + i, "imm": 7, "count": 1})
                            for i in range(n)))
        assert c.request({"t": "status", "id": 1})["t"] == "ok"  # every one was read
        cpu0 = _cpu_s(d.proc.pid)
    with RawConn(d.socket, timeout=120) as fresh:
        fresh.hello()
        rid = 1
        while fresh.request({"t": "status", "id": rid})["result"]["clients"] != 1:
            rid += 1
            time.sleep(0.02)
    return _cpu_s(d.proc.pid) - cpu0


def test_cancelled_waiters_of_a_client_that_left_are_cheap(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "waiters", max_waiters_per_client=100_000)
    daemons.append(d)
    small, large = _leave_waiters(d, 4_000), _leave_waiters(d, 40_000)
    # Ten times the waiters: linear is about ten times the daemon's CPU time,
    # quadratic a hundred (list.remove per waiter: 12 s of CPU for 20,000,
    # every client and the control port frozen meanwhile).
    assert large < 25 * max(small, 0.05), (small, large)
    assert d.alive()


def test_waiters_per_client_are_capped(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "capped", max_waiters_per_client=8)
    daemons.append(d)
    for _ in range(2):  # the cap is the client's: a new client has it whole again
        with RawConn(d.socket) as c:
            c.hello()
            for i in range(9):
                c.send({"t": "wait_imm", "id": 10 + i, "imm": 7, "count": 1})
            reply: dict[str, Any] | None = c.frame()  # one of the nine: the others wait
            assert reply is not None and reply["t"] == "error", reply
            assert reply["code"] == "limit" and "limit 8" in reply["message"], reply
    assert d.alive()
