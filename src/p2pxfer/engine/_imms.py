"""Immediates that landed here: counts per value, the tasks waiting for them,
and the handlers that take whole ranges of values (``route_imms``).

Arrivals come from the shards in trio (``deliver``); those nobody waits for
may stay with a shard's poller thread until someone asks (``pull``: the
shards hand over what they hold first). What must not live here: argument
checks (``Engine``'s), anything run by the poller thread but ``wanted``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from p2pxfer.errors import EngineClosed, WaitTimeout

__all__ = ["Immediates"]


class Immediates:
    """What landed here carrying immediates (trio only, but ``wanted``)."""

    def __init__(self, pull: Callable[[], None]) -> None:
        self._pull = pull  # the shards hand over what they hold back
        self._count = Counter[int]()
        self._waiters: dict[int, list[tuple[int, trio.Event]]] = {}
        self._routes: dict[tuple[int, int], Any] = {}
        self._closed = False

    @property
    def awaited(self) -> int:
        """Immediate values some ``wait`` is waiting for now."""
        return len(self._waiters)

    def wanted(self) -> bool:
        """Someone waits for immediates, or routes them (any thread: two
        plain reads)."""
        return bool(self._waiters) or bool(self._routes)

    def count(self, imm: int) -> int:
        self._pull()
        return self._count[imm]

    def route(self, shift: int, tag: int, handler: Any) -> None:
        self._pull()  # what arrived before goes where it went then
        self._routes[(shift, tag)] = handler

    async def wait(self, imm: int, count: int, timeout: float | None, limit: float) -> None:
        """See ``Engine.wait_imm`` (arguments checked there; ``limit``:
        seconds from now, ``math.inf`` for none)."""
        self._pull()
        if self._count[imm] >= count and not self._waiters.get(imm):
            self._take(imm, count)
            await trio.lowlevel.checkpoint()
            return
        ev = trio.Event()
        entry = (count, ev)
        self._waiters.setdefault(imm, []).append(entry)
        # Arrivals the poller thread held back before it could see this waiter.
        self._pull()
        with trio.move_on_after(limit) as scope:
            try:
                await ev.wait()
            except trio.Cancelled:
                waiters = self._waiters.get(imm, [])
                if entry in waiters:
                    waiters.remove(entry)
                    if not waiters:
                        self._waiters.pop(imm, None)
                elif ev.is_set() and not self._closed:
                    self._count[imm] += count  # satisfied as we were cancelled: give it back
                raise
        if scope.cancelled_caught:
            assert timeout is not None and limit != math.inf
            raise WaitTimeout(f"only {self._count[imm]} of {count} pieces with immediate "
                              f"{imm} arrived within {timeout:g} s")
        if self._closed:
            raise EngineClosed(f"engine closed while waiting for immediate {imm}")

    def deliver(self, arrivals: list[tuple[int, int]]) -> None:
        """In trio: ``(imm, count)`` arrivals, routed or counted (waking waiters)."""
        for imm, cnt in arrivals:
            if self._routes:
                handler = next((h for (sh, tg), h in self._routes.items() if imm >> sh == tg),
                               None)
                if handler is not None:
                    handler(imm, cnt)
                    continue
            self._count[imm] += cnt
            waiters = self._waiters.get(imm)
            while waiters and self._count[imm] >= waiters[0][0]:
                count, ev = waiters.pop(0)
                self._take(imm, count)
                ev.set()
            if waiters == []:
                del self._waiters[imm]

    def close(self) -> None:
        """Wake every waiter (they raise ``EngineClosed``)."""
        self._closed = True
        for waiters in self._waiters.values():
            for _, ev in waiters:
                ev.set()
        self._waiters.clear()

    def _take(self, imm: int, count: int) -> None:
        self._count[imm] -= count
        if self._count[imm] == 0:
            del self._count[imm]
