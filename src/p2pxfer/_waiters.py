"""Counts that tasks wait on: what arrived per key, and per key the tasks
waiting for some number of it, served in the order they came; a waiter
that is served takes what it waited for.

One primitive for the engine's immediates and the daemon's per-session
counts. Withdrawing a waiter (cancelled, timed out) and serving one are
O(1), whatever else waits on the same key: a client that leaves thousands of
waits behind when it hangs up costs time linear in them. A waiter served
just as it was cancelled gives what it took back (and the next waiter may
then be served). ``limit`` bounds how many wait at once (``LimitExceeded``).
What must not live here: what the keys mean, or checking the caller's
arguments.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

from p2pxfer.errors import LimitExceeded

__all__ = ["Tally"]

K = TypeVar("K")


class _Waiter:
    __slots__ = ("event", "served", "want")

    def __init__(self, want: int) -> None:
        self.want = want
        self.event = trio.Event()
        self.served = False


class Tally(Generic[K]):
    """Counts per key and the waiters for them (trio only)."""

    def __init__(self, limit: int | None = None, what: str = "waits") -> None:
        self.limit = limit
        self.what = what  # named in the ``LimitExceeded`` message
        self.counts: dict[K, int] = {}
        # An OrderedDict per key, not a list: removing any waiter and taking
        # the first are both O(1).
        self._queues: dict[K, OrderedDict[_Waiter, None]] = {}
        self.waiting = 0
        self.closed = False

    @property
    def keys_awaited(self) -> int:
        return len(self._queues)

    def awaited(self, key: K) -> bool:
        return key in self._queues

    def count(self, key: K) -> int:
        return self.counts.get(key, 0)

    def add(self, key: K, n: int) -> None:
        """``n`` more of ``key`` arrived: serve the waiters it now covers."""
        if n:
            self.counts[key] = self.counts.get(key, 0) + n
        queue = self._queues.get(key)
        while queue:
            first = next(iter(queue))
            if self.counts.get(key, 0) < first.want:
                break
            queue.popitem(last=False)
            self.waiting -= 1
            self._take(key, first.want)
            first.served = True
            first.event.set()
        if queue is not None and not queue:
            del self._queues[key]

    async def wait(self, key: K, want: int, queued: Callable[[], None] | None = None) -> None:
        """Return once ``want`` of ``key`` have arrived, taking them. A wait
        cancelled leaves the counts as they were. ``queued`` runs once the
        waiter is in line (arrivals held back until someone waits)."""
        if self.counts.get(key, 0) >= want and key not in self._queues:
            self._take(key, want)
            # Served: a yield for fairness that cancellation cannot undo.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self.limit is not None and self.waiting >= self.limit:
            raise LimitExceeded(f"{self.waiting} {self.what} already wait here "
                                f"(limit {self.limit})")
        waiter = _Waiter(want)
        self._queues.setdefault(key, OrderedDict())[waiter] = None
        self.waiting += 1
        try:
            if queued is not None:
                queued()
            await waiter.event.wait()
        except BaseException:
            self._withdraw(key, waiter)
            raise

    def _withdraw(self, key: K, waiter: _Waiter) -> None:
        queue = self._queues.get(key)
        if queue is not None and waiter in queue:
            del queue[waiter]
            self.waiting -= 1
            if not queue:
                del self._queues[key]
            else:
                self.add(key, 0)  # those behind it may now be served
        elif waiter.served and not self.closed:
            self.add(key, waiter.want)  # served as it was cancelled: give it back

    def discard(self, key: K) -> int:
        """Drop ``key``'s count (nobody waits for it); how much it was."""
        return self.counts.pop(key, 0)

    def close(self) -> None:
        """Wake every waiter (``served`` stays false: they tell by ``closed``)."""
        self.closed = True
        for queue in self._queues.values():
            for waiter in queue:
                waiter.event.set()
        self._queues.clear()
        self.waiting = 0

    def _take(self, key: K, n: int) -> None:
        left = self.counts.get(key, 0) - n
        if left:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)
