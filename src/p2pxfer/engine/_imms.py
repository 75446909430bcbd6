"""Immediates that landed here: counts per value, the tasks waiting for them,
and the handlers that take whole ranges of values (``route_imms``).

Arrivals come from the shards in trio (``deliver``); those nobody waits for
may stay with a shard's poller thread until someone asks (``pull``: the
shards hand over what they hold first). What must not live here: argument
checks (``Engine``'s), anything run by the poller thread but ``wanted``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import trio

from p2pxfer._waiters import Tally
from p2pxfer.errors import EngineClosed, WaitTimeout

__all__ = ["Immediates"]


class Immediates:
    """What landed here carrying immediates (trio only, but ``wanted``)."""

    def __init__(self, pull: Callable[[], None]) -> None:
        self._pull = pull  # the shards hand over what they hold back
        self._tally = Tally[int]()
        self._routes: dict[tuple[int, int], Any] = {}

    @property
    def awaited(self) -> int:
        """Immediate values some ``wait`` is waiting for now."""
        return self._tally.keys_awaited

    def wanted(self) -> bool:
        """Someone waits for immediates, or routes them (any thread: two
        plain reads)."""
        return bool(self._tally.waiting) or bool(self._routes)

    def count(self, imm: int) -> int:
        self._pull()
        return self._tally.count(imm)

    def route(self, shift: int, tag: int, handler: Any) -> None:
        self._pull()  # what arrived before goes where it went then
        self._routes[(shift, tag)] = handler

    async def wait(self, imm: int, count: int, timeout: float | None, limit: float) -> None:
        """See ``Engine.wait_imm`` (arguments checked there; ``limit``:
        seconds from now, ``math.inf`` for none)."""
        self._pull()
        with trio.move_on_after(limit) as scope:
            # ``queued``: arrivals the poller thread held back before it
            # could see this waiter.
            await self._tally.wait(imm, count, queued=self._pull)
        if scope.cancelled_caught:
            assert timeout is not None and limit != math.inf
            raise WaitTimeout(f"only {self._tally.count(imm)} of {count} pieces with "
                              f"immediate {imm} arrived within {timeout:g} s")
        if self._tally.closed:
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
            self._tally.add(imm, cnt)

    def close(self) -> None:
        """Wake every waiter (they raise ``EngineClosed``)."""
        self._tally.close()
