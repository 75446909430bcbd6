"""One shard: the rails of one NUMA node, and the poller thread that drives them.

The poller thread drives this shard's CQs (pplx-garden's worker model): trio
hands it prepared transfers through ``_inbox`` plus an eventfd wake-up; it
hands finished transfers and immediates back through deques plus one
coalesced ``run_sync_soon(..., idempotent=True)`` per drained batch. A thread
hop into trio costs ~100 us on small VMs, so the trio thread posts small
writes itself (endpoints are FI_THREAD_SAFE) and polls for them a moment
with a poller of its own. Who may touch what is ``_owner.py``'s, checked.
Operation contexts are integers (transfer id, cursor index). The shard's
parts: the poller's loop (``_poller_loop.py``), the express path
(``_express.py``), failover and notifications (``_failover.py``), its
memory (``_shard_memory.py``). With them, the only code that posts writes
and counts completions. What must not live here: validation
(``RailGroup.prepare``) and any Python loop over pieces.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from p2pxfer.fabric import (
    CURSOR_SHIFT,
    FLAG_REMOTE_CQ_DATA,
    TID_MASK,
    CompletionError,
    Completions,
    Poller,
    Rail,
    split_context,
)
from p2pxfer.log import get_logger
from p2pxfer.topology import Shard as ShardTopology

from ._express import Express
from ._failover import Failover
from ._health import RailHealth
from ._owner import ShardLock, ThreadOwner
from ._plan import RailGroup
from ._poller_loop import INFLIGHT_SPIN_NS, PollerLoop
from ._queues import DestQueues
from ._shard_memory import ShardMemory
from ._state import NicStats, TransferState

__all__ = ["Shard"]

log = get_logger("p2pxfer.engine")

DIRECT_POST_MAX = 64  # writes of at most this many pieces: posted from the trio thread
# ... and, while others of the shard are in flight, of at most this many bytes.
# Posting copies the bytes on shm (CMA) and tcp (into the socket), under the
# shard's lock: a KV push's 1 MiB layers posted so held the poller thread off
# the lock for most of the push (32 x 64 random 16 KiB pieces submitted
# together, in process: tcp 9.2 ms plain / 11.6 ms notified, against 7.3 /
# 9.4 ms with the layers posted by the poller thread; shm 6.7 / 7.9 against
# 4.9 / 6.2-7.3; into a daemon's pool, tcp 7.6-8.0 against 6.9 notified).
DIRECT_POST_MAX_BYTES = 64 << 10
IMM_BACKLOG = 64  # batches of immediates nobody waits for, held before a delivery


class Shard:
    """Rails of one NUMA node driven by one pinned poller thread. Owns the rails
    (a ``RailGroup``; the engine registers and exports through ``memory``),
    the poller thread's ``Poller`` and the trio thread's inline one."""

    def __init__(self, index: int, topo: ShardTopology, rails: list[Rail], *,
                 token: trio.lowlevel.TrioToken, deliver_imms: Any,
                 imms_wanted: Callable[[], bool], max_inflight: int,
                 spin_ns: int, idle_timeout_ns: int, pin: bool, cache_entries: int,
                 backoff_max_ns: int, peer_pieces: int = 512, rail_stall_s: float = 1.5,
                 rail_retry_s: float = 3.0, rail_retry_max_s: float = 60.0) -> None:
        self.index = index
        self.topo = topo
        self._group = RailGroup(rails, cache_entries=cache_entries, numa_node=topo.numa_node)
        self.memory = ShardMemory(self._group, topo)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            # Rung (a peer posted what needs our progress), spin as with
            # transfers in flight.
            self._poller = Poller(rails, wake_fd=self.wake_fd, backoff_max_ns=backoff_max_ns,
                                  bell_spin_ns=INFLIGHT_SPIN_NS)
            self._inline_poller = Poller(rails, max_runs=64)
        except BaseException:
            os.close(self.wake_fd)
            self._group.close()
            raise
        # The trio thread's CQ reads (the inline and express polls) and the
        # poller thread's ``Rail.disconnect`` exclude each other: a read can
        # change a provider connection's state between disconnect's look at
        # it and the AV removal. Held only for those; never with the lock.
        self._cq_guard = threading.Lock()
        for rail in rails:
            rail.progress_guard = self._cq_guard
        self.slots = trio.Semaphore(max_inflight)
        # Who owns what: ``_owner.py``. The lock is held across C calls only
        # for short non-blocking ones that must not race a teardown: a direct
        # post, an AV removal.
        self._lock = ShardLock()
        self._trio = ThreadOwner("the engine's trio thread")
        self._blocks_on_fds = self._poller.blocks_on_fds
        self._backoff_max_ns = backoff_max_ns
        self._recent = 0.0  # when this shard's poller last read a completion
        self._token = token
        self._deliver_imms = deliver_imms
        self._imms_wanted: Callable[[], bool] = imms_wanted
        self._spin_ns = spin_ns
        self._idle_ns = idle_timeout_ns
        self._pin = pin
        self._next_id = 1
        self._inbox: deque[tuple[str, TransferState | None]] = deque()
        self._finished: deque[TransferState] = deque()
        self._imm_batches: deque[list[tuple[int, int]]] = deque()
        self._inflight: dict[int, TransferState] = {}
        # Writes not fully posted yet: FIFO per destination (poller thread).
        self._queues = DestQueues(peer_pieces, self._lock)
        self.thread_done = trio.Event()
        self.thread_error: BaseException | None = None
        nrails = len(rails)
        self._pieces_posted, self._bytes_posted = [0] * nrails, [0] * nrails  # delivered
        self.pieces_done = [0] * nrails  # our writes' completions
        self.pieces_abandoned = [0] * nrails  # in flight when their connection went
        self.pieces_received = [0] * nrails  # peers' writes that landed here
        self.errors = [0] * nrails
        self._health = RailHealth(self._lock, stall_s=rail_stall_s, retry_s=rail_retry_s,
                                  retry_max_s=rail_retry_max_s)
        self._failover = Failover(index, self._group.rails, self._inflight, self._queues,
                                  self._health, self.pieces_abandoned, self._finish_if_done,
                                  self.wake_fd, self._lock)
        self._next_check = 0.0
        self.in_flight = self.completed = self.failed = self.cancelled = 0
        self.express = Express(self, DIRECT_POST_MAX)

    # -- trio side ------------------------------------------------------------

    def start(self) -> None:
        trio.lowlevel.start_thread_soon(PollerLoop(self).run, self._thread_exited,
                                        name=f"p2pxfer-poller-{self.index}")

    def _thread_exited(self, outcome: Any) -> None:
        try:
            outcome.unwrap()
        except BaseException as exc:
            self.thread_error = exc
            log.error("engine.poller_failed", shard=self.index, error=repr(exc))
        self._token.run_sync_soon(self._deliver)
        self._token.run_sync_soon(self.thread_done.set)

    @property
    def read_inline(self) -> int:  # completions the trio thread read, polling inline
        return self._inline_poller.entries

    @property
    def read_by_poller(self) -> int:  # completions the poller thread read
        return self._poller.entries

    # -- transfers (trio thread) ---------------------------------------------------

    def new_tid(self) -> int:
        self._trio.require("new_tid")
        tid, self._next_id = self._next_id, self._next_id + 1
        return tid

    def prepare(self, src: Any, dst: Any, scatter: Any, imm: Any,
                dry_run: bool, notify: bool = False, *, tid: int | None = None) -> TransferState:
        """Validate and lay out (raises on bad input; nothing queued), over
        the rail pairs that are up (and, for a write that can fail over,
        those due for a retry). ``tid``: an id taken already (``new_tid``)."""
        if tid is None:
            tid = self.new_tid()
        w = self._group.prepare(src, dst, scatter, imm, tid, notify=notify,
                                usable=self._health.chooser(time.monotonic()))
        w.region.pins += 1
        return TransferState(w, dry_run, w.pieces)

    def submit(self, tr: TransferState, *, inline: bool = False) -> None:
        """Post a small write now, from this (trio) thread, saving a thread
        hop (``posts_directly``); the poller posts long lists, many bytes
        beside other writes, and what the TX queue refused. With
        ``inline``, :meth:`poll_inline` must follow whenever ``tr.direct``:
        the poller keeps off the CQs until then. Raises only before anything
        is posted, with the hold released."""
        try:
            self._submit(tr, inline)
        except BaseException:
            self._poller.hold(False)
            with self._lock:  # nothing of it was posted: it was never here
                if self._inflight.pop(tr.w.tid, None) is not None:
                    self.in_flight -= 1
                self._notified(tr)
            raise

    def _submit(self, tr: TransferState, inline: bool) -> None:
        self._trio.require("submit")
        self.in_flight += 1
        n = len(tr.w.batch.rails)
        tr.seen, tr.cdone = [0] * n, [0] * n
        # Registered before the first post, so no completion can miss it.
        with self._lock:
            self._inflight[tr.w.tid] = tr
            if tr.w.notify_imm is not None and not tr.dry_run:
                self._queues.will_notify(tr)
        tr.direct = self.posts_directly(tr)
        if tr.direct and inline:
            self._poller.hold(True)
        failed = False
        if tr.direct:
            # Under the lock (a few non-blocking posts): a peer address the
            # poller thread removes (``abort``) must never be posted to; and
            # once posted, the poller thread may add the write's notification
            # cursor (its pieces completed), so the batch is read here only.
            with self._lock:
                tr.w.batch.refresh()
                if tr.w.batch.window(self._queues.room(tr)):
                    tr.w.batch.post_once()
                    self._queues.note_posted(tr)
                    # Left: the TX queue pushed back, or the peer's bound held
                    # the cursor short. Either way the poller posts the rest.
                    left = not tr.w.batch.posted
                    if tr.w.notify_imm is not None and not left:
                        self._finish_if_done(tr)  # its notification may go right behind
                    failed = bool(tr.w.batch.failures())
                else:
                    left = True  # its peer's bound is full: the poller posts it
        if not tr.direct or left:
            self._send("write", tr)
        elif failed:
            self._send("write", tr)  # the poller turns the failed post into an error
        elif not self._blocks_on_fds and not inline:
            # A poller napping without CQ fds (shm) would see the completion only
            # after its back-off: wake it now so it spins for it. (With fds the
            # CQ wakes it; when we poll inline ourselves, a wake-up would only
            # fight us for the GIL.)
            os.eventfd_write(self.wake_fd, 1)

    def posts_directly(self, tr: TransferState) -> bool:
        """Whether the trio thread posts ``tr`` itself (``submit``). Only
        small writes: a long list posted from two threads would have them
        fight over the provider's locks, and many bytes would hold the
        shard's lock while the poller thread has others to absorb (a write
        alone on the shard keeps it from nobody). And only while no earlier
        write waits for the poller: writes go out in order."""
        return (not tr.dry_run and tr.w.pieces <= DIRECT_POST_MAX
                and (tr.w.nbytes <= DIRECT_POST_MAX_BYTES or self.alone(tr))
                and not self._inbox and not self._queues.waiting_for(tr.w.dest))

    def alone(self, tr: TransferState) -> bool:
        """No transfer but ``tr`` is in flight or queued on this shard."""
        n = len(self._inflight)
        return not self._inbox and (n == 0 or (n == 1 and tr.w.tid in self._inflight))

    def cancel(self, tr: TransferState, *, drain: bool = False) -> None:
        """Stop posting ``tr``. With ``drain``, only if none of it was posted
        yet (the poller thread decides); a write under way then goes on to
        its end, so that what it posted has landed when it ends: a
        completion on tcp means handed to the socket, not placed, and only
        the write's own delivery-complete tail or notification says placed."""
        if drain:
            self._send("drain", tr)
            return
        tr.cancel_requested = True
        self._send("cancel", tr)

    def abort(self, tr: TransferState, why: str, *, timed_out: bool = False) -> None:
        """Give ``tr`` up now, in the poller thread: stop posting, tear down
        the connections carrying its pieces (``DestQueues.tear_down``; the
        next write to that peer connects anew) and finish it with
        ``TransferAborted``/``TransferTimeout``. A transfer that finished
        meanwhile is left as it is."""
        if tr.abort_requested is None and not tr.done.is_set():
            # Taken up by the poller thread: only it knows whether the
            # transfer is still in flight.
            tr.abort_requested = (why, timed_out)
            self._send("abort", tr)

    def stop(self) -> None:
        self._send("stop", None)

    def _send(self, what: str, tr: TransferState | None) -> None:
        self._inbox.append((what, tr))
        os.eventfd_write(self.wake_fd, 1)

    def _deliver(self) -> None:
        """Runs in trio: wake finished transfers' waiters, pass immediates on."""
        self._trio.require("_deliver")
        while self._finished:
            tr = self._finished.popleft()
            self.in_flight -= 1
            # Accounted here, in trio, after submit() has returned: the poller
            # may see the last completion before the posting call has stored
            # how far it got.
            for r, pieces, nbytes in tr.w.batch.progress():
                self.count_delivered(r, pieces >> tr.w.tails, nbytes)
            self._group.cache.unpin(tr.w.region)
            # The slot goes back when the transfer ends, not when someone
            # awaits it: a caller may submit many before waiting for any.
            self.slots.release()
            if tr.failed:
                self.failed += 1
            elif tr.w.batch.unposted_at_cancel:
                self.cancelled += 1
            else:
                self.completed += 1
            tr.done.set()
        self.pull_imms()

    def close(self, *, process_exits: bool = False) -> None:
        """Deregister everything and close the rails (the poller thread has
        stopped); ``Rail.close`` says what ``process_exits`` leaves open."""
        self.express.close()
        self._group.close(process_exits=process_exits)
        os.close(self.wake_fd)

    # -- poller thread --------------------------------------------------------

    def poll_inline(self, tr: TransferState, budget_ns: int) -> None:
        """In the trio thread, right after posting a small write: poll the CQs
        for up to ``budget_ns`` (blocking the event loop that long) and deliver
        what finished, so a small write's completion needs no thread hop. The
        poller thread is held off the CQs meanwhile (see ``submit``) and let go
        on the way out; whatever is still due then is its to find."""
        deadline = time.perf_counter_ns() + budget_ns
        try:
            while not tr.done.is_set():
                # One C call spins until this write's completions arrived (or
                # others', or the budget ran out): no Python per empty poll.
                left = deadline - time.perf_counter_ns()
                with self._cq_guard:
                    c = self._inline_poller.progress(spin_ns=max(left, 0),
                                                     min_entries=max(tr.remaining, 1))
                with self._lock:
                    self._absorb(c)
                if self._finished or self._imm_batches:
                    self._deliver()
                if time.perf_counter_ns() > deadline:
                    if not tr.done.is_set():
                        # Our reads may have left the provider mid-message with
                        # the socket drained: no fd would wake the poller. Wake
                        # it, let go first (woken while held, it naps again).
                        self._poller.hold(False)
                        os.eventfd_write(self.wake_fd, 1)
                    return
        finally:
            self._poller.hold(False)

    def _flush(self) -> None:
        # Immediates nobody waits for stay here (up to IMM_BACKLOG batches)
        # until asked (``pull_imms``): waking trio for every arrival makes a
        # third busy thread on two cores. Finished transfers go at once.
        if self._finished or (self._imm_batches and (len(self._imm_batches) >= IMM_BACKLOG
                                              or self._imms_wanted())):
            self._token.run_sync_soon(self._deliver, idempotent=True)

    def pull_imms(self) -> None:
        """In trio: pass on the immediates that arrived and wait here."""
        while self._imm_batches:
            self._deliver_imms(self._imm_batches.popleft())

    def nic_stats(self) -> list[NicStats]:
        """A snapshot per rail, in trio. Bytes and pieces count delivered
        transfers; ``inflight`` adds what undelivered ones posted so far;
        ``pairs`` says how each (rail, peer rail) pair is doing."""
        posting = [0] * len(self._group.rails)
        with self._lock:  # a consistent snapshot of what the poller changes
            for tr in list(self._inflight.values()) + list(self._finished):
                for r, pieces, _ in tr.w.batch.progress():
                    posting[r] += pieces >> tr.w.tails
            pairs = self._failover.pair_stats(time.monotonic())
            # Failed and abandoned pieces are out of flight too. (The counts
            # too are the poller's to change: read in the same snapshot.)
            return [NicStats(self.index, rail.name, rail.provider, self._bytes_posted[r],
                             self._pieces_posted[r], self.pieces_done[r],
                             max(0, self._pieces_posted[r] + posting[r] - self.pieces_done[r]
                                 - self.errors[r] - self.pieces_abandoned[r]),
                             self.errors[r], self.pieces_received[r], pairs.get(r, ()))
                    for r, rail in enumerate(self._group.rails)]

    def failover_counts(self) -> tuple[int, int]:
        """Rail pairs taken down, and pieces posted again elsewhere for it."""
        return self._failover.failovers, self._failover.reposted

    def _absorb(self, c: Completions) -> None:
        # Plain Python over the runs (a handful per batch): here every
        # microsecond holds the GIL the trio thread waits for.
        self._lock.require("_absorb")
        if len(c):
            imms, now = [], time.monotonic()
            inflight = self._inflight
            for rail, ctx, flags, data, cnt in zip(
                c.rail.tolist(), c.context.tolist(), c.flags.tolist(), c.data.tolist(),
                c.count.tolist(), strict=True,
            ):
                if flags & FLAG_REMOTE_CQ_DATA:
                    self.count_arrivals(rail, cnt)
                    imms.append((data, cnt))
                    continue
                cur = ctx >> CURSOR_SHIFT
                tr = inflight.get(ctx & TID_MASK)
                # Else one given up (``_abort``) already counted; a dead
                # cursor's pieces moved to another rail pair.
                if tr is not None and cur not in tr.w.batch.dead:
                    self.count_done(tr, cur, rail, cnt, now)
                elif tr is None and ctx == self.express.tid:
                    self.express.stolen += cnt  # read before its hold took effect
            if imms:
                self._imm_batches.append(imms)
        if (e := c.error) is not None:
            self.piece_error(e)

    def count_pieces(self, key: tuple[int, bytes], cnt: int, now: float) -> None:
        """The one count of our writes' completions, whichever path read them
        (a regular transfer's, or an express write's): ``cnt`` pieces on
        rail pair ``key`` completed; the pair makes progress."""
        self._lock.require("count_pieces")
        self.pieces_done[key[0]] += cnt
        self._health.touch(key, now)

    def count_arrivals(self, rail: int, cnt: int) -> None:
        """``cnt`` pieces of peers' writes with immediates landed on ``rail``."""
        self._lock.require("count_arrivals")
        self.pieces_received[rail] += cnt

    def count_delivered(self, rail: int, pieces: int, nbytes: int) -> None:
        """In trio, once a write ended: what it posted on ``rail``."""
        self._trio.require("count_delivered")
        self._pieces_posted[rail] += pieces
        self._bytes_posted[rail] += nbytes

    def count_done(self, tr: TransferState, cur: int, rail: int, cnt: int, now: float) -> None:
        """``cnt`` of ``tr``'s pieces on cursor ``cur`` (on ``rail``) completed
        (under the lock). Statistics count the caller's pieces: a piece
        sent as head and tail (``PreparedWrite.tails``) once both are."""
        before = tr.cdone[cur]
        tr.cdone[cur] += cnt
        shown = (tr.cdone[cur] >> 1) - (before >> 1) if tr.w.tails else cnt
        self.count_pieces((rail, tr.w.batch.peers[cur][1]), shown, now)
        self._queues.note_done(tr, rail, cnt)
        if cur != tr.notify_cursor:
            tr.completed += cnt
        tr.remaining -= cnt
        self._finish_if_done(tr)

    def piece_error(self, e: CompletionError) -> None:
        """A piece failed (an error entry; under the lock)."""
        self._lock.require("piece_error")
        tid, cur = split_context(e.context)
        tr = self._inflight.get(tid)
        if tr is None and e.context == self.express.tid:
            self.express.stolen_error = e  # read before its hold took effect
        elif tr is None or cur in tr.w.batch.dead:
            # Flushed from a connection ``_abort`` or a failover tore down.
            log.debug("transfer.piece_flushed", transfer_id=tid, error=e.text,
                      shard=self.index)
        else:
            log.warning("transfer.piece_failed", transfer_id=tid, code=e.code,
                        error=e.text, shard=self.index)
            self.errors[e.rail] += e.pieces
            self._failover.piece_failed(tr, cur, e.text, e.pieces)

    def _finish_if_done(self, tr: TransferState) -> None:
        self._lock.require("_finish_if_done")
        if tr.w.tid not in self._inflight:
            return
        # Its notification is added only while no other thread posts its
        # cursors (queued: the poller may be posting it outside the lock, and
        # adding a cursor can move the array; the poller comes back here).
        if (tr.w.notify_imm is not None and tr.notify_cursor < 0 and not tr.dry_run
                and not self._queues.holds(tr)):
            # Read once: the trio thread sets it without the lock, and read
            # twice it could skip both branches (a write "ok", never notified).
            cancelled = tr.cancel_requested
            if cancelled and tr.remaining <= 0:
                tr.error = tr.error or "it was cancelled before its notification was sent"
            elif not cancelled and all(x is None for x in (
                    tr.error, tr.gone, tr.aborted, tr.exhausted, tr.rail_lost)):
                if not self._queues.notify_turn(tr):
                    return  # an earlier write to its peer notifies first; it calls back
                t = self._failover.notify_pair(tr, time.monotonic())
                if t is not None:
                    self._failover.notify(tr, t, self.wake_fd)
            if tr.notify_cursor >= 0:
                self._notified(tr)
        if tr.remaining <= 0 and not self._queues.holds(tr):
            del self._inflight[tr.w.tid]
            self._finished.append(tr)
            self._notified(tr)

    def _notified(self, tr: TransferState) -> None:
        """``tr`` notified or ended: the next write to its peer may notify."""
        self._lock.require("_notified")
        nxt = self._queues.notified(tr)
        if nxt is not None:
            self._finish_if_done(nxt)  # its turn may have come
