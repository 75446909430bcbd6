"""One shard: the rails of one NUMA node, and the poller thread that drives them.

The poller thread owns this shard's CQs (pplx-garden's worker model): trio
hands it prepared transfers through a deque plus an eventfd wake-up, and it
hands finished transfers and immediate counts back through deques plus one
coalesced ``TrioToken.run_sync_soon(..., idempotent=True)`` per drained batch.
Two shortcuts for small writes, both because a thread hop into trio costs
~100 us on small VMs: the trio thread posts them itself (endpoints are
FI_THREAD_SAFE), and polls the CQs for a few microseconds with a poller of its
own; whichever thread reads a completion absorbs it under ``_lock``.
Operation contexts are integers (transfer id, cursor index); no Python object
crosses into C. Failover and notify-mode notifications: ``_failover.py``.

This is the only place that posts writes and counts completions (ours and
the immediates peers' writes carry); ``Engine`` asks the shard, never its
rails, cache or poller. What must not live here: validation (done by
``RailGroup.prepare``, in the trio thread) and any Python loop over pieces.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog
import trio

from p2pxfer.errors import P2PXferError
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
from p2pxfer.topology import Shard as ShardTopology

from ._express import Express
from ._failover import Failover
from ._health import RailHealth
from ._plan import RailGroup
from ._queues import DestQueues
from ._shard_memory import ShardMemory
from ._state import NicStats, TransferState

__all__ = ["Shard"]

log = structlog.get_logger("p2pxfer.engine")

DIRECT_POST_MAX = 64  # writes of at most this many pieces: posted from the trio thread
INFLIGHT_SPIN_NS = 500_000  # with transfers in flight, spin this long on CQs without fds
LINGER_S = 0.005  # ... and this long after the last completion read, in flight or not
FD_LINGER_SPIN_NS = 200_000  # where CQs have wait fds: spin this long after each, meanwhile
# With transfers in flight, never sleep longer than this even on CQ wait fds:
# tcp's wait fd signals arrivals, not that a half-sent message may go on (the
# socket became writable): a large write could sit out the whole idle timeout.
INFLIGHT_NAP_NS = 1_000_000  # a wake-up costs tens of microseconds; 1 kHz is cheap
DEEP_IDLE_S = 2.0  # no completion for this long (and none in flight): deep idle
DEEP_IDLE_NAP_NS = 16_000_000  # ... where a nap without wait fds may last this long
DEEP_IDLE_RETURN_NS = 250_000_000  # ... and the poller returns to Python this seldom
IMM_BACKLOG = 64  # batches of immediates nobody waits for, held before a delivery
CLOSE_DRAIN_NS = 20_000_000  # at close, progress this long first (``_shutdown``)


class Shard(ShardMemory):
    """Rails of one NUMA node driven by one pinned poller thread. Owns the
    rails (through a ``RailGroup``, with their registration cache: its
    memory side is ``ShardMemory``'s), the poller thread's ``Poller`` and the
    trio thread's inline one."""

    def __init__(self, index: int, topo: ShardTopology, rails: list[Rail], *,
                 token: trio.lowlevel.TrioToken, deliver_imms: Any,
                 imms_wanted: Callable[[], bool], max_inflight: int,
                 spin_ns: int, idle_timeout_ns: int, pin: bool, cache_entries: int,
                 backoff_max_ns: int, peer_pieces: int = 512, rail_stall_s: float = 1.5,
                 rail_retry_s: float = 3.0, rail_retry_max_s: float = 60.0) -> None:
        self.index = index
        super().__init__(RailGroup(rails, cache_entries=cache_entries,
                                   numa_node=topo.numa_node), topo)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._poller = Poller(rails, wake_fd=self.wake_fd, backoff_max_ns=backoff_max_ns)
            self._inline_poller = Poller(rails, max_runs=64)
        except BaseException:
            os.close(self.wake_fd)
            self._group.close()
            raise
        self.slots = trio.Semaphore(max_inflight)
        # Guards transfer bookkeeping (absorbing completions, taking commands):
        # the poller thread and the trio thread (polling a small write inline
        # with its own poller over the same FI_THREAD_SAFE CQs) both absorb.
        # Held in C only for short non-blocking calls that must not race a
        # teardown: a direct post, an AV removal.
        self._lock = threading.Lock()
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
        self._imms: deque[list[tuple[int, int]]] = deque()
        self._inflight: dict[int, TransferState] = {}
        #: notify-mode writes per destination, in submission order (``_notify_turn``)
        self._notify_order: dict[tuple[bytes, ...], deque[TransferState]] = {}
        # Writes not fully posted yet: FIFO per destination (poller thread).
        self._queues = DestQueues(peer_pieces)
        self.thread_done = trio.Event()
        self.thread_error: BaseException | None = None
        nrails = len(rails)
        self._pieces_posted, self._bytes_posted = [0] * nrails, [0] * nrails  # delivered
        self.pieces_done = [0] * nrails  # our writes' completions
        self.pieces_abandoned = [0] * nrails  # in flight when their connection went
        self.pieces_received = [0] * nrails  # peers' writes that landed here
        self.errors = [0] * nrails
        self._health = RailHealth(stall_s=rail_stall_s, retry_s=rail_retry_s,
                                  retry_max_s=rail_retry_max_s)
        self._failover = Failover(index, self._group.rails, self._inflight, self._queues,
                                  self._health, self.pieces_abandoned, self._finish_if_done,
                                  self.wake_fd)
        self._next_check = 0.0
        self.queued = self.completed = self.failed = self.cancelled = 0
        self.express = Express(self, DIRECT_POST_MAX)

    # -- trio side ------------------------------------------------------------

    def start(self) -> None:
        trio.lowlevel.start_thread_soon(self._thread_main, self._thread_exited,
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
        """Post a small write right now, from this (trio) thread: it saves a
        thread hop. The poller posts long lists and whatever the TX queue refused.
        The endpoint is FI_THREAD_SAFE. With ``inline``, the caller polls for
        the completion next (:meth:`poll_inline`, which must follow whenever
        ``tr.direct``): the poller thread is told to keep off the CQs until
        then. Raises only before anything is posted, with the hold released."""
        try:
            self._submit(tr, inline)
        except BaseException:
            self._poller.hold(False)
            with self._lock:  # nothing of it was posted: it was never here
                if self._inflight.pop(tr.w.tid, None) is not None:
                    self.queued -= 1
                self._notify_release(tr)
            raise

    def _submit(self, tr: TransferState, inline: bool) -> None:
        self.queued += 1
        n = len(tr.w.batch.rails)
        tr.seen, tr.cdone = [0] * n, [0] * n
        # Registered before the first post, so no completion can miss it.
        self._inflight[tr.w.tid] = tr
        if tr.w.notify_imm is not None and not tr.dry_run:
            self._notify_order.setdefault(tr.w.dest, deque()).append(tr)
        # Only small writes are posted here (a long list posted from two threads
        # would have them fight over the provider's locks), and only while no
        # earlier write waits for the poller: writes go out in order.
        tr.direct = (not tr.dry_run and tr.w.pieces <= DIRECT_POST_MAX
                     and not self._inbox and not self._queues.waiting_for(tr.w.dest))
        if tr.direct and inline:
            self._poller.hold(True)
        if tr.direct:
            # Under the lock (a few non-blocking posts): a peer address the
            # poller thread removes (``abort``) must never be posted to.
            with self._lock:
                tr.w.batch.refresh()
                if tr.w.batch.window(self._queues.room(tr)):
                    left = tr.w.batch.post_once()
                    self._queues.note_posted(tr)
                    if tr.w.notify_imm is not None and not left:
                        self._finish_if_done(tr)  # its notification may go right behind
                else:
                    left = True  # its peer's bound is full: the poller posts it
        if not tr.direct or left:
            self._send("write", tr)
        elif tr.w.batch.failures():
            self._send("write", tr)  # the poller turns the failed post into an error
        elif not self._blocks_on_fds and not inline:
            # A poller napping without CQ fds (shm) would see the completion only
            # after its back-off: wake it now so it spins for it. (With fds the
            # CQ wakes it; when we poll inline ourselves, a wake-up would only
            # fight us for the GIL.)
            os.eventfd_write(self.wake_fd, 1)

    def alone(self, tr: TransferState) -> bool:
        """No transfer but ``tr`` is in flight or queued on this shard."""
        n = len(self._inflight)
        return not self._inbox and (n == 0 or (n == 1 and tr.w.tid in self._inflight))

    def cancel(self, tr: TransferState) -> None:
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
        while self._finished:
            tr = self._finished.popleft()
            self.queued -= 1
            # Accounted here, in trio, after submit() has returned: the poller
            # may see the last completion before the posting call has stored
            # how far it got.
            for r, pieces, nbytes in tr.w.batch.progress():
                self._pieces_posted[r] += pieces
                self._bytes_posted[r] += nbytes
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
        while self._imms:
            self._deliver_imms(self._imms.popleft())

    def close(self) -> None:
        """Deregister everything and close the rails (the poller thread has stopped)."""
        self._group.close()
        os.close(self.wake_fd)

    # -- poller thread --------------------------------------------------------

    def _thread_main(self) -> None:
        if self._pin and self.topo.cpus:  # the node's CPUs, not one core
            os.sched_setaffinity(0, self.topo.cpus)
        poller = self._poller
        while True:
            with self._lock:
                if self._inbox and self._take_commands():
                    break
            busy = self._post_pending()
            with self._lock:
                need = min((tr.remaining for tr in self._inflight.values()), default=1)
                if self._queues:  # room to post opens with half a peer's bound back
                    need = max(1, min(need, self._queues.bound // 2))
            self._flush()
            # Outside the lock: spin, then sleep, gathering in C what the closest
            # transfer still needs (each return to Python is a GIL round with
            # trio). Without CQ wait fds (shm) a nap delays every completion and
            # arrival: with transfers in flight, or within LINGER_S of the last
            # arrival (a writer's loop; 64 KiB shm write p50 452 -> 61 us), spin
            # longer first. An idle shm shard still naps (idle bench < 1%).
            # With wait fds (tcp) the same holds for a target in a writer's
            # loop: a thread woken from ppoll answers tens of microseconds
            # late, so within LINGER_S of the last completion it spins
            # FD_LINGER_SPIN_NS after each (one 4 KiB write at a time, mean
            # 31 -> 20 us); an idle one sleeps on the fds as before.
            spin, nap = self._spin_ns, self._idle_ns
            if self._inflight:
                nap = min(nap, INFLIGHT_NAP_NS)
            quiet = time.monotonic() - self._recent
            recent = quiet < LINGER_S
            if not self._blocks_on_fds:
                if self._inflight or recent:
                    spin = max(spin, INFLIGHT_SPIN_NS)
                # Long idle: nap longer (each wake-up costs ~30 us here; an
                # idle shm daemon with membership used 1.4% of a core, the
                # poller 0.8% of it); the first arrival after such a pause
                # waits up to DEEP_IDLE_NAP_NS.
                deep = not self._inflight and quiet > DEEP_IDLE_S
                poller.backoff_max_ns = (max(self._backoff_max_ns, DEEP_IDLE_NAP_NS) if deep
                                         else self._backoff_max_ns)
            elif recent:
                spin = max(spin, FD_LINGER_SPIN_NS)
            if not self._inflight and quiet > DEEP_IDLE_S:
                # Come back to Python seldom (the fds and the wake fd still
                # wake it at once; reset connections' knocks wait that long).
                nap = max(nap, DEEP_IDLE_RETURN_NS)
            c = poller.progress(spin_ns=0 if busy else spin,
                                timeout_ns=0 if busy else nap, min_entries=need)
            with self._lock:
                self._absorb(c)
                now = time.monotonic()
                if len(c):
                    self._recent = now
                self._failover.run_pending(now)  # pairs pieces failed on: fail over
                if now >= self._next_check:  # rail pairs that stalled: fail over
                    self._next_check = now + self._health.stall_s / 10
                    self._failover.check(now)
            self._flush()
        self._shutdown()

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
                c = self._inline_poller.progress(spin_ns=max(left, 0),
                                                 min_entries=max(tr.remaining, 1))
                with self._lock:
                    self._absorb(c)
                if self._finished or self._imms:
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
        # Immediates nobody waits for yet stay here (up to IMM_BACKLOG
        # batches) until someone asks (``pull_imms``): a target in a writer's
        # loop woke its trio thread for every arrival: a third busy thread on
        # two cores, beside the writer and this poller. Finished transfers
        # always go at once.
        if self._finished or (self._imms and (len(self._imms) >= IMM_BACKLOG
                                              or self._imms_wanted())):
            self._token.run_sync_soon(self._deliver, idempotent=True)

    def pull_imms(self) -> None:
        """In trio: pass on the immediates that arrived and wait here."""
        while self._imms:
            self._deliver_imms(self._imms.popleft())

    def _take_commands(self) -> bool:
        while self._inbox:
            # Peek, act, then pop: the trio thread (checking both before
            # posting directly) never sees inbox and queue empty while a write
            # is due: writes go out in submission order.
            what, tr = self._inbox[0]
            if what == "stop":
                self._inbox.popleft()
                return True
            assert tr is not None
            if what == "write":
                if tr.dry_run:
                    tr.remaining -= tr.w.batch.cancel()
                    self._finish_if_done(tr)
                else:
                    self._queues.push(tr)
            elif what == "cancel" and self._queues.remove(tr):
                never = tr.w.batch.cancel()
                tr.w.batch.unposted_at_cancel = never
                tr.remaining -= never
                self._finish_if_done(tr)
            elif what == "abort":
                self._failover.abort(tr)
            self._inbox.popleft()
        return False

    def _post_pending(self) -> bool:
        """Post what waits, per destination in submission order (KV layers
        must land in order), destinations in turn, each within its bound of
        pieces in flight (``DestQueues``). True if some write could post more
        right now (a TX queue was full); False when every waiting write waits
        for its peer's completions. The C call runs outside the lock."""
        poller, busy = self._poller, False
        for head in self._queues.heads():
            tr: TransferState | None = head
            while tr is not None:
                batch = tr.w.batch
                with self._lock:
                    batch.refresh()  # after a teardown, post to the new connection
                    can = batch.window(self._queues.room(tr))
                c = poller.post(batch) if can else None
                # Outside the lock: asking a stalled peer may take a moment.
                gone = None if batch.posted else tr.stall.check(batch)
                with self._lock:
                    self._queues.note_posted(tr)
                    if c is not None:
                        self._absorb(c)
                    if tr.error is not None:
                        tr.remaining -= batch.cancel()  # stop posting after a failure
                    if not batch.posted:
                        if gone is None:
                            busy = busy or batch.window(self._queues.room(tr))
                            break
                        # Its peer is gone: what is not posted never will be.
                        tr.gone = gone
                        tr.remaining -= batch.cancel()
                    nxt = self._queues.next_after(tr)
                    if failures := batch.failures():
                        tr.error = tr.error or "; ".join(failures)
                        # A failed post counts in what cancel() reports as never posted.
                        tr.remaining -= batch.cancel()
                    self._finish_if_done(tr)
                tr = nxt
        return busy

    def nic_stats(self) -> list[NicStats]:
        """A snapshot per rail, in trio. Bytes and pieces count delivered
        transfers; ``inflight`` adds what undelivered ones posted so far;
        ``pairs`` says how each (rail, peer rail) pair is doing."""
        posting = [0] * len(self._group.rails)
        for tr in list(self._inflight.values()) + list(self._finished):
            for r, pieces, _ in tr.w.batch.progress():
                posting[r] += pieces
        pairs = self._failover.pair_stats(time.monotonic())
        # Failed and abandoned pieces are out of flight too.
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
        if len(c):
            imms, now = [], time.monotonic()
            inflight = self._inflight
            for rail, ctx, flags, data, cnt in zip(
                c.rail.tolist(), c.context.tolist(), c.flags.tolist(), c.data.tolist(),
                c.count.tolist(), strict=True,
            ):
                if flags & FLAG_REMOTE_CQ_DATA:
                    self.pieces_received[rail] += cnt
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
                self._imms.append(imms)
        if (e := c.error) is not None:
            self.piece_error(e)

    def count_done(self, tr: TransferState, cur: int, rail: int, cnt: int, now: float) -> None:
        """``cnt`` of ``tr``'s pieces on cursor ``cur`` (on ``rail``) completed
        (under the lock)."""
        self.pieces_done[rail] += cnt
        self._queues.note_done(tr, rail, cnt)
        self._health.touch((rail, tr.w.batch.peers[cur][1]), now)
        tr.cdone[cur] += cnt
        if cur != tr.notify_cursor:
            tr.completed += cnt
        tr.remaining -= cnt
        self._finish_if_done(tr)

    def piece_error(self, e: CompletionError) -> None:
        """A piece failed (an error entry; under the lock)."""
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
            self.errors[e.rail] += 1
            self._failover.piece_failed(tr, cur, e.text)

    def _finish_if_done(self, tr: TransferState) -> None:
        if tr.w.tid not in self._inflight:
            return
        # Its notification is added only while no other thread posts its
        # cursors (queued: the poller may be posting it outside the lock, and
        # adding a cursor can move the array; the poller comes back here).
        if (tr.w.notify_imm is not None and tr.notify_cursor < 0 and not tr.dry_run
                and not self._queues.holds(tr)):
            if tr.cancel_requested and tr.remaining <= 0:
                tr.error = tr.error or "it was cancelled before its notification was sent"
            elif not tr.cancel_requested and all(x is None for x in (
                    tr.error, tr.gone, tr.aborted, tr.exhausted, tr.rail_lost)):
                if not self._notify_turn(tr):
                    return  # an earlier write to its peer notifies first; it calls back
                t = self._failover.notify_pair(tr, time.monotonic())
                if t is not None:
                    self._failover.notify(tr, t, self.wake_fd)
            if tr.notify_cursor >= 0:
                self._notify_release(tr)
        if tr.remaining <= 0 and not self._queues.holds(tr):
            del self._inflight[tr.w.tid]
            self._finished.append(tr)
            self._notify_release(tr)

    # Notifications to one peer go out in the order their writes were
    # submitted: each write's goes once its data is acknowledged, and with
    # several in flight on a fresh tcp;ofi_rxm connection the acknowledgements
    # came out of order now and then (KV layer 6 was counted before layer 5:
    # ``test_layers_land_in_order``, 3 runs in 15). A write that finished
    # without one (failed, cancelled) lets the next go.

    def _notify_turn(self, tr: TransferState) -> bool:
        q = self._notify_order.get(tr.w.dest)
        return q is None or q[0] is tr

    def _notify_release(self, tr: TransferState) -> None:
        q = self._notify_order.get(tr.w.dest)
        if q is None or tr not in q:
            return
        head = q[0] is tr
        q.remove(tr)
        if not q:
            del self._notify_order[tr.w.dest]
        elif head:
            self._finish_if_done(q[0])  # its turn may have come

    def _shutdown(self) -> None:
        """Fail everything still queued or in flight: the engine is closing.
        Then progress a moment (what it reads is dropped): fi_close crashed on a
        tcp;ofi_rxm endpoint whose peer had just dropped a connection mid-write."""
        for tr in list(self._inflight.values()):
            tr.w.batch.cancel()
            tr.closed = True
            self._finished.append(tr)
        self._inflight.clear()
        self._notify_order.clear()
        self._queues.clear()
        while self._inbox:
            what, queued = self._inbox.popleft()
            if what == "write" and queued is not None:
                queued.closed = True
                self._finished.append(queued)
        with contextlib.suppress(P2PXferError):  # closing anyway
            self._poller.progress(spin_ns=0, timeout_ns=CLOSE_DRAIN_NS, min_entries=1 << 30)
