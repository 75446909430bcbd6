"""Health of (our rail, peer rail) pairs: up, down, or due for a retry.

A pair goes down when its pieces fail, or when it has pieces in flight and
no completion (nor posting) progress for ``stall_s`` while another pair to
the same peer still works and the kernel does not see its link carry
(``Shard`` decides; see ``_failover.py``). A down
pair is left alone for ``retry_s``, doubling up to ``retry_max_s`` while it
keeps failing; after that, writes that can fail over may use it again (it is
*probing*), and the first completion on it brings it back up.

Plain data, touched by the poller thread (and the trio thread absorbing a
small write's completions) under the shard's lock, read by the trio thread
when it plans a write. What must not live here: posting, AV changes, or
anything per piece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from p2pxfer.log import get_logger

from ._owner import ShardLock
from ._plan import PairKey

__all__ = ["PairHealth", "RailHealth"]

MAX_PAIRS = 4096  # pairs remembered; idle up ones are forgotten beyond that

log = get_logger("p2pxfer.engine")


@dataclass
class PairHealth:
    """One pair's state. Times are ``time.monotonic()``."""

    up: bool = True
    #: when a down pair may be tried again
    retry_at: float = 0.0
    #: how long the next down period lasts
    retry_s: float = 0.0
    #: times it went down
    downs: int = 0
    #: last completion or post on it (while busy)
    last_progress: float = 0.0
    busy: bool = False
    #: pieces posted on it as last seen (posting counts as progress too)
    posted: int = -1
    reason: str = ""


class RailHealth:
    """Every pair's ``PairHealth`` of one shard, created on first sight."""

    def __init__(self, lock: ShardLock, *, stall_s: float, retry_s: float,
                 retry_max_s: float) -> None:
        self._lock = lock
        self.stall_s = stall_s
        self.retry_s = retry_s
        self.retry_max_s = max(retry_max_s, retry_s)
        self.pairs: dict[PairKey, PairHealth] = {}

    def _get(self, key: PairKey) -> PairHealth:
        p = self.pairs.get(key)
        if p is None:
            p = self.pairs[key] = PairHealth(retry_s=self.retry_s)
        return p

    def usable(self, key: PairKey, now: float, *, probe: bool) -> bool:
        """May a new write use this pair? Up ones, and with ``probe`` (a write
        that can fail over) down ones whose retry time has come."""
        p = self.pairs.get(key)
        return p is None or p.up or (probe and now >= p.retry_at)

    def chooser(self, now: float) -> Callable[[PairKey, bool], bool]:
        """``usable`` for ``RailGroup.prepare``: (pair, per-piece write) ->
        may it use the pair (a per-piece-immediate write never probes)."""
        return lambda key, per_piece: self.usable(key, now, probe=not per_piece)

    def state(self, key: PairKey, now: float) -> str:
        p = self.pairs.get(key)
        if p is None or p.up:
            return "up"
        return "probing" if now >= p.retry_at else "down"

    def touch(self, key: PairKey, now: float) -> None:
        """A completion on ``key``: it makes progress; a down pair that
        completes something is up again. Remembers the pair (statistics list
        every pair that carried something)."""
        self._lock.require("RailHealth.touch")
        p = self.pairs.get(key)
        if p is None:
            if len(self.pairs) >= MAX_PAIRS:  # peers came and went: forget idle ones
                for k in [k for k, q in self.pairs.items() if q.up and not q.busy]:
                    del self.pairs[k]
            p = self._get(key)
        p.last_progress = now
        if not p.up:
            p.up, p.retry_s = True, self.retry_s
            log.info("rail.up", rail=key[0], peer=key[1].hex(), was=p.reason)

    def mark_down(self, key: PairKey, now: float, reason: str) -> None:
        self._lock.require("RailHealth.mark_down")
        p = self._get(key)
        if not p.up:
            # Failed again while probing: wait longer next time.
            p.retry_s = min(2 * p.retry_s, self.retry_max_s)
        # retry_at first: the trio thread reads up, then retry_at, unlocked
        # (``usable``); a down pair with last time's retry_at looks due a probe.
        p.retry_at = now + p.retry_s
        p.up, p.reason, p.downs, p.busy = False, reason, p.downs + 1, False

    def forgive(self, seconds: float) -> None:
        """This process could not poll for ``seconds`` (starved of CPU): that
        time does not count against any pair's progress."""
        self._lock.require("RailHealth.forgive")
        for p in self.pairs.values():
            if p.busy:
                p.last_progress += seconds

    def spare(self, key: PairKey, now: float) -> None:
        """``key`` looked stalled but its link carries: its clock starts again."""
        self._lock.require("RailHealth.spare")
        p = self._get(key)
        p.last_progress = now

    def stalled(self, busy: dict[PairKey, int], now: float) -> list[PairKey]:
        """Pairs with work on them (``busy``: pair -> pieces posted on it by
        the transfers in flight) and no progress for ``stall_s``: no
        completion (``touch``) and no new post. A pair that just became busy
        starts its clock now."""
        self._lock.require("RailHealth.stalled")
        out = []
        for key, p in self.pairs.items():
            if key not in busy:
                p.busy = False
        for key, posted in busy.items():
            p = self._get(key)
            if not p.busy or posted != p.posted:
                p.busy, p.last_progress, p.posted = True, now, posted
            elif now - p.last_progress > self.stall_s:
                out.append(key)
        return out
