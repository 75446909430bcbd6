"""Who may touch a shard's state, checked in the code rather than told in
comments.

A shard's mutable state has exactly two owners:

- **the shard's lock** (``ShardLock``): the in-flight table, the posting
  queues and notification order (``DestQueues``), rail-pair health
  (``RailHealth``), failover decisions (``Failover``), the per-rail counters
  of completions, errors and arrivals, and every ``TransferState``'s
  progress fields. Either thread may take it: the poller thread to absorb
  what it read and post what waits, the trio thread to post a small write
  directly and absorb what it polled inline.
- **the trio thread** (``ThreadOwner``): transfer ids, slots, the count of
  transfers in flight and the completed/failed/cancelled totals, posted
  bytes per rail, registrations and their pins.

Hand-offs between the two go through deques (``_inbox`` trio -> poller;
``_finished`` and ``_imm_batches`` poller -> trio), each with one producer
and one consumer. A method that mutates owned state says so first
(``require``), and a caller that breaks the rule gets ``OwnershipError``, a
bug in p2pxfer, at once rather than a race later. What must not live here:
any state of the shard.
"""

from __future__ import annotations

import threading
from types import TracebackType

__all__ = ["OwnershipError", "ShardLock", "ThreadOwner"]

_ident = threading.get_ident


class OwnershipError(RuntimeError):
    """Shard state touched by a thread that does not own it (a p2pxfer bug)."""


class ShardLock:
    """The shard's lock, knowing which thread holds it. Not re-entrant."""

    __slots__ = ("_holder", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder = 0

    def __enter__(self) -> ShardLock:
        self._lock.acquire()
        self._holder = _ident()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._holder = 0
        self._lock.release()

    def held(self) -> bool:
        """Whether the calling thread holds it."""
        return self._holder == _ident()

    def require(self, what: str) -> None:
        if self._holder != _ident():
            raise OwnershipError(f"{what} must run under the shard's lock")


class ThreadOwner:
    """State only the thread that made this may touch (the engine's trio
    thread: a ``BlockingEngine``'s own, or the caller's)."""

    __slots__ = ("_ident", "name")

    def __init__(self, name: str) -> None:
        self._ident = _ident()
        self.name = name

    def require(self, what: str) -> None:
        if _ident() != self._ident:
            raise OwnershipError(f"{what} must run on {self.name}")
