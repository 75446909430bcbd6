"""A transfer's state between submission and its waiter waking, and a NIC's
counters: plain data shared by the shard's two threads, and the error a
finished transfer raises. What must not live here: posting, polling or any
decision about a transfer (``_shard.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from p2pxfer.errors import (
    EngineClosed,
    NotificationUnknown,
    PeerUnreachable,
    RailFailedUnderImmediates,
    RailsExhausted,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from p2pxfer.fabric import StallWatch

from ._plan import PreparedWrite

__all__ = ["NicStats", "PairStats", "TransferState"]


@dataclass(frozen=True)
class PairStats:
    """One (our NIC, peer NIC) pair's health: ``state`` is "up", "down"
    (failed; left alone until its retry time) or "probing" (retry time come:
    writes that can fail over use it again, the next completion makes it up)."""

    peer: str
    state: str
    #: times it went down
    downs: int
    #: why it last went down ("" if never)
    reason: str


@dataclass(frozen=True)
class NicStats:
    shard: int
    name: str
    provider: str
    bytes: int
    pieces: int
    completed: int
    inflight: int
    errors: int
    received: int
    #: the peer NICs it has written to, and how each pair is doing
    pairs: tuple[PairStats, ...] = ()


class TransferState:
    """A transfer between submission and its waiter waking. ``remaining``,
    ``error``, ``completed`` and the piece counts are written under the
    shard's lock; ``done`` is set in trio.

    A plain class: the fields below that are rarely set are read from the
    class until a thread sets them, so making one (once per write) costs a
    handful of stores, not two dozen."""

    #: why a piece failed (the provider's words)
    error: str | None = None
    closed: bool = False
    cancel_requested: bool = False
    direct: bool = False  # posted from the trio thread
    gone: str | None = None  # why its peer can never be reached (poller thread)
    #: trio time by which it must be done (inf: none)
    deadline: float = float("inf")
    #: asked to be given up (``Shard.abort``): why, and whether for its deadline
    abort_requested: tuple[str, bool] | None = None
    #: why it was given up (set by the poller thread), and whether for its deadline
    aborted: str | None = None
    timed_out: bool = False
    #: pieces acknowledged (completed without error)
    completed: int = 0
    #: notify mode: the notification's cursor once added (-1: not yet)
    notify_cursor: int = -1
    #: notify mode: the notification may ride behind unacknowledged data of
    #: any size (``Engine.submit``'s ``notify_early``)
    notify_early: bool = False
    #: why its rail pairs all failed (``RailsExhausted``), and the piece
    #: ranges known landed then
    exhausted: str | None = None
    landed: tuple[tuple[int, int], ...] = ()
    #: why a per-piece-immediate write could not fail over
    rail_lost: str | None = None
    #: why a notify-mode write's notification has an unknown outcome
    notify_lost: str | None = None
    #: times its pieces moved to other rail pairs
    failovers: int = 0
    #: queued ahead of writes not started (``DestQueues.push_front``)
    under_way: bool = False
    #: per cursor, pieces posted as last counted (``DestQueues.note_posted``)
    #: and pieces completed or failed: set when it is submitted
    seen: list[int]
    cdone: list[int]

    def __init__(self, w: PreparedWrite, dry_run: bool = False, remaining: int = 0) -> None:
        self.w = w
        self.dry_run = dry_run
        self.remaining = remaining
        #: per rail index, pieces posted and not yet completed or failed
        self.outstanding: dict[int, int] = {}
        self.done = trio.Event()
        self._stall: StallWatch | None = None

    @property
    def stall(self) -> StallWatch:
        """Watches its posting for a peer that refuses (made on first use)."""
        if self._stall is None:
            self._stall = StallWatch()
        return self._stall

    @property
    def failed(self) -> bool:
        """It ended with an error of any kind (not cancelled, not ok)."""
        return (self.closed or self.error is not None or self.gone is not None
                or self.aborted is not None or self.exhausted is not None
                or self.rail_lost is not None or self.notify_lost is not None)

    @property
    def peer(self) -> str:
        """The destination, for messages: region and node."""
        node = f" on {self.w.dst_node!r}" if self.w.dst_node else ""
        return f"{self.w.dst_name!r}{node}"

    def exception(self) -> BaseException | None:
        if self.closed:
            return EngineClosed(f"engine closed while writing to {self.peer}")
        if self.aborted is not None:
            cls = TransferTimeout if self.timed_out else TransferAborted
            n, done = self.w.written, self.completed >> self.w.tails
            return cls(f"write to {self.peer} {self.aborted}: {done} of {n} "
                       f"pieces acknowledged, {n - done} not (posting stopped and "
                       "the connection carrying them was torn down)",
                       peer=self.peer, pieces=n, completed=done)
        if self.exhausted is not None:
            spans = ", ".join(f"{a}..{b - 1}" for a, b in self.landed) or "none known"
            return RailsExhausted(f"write to {self.peer} failed: no rail pair to the peer is "
                                  f"left ({self.exhausted}); pieces known landed: {spans} "
                                  f"of {self.w.pieces}", landed=self.landed)
        if self.rail_lost is not None:
            return RailFailedUnderImmediates(
                f"write to {self.peer} failed: a rail failed under it ({self.rail_lost}) and "
                f"its pieces each carry the immediate, so re-posting them elsewhere could "
                f"count some twice: {self.completed >> self.w.tails} of {self.w.written} pieces "
                f"acknowledged; use notify=True to fail over", pieces=self.w.written,
                completed=self.completed >> self.w.tails)
        if self.gone is not None:
            return PeerUnreachable(f"write to {self.peer} failed: {self.gone}")
        if self.error is not None:
            return TransferError(f"write to {self.peer} failed: {self.error}")
        # Only once no piece failed: then every piece landed.
        if self.notify_lost is not None:
            return NotificationUnknown(
                f"write to {self.peer}: every piece landed, but its notification's outcome "
                f"is unknown ({self.notify_lost}); it is not sent again")
        if self.w.batch.unposted_at_cancel:
            return TransferError(f"write to {self.peer} was cancelled with "
                                 f"{self.w.batch.unposted_at_cancel} pieces unposted")
        return None
