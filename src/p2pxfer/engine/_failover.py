"""Moving a shard's writes off a failed rail pair, notify mode's one
notification, and giving a write up (``abort``): the shard's decisions about
cursors added or stopped after a write was planned.

A pair (our rail, a peer's rail) fails when a piece on it completes with an
error, or when it makes no progress for ``EngineConfig.rail_stall_s`` while
another pair to the same peer does (``check``). Then (``fail_pair``) its
peer is disconnected from our rail (``Rail.disconnect``: the TCP connection
reset, the address out of the AV; tcp;ofi_rxm closes the connection and
flushes its operations with FI_ECANCELED, ignored since the cursors that
posted them are dead), and every write with a cursor on it:

- plain writes and notify-mode writes re-post the cursor's whole share on
  the peer's other usable pairs (``_replan``): a piece acknowledged without
  delivery-complete may still sit in a socket buffer that will never drain,
  and writing the same bytes twice is harmless. Notify-mode shares whose
  delivery-complete tail was acknowledged have landed and stay as they are.
- writes whose every piece carries the immediate cannot be re-posted without
  risking a doubled count at the receiver: they fail
  (``RailFailedUnderImmediates``), unless nothing was posted on that pair yet.
- a notification in flight on it is never re-sent (``NotificationUnknown``).
- with no usable pair left the write fails (``RailsExhausted``).

Runs in the poller thread, or the trio thread absorbing a small write's
completions, always under the shard's lock. What must not live here:
posting loops or CQ reads (the shard's), or anything per piece.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from p2pxfer.errors import FabricError
from p2pxfer.fabric import Rail
from p2pxfer.log import get_logger

from ._health import RailHealth
from ._owner import ShardLock
from ._plan import PairKey, Target
from ._queues import DestQueues
from ._state import PairStats

if TYPE_CHECKING:
    from ._state import TransferState

__all__ = ["EAGER_NOTIFY_BYTES", "NOTIFY_BYTES", "Failover"]

log = get_logger("p2pxfer.engine")

#: a notification re-writes at most this many bytes of the write's first piece
#: (bytes the source still holds: harmless), carrying the immediate
NOTIFY_BYTES = 8
#: a notification may ride right behind at most this much unacknowledged data
#: (``Failover.notify_pair``)
EAGER_NOTIFY_BYTES = 256 << 10


def pair_of(tr: TransferState, i: int) -> PairKey:
    b = tr.w.batch
    return (b.rails[i], b.peers[i][1])


def landed(tr: TransferState, i: int) -> bool:
    """Cursor ``i`` of a notify-mode write is in the target's memory: every
    piece acknowledged, its delivery-complete tail included."""
    b = tr.w.batch
    return (tr.w.notify_imm is not None and i not in b.dead and i != tr.notify_cursor
            and tr.cdone[i] >= b.tails[i] - b.starts[i] and tr.seen[i] >= b.tails[i] - b.starts[i])


class Failover:
    """The shard's failover and notification decisions (see the module doc)."""

    def __init__(self, index: int, rails: list[Rail], inflight: dict[int, TransferState],
                 queues: DestQueues, health: RailHealth, abandoned: list[int],
                 finish: Callable[[TransferState], None], wake_fd: int,
                 lock: ShardLock) -> None:
        self._lock = lock
        self._index = index
        self._wake_fd = wake_fd
        self._pending: list[tuple[PairKey, str]] = []
        self._rails = rails
        self._inflight = inflight
        self._queues = queues
        self.health = health
        self._abandoned = abandoned
        self._finish = finish
        #: pairs taken down, and pieces posted again elsewhere because of it
        self.failovers = 0
        self.reposted = 0
        self._labels: dict[PairKey, str] = {}

    def label(self, key: PairKey) -> str:
        """``ournic->peer address``, remembered (the AV may be closed later)."""
        text = self._labels.get(key)
        if text is None:
            rail = self._rails[key[0]]
            try:
                peer = rail.av.straddr(key[1])
            except FabricError:  # closed: the engine is closing
                return f"{rail.name}->{key[1].hex()}"
            text = self._labels[key] = f"{rail.name}->{peer}"
        return text

    # -- notification -------------------------------------------------------------

    def notify_pair(self, tr: TransferState, now: float) -> Target | None:
        """Where notify-mode ``tr``'s notification may go now, or None (not
        yet). Once every share landed: any up pair. Sooner, when the peer has
        one up pair only, and that pair has pieces of it in flight, all
        posted, at most ``EAGER_NOTIFY_BYTES``, on a rail that places one
        peer's writes in order: right behind them (its delivery-complete then
        covers them too), saving a round trip. Not where another pair could
        take the pieces over: a notification in flight is never re-sent, so a
        failing pair would end the write ``NotificationUnknown`` instead of
        failing over (a flapping rail does that often). Any amount where the
        write asked for it (``notify_early``) and the peer has one pair at
        all: a failing pair fails such a write either way."""
        b = tr.w.batch
        open_keys: set[PairKey] = set()
        unposted, nbytes = False, 0
        progress = b.progress()
        for i in range(len(b)):
            total = b.tails[i] - b.starts[i]
            if i not in b.dead and tr.cdone[i] < total:
                open_keys.add(pair_of(tr, i))
                unposted = unposted or tr.seen[i] < total
                nbytes += progress[i][2]
        ups = [t for t in tr.w.targets if self.health.usable(t.key, now, probe=False)]
        if not open_keys:
            return ups[0] if ups else tr.w.targets[0]
        if (len(open_keys) == 1 and len(ups) == 1 and not unposted
                and (nbytes <= EAGER_NOTIFY_BYTES
                     or (tr.notify_early and len(tr.w.targets) == 1))):
            t = next((t for t in ups if t.key in open_keys), None)
            if t is not None and t.rail.ordered:
                return t
        return None

    def notify(self, tr: TransferState, t: Target, wake_fd: int) -> None:
        """Add notify-mode ``tr``'s notification on ``t`` and post it now if
        the TX queue takes it (one non-blocking pass, from either thread),
        else queue it ahead of its destination's other writes and wake the
        poller thread."""
        self._lock.require("Failover.notify")
        self._add_notification(tr, t)
        batch = tr.w.batch
        batch.refresh()
        left = True
        # Not ahead of an earlier write's notification still queued (its
        # peer's bound was full then, and may have room now): notifications
        # to one peer go out in the order their writes finished.
        if not self._queues.under_way(tr.w.dest) and batch.window(self._queues.room(tr)):
            left = batch.post_once()
            self._queues.note_posted(tr)
        if (left or not batch.posted or batch.failures()) and not self._queues.holds(tr):
            self._queues.push_front(tr)
            os.eventfd_write(wake_fd, 1)

    def _add_notification(self, tr: TransferState, t: Target) -> None:
        """The one notification: a delivery-complete write of the first
        piece's first bytes carrying the immediate."""
        w = tr.w
        src, dst, length = w.arrays
        arrays = (np.array(src[:1], np.int64), np.array(dst[:1], np.int64),
                  np.minimum(np.array(length[:1], np.int64), NOTIFY_BYTES))
        tr.notify_cursor = t.add_to(w.batch, 0, 1, landed=True, imm=w.notify_imm,
                                    arrays=arrays, posting=True)
        tr.seen.append(0)
        tr.cdone.append(0)
        tr.remaining += 1

    # -- detecting ------------------------------------------------------------------

    def piece_failed(self, tr: TransferState, cur: int, text: str, pieces: int = 1) -> None:
        """``pieces`` of ``tr`` on cursor ``cur`` completed with an error (one
        write's: a grouped write's pieces fail together; either thread).
        With another pair to the peer, its pair is taken down by the poller
        thread (``run_pending``: only it may stop cursors, since it posts
        them outside the lock); the pieces stay counted until then, so the
        write cannot end first."""
        self._lock.require("Failover.piece_failed")
        if cur != tr.notify_cursor and len(tr.w.targets) > 1:
            self._pending.append((pair_of(tr, cur), f"a piece failed: {text}"))
            os.eventfd_write(self._wake_fd, 1)
            return
        self._queues.note_done(tr, tr.w.batch.rails[cur], pieces)
        tr.cdone[cur] += pieces
        tr.remaining -= pieces
        if cur == tr.notify_cursor:
            tr.notify_lost = f"it failed: {text}"
        else:
            tr.error = tr.error or text
        self._finish(tr)

    def run_pending(self, now: float) -> None:
        """Poller thread: take down the pairs pieces failed on (``piece_failed``)."""
        self._lock.require("Failover.run_pending")
        while self._pending:
            key, reason = self._pending.pop(0)
            live = any(pair_of(tr, i) == key for tr in self._inflight.values()
                       for i in range(len(tr.w.batch)) if i not in tr.w.batch.dead)
            if live:  # else: taken down already, its writes moved
                self.fail_pair(key, reason, now)

    def check(self, now: float) -> None:
        """Take down every pair that stalled while another pair to the same
        peer still works. A peer whose every pair stalls is left to the
        write's deadline: that is a slow or dead peer, not a rail. Also
        lets each rail knock on the connections it reset (``Rail.knock``)."""
        self._lock.require("Failover.check")
        for rail in self._rails:
            rail.knock(now)
        busy: dict[PairKey, int] = {}
        for tr in self._inflight.values():
            b = tr.w.batch
            head = self._queues.is_head(tr)
            room = self._queues.room(tr) if head else []
            posted = b.posted_by_cursor()
            for i in range(len(b)):
                if i in b.dead:
                    continue
                waiting = head and posted[i] < b.ends[i] - b.starts[i] and room[i] > 0
                if tr.seen[i] > tr.cdone[i] or waiting:
                    key = pair_of(tr, i)
                    busy[key] = busy.get(key, 0) + tr.seen[i]
        stalled = set(self.health.stalled(busy, now))
        for key in stalled:
            if not self._alternative(key, stalled, now):
                continue
            # No completion for stall_s is evidence enough only where nothing
            # else knows better: a starved process (ours or the peer's) reads
            # nothing for seconds on a busy host while its rail is fine. Where
            # the kernel sees the link carry (ACKs arriving, nothing
            # outstanding), the pair is slow, not broken: the writes'
            # deadlines rule.
            if self._rails[key[0]].link_carries(key[1], self.health.stall_s):
                self.health.spare(key, now)
                log.info("rail.slow_not_stalled", connection=self.label(key),
                         quiet_s=self.health.stall_s, shard=self._index)
                continue
            self.fail_pair(key, f"no progress for {self.health.stall_s:g} s", now)

    def _alternative(self, key: PairKey, stalled: set[PairKey], now: float) -> bool:
        for tr in self._inflight.values():
            on_it = any(pair_of(tr, i) == key for i in range(len(tr.w.batch))
                        if i not in tr.w.batch.dead)
            if on_it and any(t.key != key and t.key not in stalled
                             and self.health.usable(t.key, now, probe=False)
                             for t in tr.w.targets):
                return True
        return False

    # -- failing over ---------------------------------------------------------------

    def fail_pair(self, key: PairKey, reason: str, now: float) -> None:
        """Take ``key`` down and move every write off it (see the module doc)."""
        self._lock.require("Failover.fail_pair")
        label = self.label(key)
        self.health.mark_down(key, now, reason)
        self.failovers += 1
        reset: list[str] = []
        try:
            reset = self._rails[key[0]].disconnect(key[1])
        except Exception as exc:  # the writes move anyway; say what went wrong
            log.warning("rail.teardown_failed", connection=label, error=str(exc))
        moved = [tr for tr in list(self._inflight.values())
                 if self._move(tr, key, f"{label}: {reason}", now)]
        log.warning("rail.down", connection=label, reason=reason, shard=self._index,
                    writes=[tr.w.tid for tr in moved], reset=reset)
        for tr in moved:
            self._finish(tr)

    def _move(self, tr: TransferState, key: PairKey, why: str, now: float) -> bool:
        b = tr.w.batch
        mine = [i for i in range(len(b)) if i not in b.dead and pair_of(tr, i) == key]
        if not mine:
            return False
        if tr.notify_cursor in mine:
            mine.remove(tr.notify_cursor)
            sent = tr.seen[tr.notify_cursor] > 0
            self._kill(tr, tr.notify_cursor)
            if sent:
                tr.notify_lost = f"its rail pair went down: {why}"
            else:  # never posted: it goes again, on an up pair (``Shard._finish_if_done``)
                tr.notify_cursor = -1
        survivors = [t for t in tr.w.targets
                     if t.key != key and self.health.usable(t.key, now, probe=False)]
        stopping = (tr.error is not None or tr.gone is not None or tr.cancel_requested
                    or tr.rail_lost is not None or tr.exhausted is not None)
        if tr.w.per_piece and any(tr.seen[i] > 0 for i in mine) and not stopping:
            tr.rail_lost = why
            stopping = True
        elif not survivors and not stopping and any(not landed(tr, i) for i in mine):
            tr.exhausted = why
            tr.landed = self._landed(tr)
            stopping = True
        if stopping:
            for i in mine:
                self._kill(tr, i)
            tr.remaining -= b.cancel()
            return True
        ranges = []
        for i in mine:
            if landed(tr, i):
                continue
            ranges.append((b.starts[i], b.ends[i]))
            self._kill(tr, i)
        for start, end in ranges:
            self._replan(tr, start, end, survivors)
        if ranges:
            tr.failovers += 1
            if not self._queues.holds(tr):
                self._queues.push_front(tr)
        return True

    def _kill(self, tr: TransferState, i: int) -> None:
        """Stop cursor ``i`` for good: its pieces in flight (flushed with its
        connection) and those never posted no longer count."""
        out = tr.seen[i] - tr.cdone[i]
        never = tr.w.batch.kill(i)
        rail = tr.w.batch.rails[i]
        if out > 0:
            self._queues.note_done(tr, rail, out)
            self._abandoned[rail] += out
        tr.remaining -= max(out, 0) + never

    def _replan(self, tr: TransferState, start: int, end: int,
                survivors: list[Target]) -> None:
        """Pieces ``[start, end)`` again, in about equal bytes per surviving pair."""
        if end <= start:
            return
        cum = np.cumsum(np.asarray(tr.w.arrays[2][start:end], np.int64))
        k = min(len(survivors), end - start)
        cuts = start + 1 + np.searchsorted(cum, cum[-1] * np.arange(1, k) / k)
        bounds = [start, *sorted(set(int(c) for c in cuts if start < c < end)), end]
        for t, (s, e) in zip(survivors, itertools.pairwise(bounds), strict=False):
            t.add_to(tr.w.batch, s, e, landed=tr.w.notify_imm is not None, posting=True)
            tr.seen.append(0)
            tr.cdone.append(0)
            tr.remaining += e - s
            self.reposted += e - s

    def _landed(self, tr: TransferState) -> tuple[tuple[int, int], ...]:
        b = tr.w.batch
        spans = sorted((b.starts[i], b.tails[i]) for i in range(len(b)) if landed(tr, i))
        out: list[tuple[int, int]] = []
        for s, e in spans:
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return tuple(out)

    # -- giving up ----------------------------------------------------------------------

    def abort(self, tr: TransferState) -> None:
        """Give ``tr`` up (``Shard.abort``): stop posting it, tear down the
        connections carrying its pieces, and with them every write to the
        same peer with pieces in flight on them (``DestQueues.tear_down``)."""
        self._lock.require("Failover.abort")
        if tr.w.tid not in self._inflight or tr.abort_requested is None:
            return  # finished meanwhile: its waiter hears how it ended
        tr.aborted, tr.timed_out = tr.abort_requested
        doomed, links, lost = self._queues.tear_down(tr, list(self._inflight.values()))
        for r, n in lost.items():
            self._abandoned[r] += n
        for o in doomed:
            self._finish(o)  # nothing left in flight nor queued: it ends
        log.warning("transfer.aborted", transfer_id=tr.w.tid, peer=tr.peer,
                    reason=tr.aborted, completed=tr.completed, pieces=tr.w.pieces,
                    posted=sum(tr.w.batch.posted_by_cursor()),
                    also_failed=[o.w.tid for o in doomed[1:]], connections=links,
                    shard=self._index)

    # -- reporting --------------------------------------------------------------------

    def pair_stats(self, now: float) -> dict[int, tuple[PairStats, ...]]:
        """Per rail index, every pair it has used and how it is doing."""
        self._lock.require("Failover.pair_stats")
        out: dict[int, list[PairStats]] = {}
        for key, p in self.health.pairs.items():
            out.setdefault(key[0], []).append(PairStats(
                self.label(key).split("->", 1)[1], self.health.state(key, now), p.downs,
                p.reason))
        return {r: tuple(v) for r, v in out.items()}
