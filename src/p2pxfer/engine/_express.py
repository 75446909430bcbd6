"""The express path: a small write on a quiet shard, posted and polled for by
the trio thread without the objects a regular transfer is made of.

A write of at most ``DIRECT_POST_MAX`` pieces over the one rail pair its
destination has, while nothing else is in flight or queued on its shard,
needs none of what ordering, back-pressure, failover and the hand-off to the
poller thread exist for. It is posted from the shard's ``ExpressCursor``,
and the trio thread spins on the CQs (``Poller.poll``; the poller thread is
held off them) until its completions are in; then it is counted and done.
Making the ``PreparedWrite``, ``WriteBatch``, ``TransferState`` and
``Transfer`` of a regular write, and taking them apart again, was most of a
small write's cost here (Python on these VMs: ~1 us per dozen lines).

A write that outlives its budget, finds the TX queue full or has a piece
fail becomes a regular transfer on the spot (``_hand_over``): its state is
made with the same transfer id and cursor, registered with what it has done
so far, and it finishes the usual way (deadline, cancellation, errors). The
poller thread can read one of its completions before the hold takes effect
(it may be inside a CQ read as the flag goes up): ``Shard._absorb`` keeps
those for the express write in progress (``stolen``), never drops them.

What must not live here: validation beyond choosing this path (``RailGroup``
validates), a second way to finish a transfer (one that leaves this path is
the shard's), Python per piece.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p2pxfer.fabric import FLAG_REMOTE_CQ_DATA, CompletionError, Completions, ExpressCursor
from p2pxfer.scatter import ScatterList

if TYPE_CHECKING:
    from p2pxfer.memory import RegionDescriptor

    from ._shard import Shard
    from ._state import TransferState

__all__ = ["Express"]


class Express:
    """A shard's express path (the trio thread's; one write at a time)."""

    def __init__(self, shard: Shard, max_pieces: int) -> None:
        self._shard = shard
        self._max_pieces = max_pieces
        self._cursor = ExpressCursor()
        #: the express write being polled for (-1: none), and what the poller
        #: thread read of it meanwhile; written under the shard's lock
        self.tid = -1
        self.stolen = 0
        self.stolen_error: CompletionError | None = None
        #: writes that completed on this path, and that became regular ones
        self.completed = self.handed_over = 0

    def write(self, src: Any, dst: RegionDescriptor, scatter: ScatterList, imm: int | None,
              deadline: float, budget_of: Callable[[int], int]) -> int | TransferState | None:
        """Write ``scatter`` if it can go the express way: the piece count
        once it completed, else its ``TransferState`` (a regular transfer now,
        in flight: wait for it as usual). None when it cannot go this way;
        then nothing was posted. ``budget_of(nbytes)``: how long to poll."""
        s = self._shard
        if (s._inflight or s._inbox or not isinstance(scatter, ScatterList)
                or len(scatter) > self._max_pieces):
            return None
        g = s._group
        region, base, size = g.source(src)
        route = g.route(dst, region)
        if len(route.targets) != 1 or scatter.max_length > g.max_msg:
            return None
        scatter.check_bounds(size, dst.length)
        if imm is not None:
            g.check_imm(imm)
        t = route.targets[0]
        tid = s.new_tid()
        n = len(scatter)
        poller = s._inline_poller
        received: list[tuple[int, int]] = []
        imms: list[tuple[int, int]] = []
        got, failed = 0, None  # failed: the poll that met an error entry
        s._poller.hold(True)
        try:
            with s._lock:
                self.tid, self.stolen, self.stolen_error = tid, 0, None
                # Under the lock: a peer address the poller thread removes
                # (``abort``) must never be posted to.
                left = self._cursor.post(t.rail, t.rail.peer(t.address), scatter.src,
                                         scatter.dst, scatter.length, base, t.src_desc,
                                         t.dst_base, t.dst_key, imm, tid, t.address)
            if not left:
                end = time.perf_counter_ns() + budget_of(scatter.nbytes)
                while True:
                    with s._cq_guard:
                        k = poller.poll(max(end - time.perf_counter_ns(), 0), n - got)
                        if poller.failed:
                            failed = poller.completions(k)  # counted once it is regular
                    if failed is not None:
                        break
                    for rail, ctx, flags, data, cnt in poller.runs(k):
                        if flags & FLAG_REMOTE_CQ_DATA:
                            received.append((rail, cnt))
                            imms.append((data, cnt))
                        elif ctx == tid:
                            got += cnt
                        # else: a write given up earlier (``_absorb`` drops those too)
                    if got >= n or time.perf_counter_ns() >= end:
                        break
            if got >= n:
                now = time.monotonic()
                with s._lock:
                    self.tid = -1
                    s.count_pieces(t.key, n, now)
                    self._count_received(received)
                s.count_delivered(t.ours, n, scatter.nbytes)
                s.completed += 1
                self.completed += 1
                if imms:
                    s._imm_batches.append(imms)
                    s._deliver()
                return n
            return self._hand_over(src, dst, scatter, imm, tid, deadline, got, left, failed,
                                   received, imms)
        finally:
            s._poller.hold(False)

    def _count_received(self, received: list[tuple[int, int]]) -> None:
        for rail, cnt in received:
            self._shard.count_arrivals(rail, cnt)

    def _hand_over(self, src: Any, dst: RegionDescriptor, scatter: ScatterList,
                   imm: int | None, tid: int, deadline: float, got: int, left: bool,
                   failed: Completions | None, received: list[tuple[int, int]],
                   imms: list[tuple[int, int]]) -> TransferState:
        """Make the write a regular transfer with what it has done so far."""
        s = self._shard
        self.handed_over += 1
        s._deliver()  # transfers finished but not delivered give their slots back
        tr = s.prepare(src, dst, scatter, imm, False, tid=tid)  # the same pair and cursor
        tr.deadline = deadline
        self._cursor.hand_to(tr.w.batch)
        s.slots.acquire_nowait()  # free: nothing else is in flight
        s.in_flight += 1
        tr.seen, tr.cdone = [0], [0]
        tr.direct = True
        with s._lock:
            s._inflight[tid] = tr
            s._queues.note_posted(tr)
            done = got + self.stolen
            self.tid = -1
            self._count_received(received)
            if imms:
                s._imm_batches.append(imms)
            if done:
                s.count_done(tr, 0, tr.w.batch.rails[0], done, time.monotonic())
            if self.stolen_error is not None:
                s.piece_error(self.stolen_error)
            if failed is not None:
                s._absorb(failed)  # its runs were not counted above
        s._poller.hold(False)  # before waking it: woken while held, it naps again
        if left:
            s._send("write", tr)  # the poller posts the rest, or reports the failed post
        elif not tr.done.is_set():
            # Our reads may have left the provider mid-message with the socket
            # drained: no fd would wake the poller. Wake it.
            os.eventfd_write(s.wake_fd, 1)
        s._deliver()
        return tr
