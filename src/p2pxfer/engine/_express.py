"""The express path: a small write on a quiet shard, posted and polled for by
the trio thread without the objects a regular transfer is made of.

A write of at most ``DIRECT_POST_MAX`` pieces over the one rail pair its
destination has, while nothing else is in flight or queued on its shard,
needs none of what ordering, back-pressure, failover and the hand-off to the
poller thread exist for. It is posted from the shard's ``ExpressCursor``,
and the trio thread spins on the CQs (``Poller.express_poll``; the poller
thread is held off them) until its completions are in; then it is counted
and done.
Making the ``PreparedWrite``, ``WriteBatch``, ``TransferState`` and
``Transfer`` of a regular write, and taking them apart again, was most of a
small write's cost here (Python on these VMs: ~1 us per dozen lines); so is
looking up a source's registration, route and peer on every write, which a
``_Plan`` per (numpy array, destination) does once.

A write that outlives its budget, finds the TX queue full or has a piece
fail becomes a regular transfer on the spot (``_hand_over``): its state is
made with the same transfer id and cursor, registered with what it has done
so far, and it finishes the usual way (deadline, cancellation, errors). The
poller thread can read one of its completions before the hold takes effect
(it may be inside a CQ read as the flag goes up): ``Shard._absorb`` keeps
those for the express write in progress (``stolen``), never drops them.

State: ``Express`` and its plans are the trio thread's; ``tid``, ``stolen``
and ``stolen_error`` are written under the shard's lock (the poller thread
reads them in ``_absorb``), and a plan's peer fields are read and refreshed
under it too (the poller thread removes addresses under it).

What must not live here: validation beyond choosing this path (``RailGroup``
validates), a second way to finish a transfer (one that leaves this path is
the shard's), Python per piece.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from p2pxfer.fabric import (
    PEER_GONE,
    CompletionError,
    Completions,
    ExpressCursor,
    open_shm_segment,
    shm_peer_gone,
)
from p2pxfer.scatter import ScatterList

from ._plan import imm_tails

if TYPE_CHECKING:
    from p2pxfer.memory import LocalRegion, RegionDescriptor

    from ._config import EngineConfig
    from ._plan import Target
    from ._shard import Shard
    from ._state import TransferState

__all__ = ["INLINE_NS_PER_KIB", "Express", "alone_budget_ns"]

#: plans kept per shard (``Express._plan``); past this many, start over
MAX_PLANS = 64
#: a write alone in flight polls inline this much longer per KiB it carries
#: (~2 GB/s: about what tcp and shm move here; the budget only caps a spin
#: that ends as soon as the completion is read)
INLINE_NS_PER_KIB = 500


def alone_budget_ns(cfg: EngineConfig, nbytes: int) -> int:
    """How long the trio thread polls for a write of ``nbytes`` alone in
    flight on its shard (an express write, or a regular one alone) before
    handing it to the poller thread: ``inline_poll_ns``, plus about the time
    its bytes take, up to ``inline_poll_max_ns``: for a write alone, the hop
    to the poller thread and back into trio was most of its time."""
    return max(cfg.inline_poll_ns, min(cfg.inline_poll_max_ns,
                                       cfg.inline_poll_ns + (nbytes >> 10) * INLINE_NS_PER_KIB))


class _Plan:
    """What every express write from one source array to one destination
    shares (``Express._plan``): its registration and route, and the peer's
    address, doorbell and shm segment as the rail's AV had them at ``epoch``.
    Holds the array and its registration weakly: a plan must never keep a
    buffer alive."""

    __slots__ = ("alive_fd", "base", "bell", "dest", "dst", "ep", "epoch", "region", "size",
                 "src", "target", "touch")

    def __init__(self, src: weakref.ref[Any] | None, dst: RegionDescriptor,
                 region: LocalRegion, base: int, size: int, target: Target,
                 touch: Callable[[], None]) -> None:
        #: the shm peer's segment, open (``open_shm_segment``; the post
        #: looks at it first), or -1. Set first: ``__del__`` reads it
        self.alive_fd = -1
        self.src = src  # None: not kept (``Express._plan``)
        self.dst = dst
        self.region = weakref.ref(region)
        self.base, self.size, self.target, self.touch = base, size, target, touch
        self.ep = target.rail.endpoint.handle
        self.epoch = -1  # looked up at first use (``_peer``)
        self.dest = 0
        self.bell: Any = None

    def forget_peer(self, _close: Callable[[int], None] = os.close) -> None:
        """Look the peer up anew at the next write (and let go of its
        segment). ``_close`` is bound here: a plan may be dropped while the
        interpreter exits, when module globals are gone."""
        self.epoch = -1
        fd, self.alive_fd = self.alive_fd, -1
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        self.forget_peer()


class Express:
    """A shard's express path (the trio thread's; one write at a time)."""

    def __init__(self, shard: Shard, max_pieces: int) -> None:
        self._shard = shard
        self._max_pieces = max_pieces
        self._cursor = ExpressCursor()
        #: (id(src), id(dst)) -> the plan of writes between them
        self._plans: dict[tuple[int, int], _Plan] = {}
        #: the express write being polled for (-1: none), and what the poller
        #: thread read of it meanwhile; written under the shard's lock
        self.tid = -1
        self.stolen = 0
        self.stolen_error: CompletionError | None = None
        #: writes that completed on this path, and that became regular ones
        self.completed = self.handed_over = 0

    def _plan(self, src: Any, dst: RegionDescriptor) -> _Plan | None:
        """The plan of a write from ``src`` to ``dst``, or None when it cannot
        go this way (more than one rail pair). Kept for numpy arrays, which
        keep their address while they live: a registered array is held by
        its registration, so it cannot be resized; a plan whose registration
        is gone or closed is made anew (which raises). A hit counts as a use
        of the registration (the cache evicts the least recently used)."""
        key = (id(src), id(dst))
        plan = self._plans.get(key)
        if plan is not None and plan.src is not None and plan.src() is src and plan.dst is dst:
            region = plan.region()
            if region is not None and not region.closed:
                plan.touch()
                return plan
        g = self._shard._group
        region, base, size = g.source(src)
        route = g.route(dst, region)
        if len(route.targets) != 1:
            return None
        kept = type(src) is np.ndarray
        plan = _Plan(weakref.ref(src) if kept else None, dst, region, base, size,
                     route.targets[0], g.cache.toucher(region))
        if kept:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()  # many buffers or peers came and went: start over
            self._plans[key] = plan
        return plan

    def _peer(self, plan: _Plan) -> int:
        """The peer's ``fi_addr_t`` (under the shard's lock), looked up when
        the rail's AV epoch moved. A failed look-up leaves the plan to look
        again. On shm the peer's segment is also looked at on every write,
        as ``Rail.peer`` does, by the post itself (``plan.alive_fd``; a
        plan not kept is looked up on its one write): libfabric 1.17's shm
        crashes the process that posts to a peer in it whose segment is
        gone, and a small write to one in a process that closed completes
        as if it had landed."""
        t = plan.target
        rail = t.rail
        av = rail.av
        if plan.epoch != av.epoch:
            epoch = av.epoch
            plan.forget_peer()
            dest = rail.peer(t.address)  # checks a shm peer's segment too
            plan.bell = rail.bell_of(t.address)
            if av.is_shm and plan.src is not None:
                # A plan not kept serves this one write, whose segment
                # ``Rail.peer`` has just looked at.
                plan.alive_fd = open_shm_segment(t.address)
            plan.dest, plan.epoch = dest, epoch
        return plan.dest

    def write(self, src: Any, dst: RegionDescriptor, scatter: ScatterList, imm: int | None,
              limit: float, budget_of: Callable[[int], int]) -> int | TransferState | None:
        """Write ``scatter`` if it can go the express way: the piece count
        once it completed, else its ``TransferState`` (a regular transfer now,
        in flight: wait for it as usual). None when it cannot go this way;
        then nothing was posted. ``limit``: seconds from now it must be done
        in (inf: no limit); ``budget_of(nbytes)``: how long to poll."""
        s = self._shard
        if s._inflight or s._inbox or type(scatter) is not ScatterList:
            return None
        n = len(scatter)
        if n > self._max_pieces:
            return None
        plan = self._plan(src, dst)
        if plan is None or scatter.max_length > s._group.max_msg:
            return None
        scatter.check_bounds(plan.size, dst.length)
        t = plan.target
        tails = False
        if imm is not None:
            s._group.check_imm(imm)
            tails = imm_tails(t.rail.imm_tail, scatter)
        posts = n << tails  # the caller's pieces, or heads and tails
        tid = s.new_tid()
        start = time.perf_counter_ns()
        got, failed = 0, None  # failed: the poll that met an error entry
        arrivals: list[tuple[int, int, int, int, int]] = []
        cursor = self._cursor
        try:
            with s._lock:
                self.tid, self.stolen, self.stolen_error = tid, 0, None
                # Under the lock: a peer address the poller thread removes
                # (``abort``) must never be posted to.
                dest = self._peer(plan)
                aim = (plan, dest, plan.bell)  # a new peer address or doorbell: aim anew
                if cursor.aimed != aim:
                    cursor.aim(aim, plan.ep, dest, plan.base, t.src_desc, t.dst_base,
                               t.dst_key, plan.bell, t.rail.group)
                # Holds the CQs first: the poller thread keeps off them.
                left = cursor.post(s._poller.handle, scatter.src, scatter.dst, scatter.length,
                                   imm, tid, tails, plan.alive_fd)
                if left == PEER_GONE:
                    self.tid = -1
                    plan.forget_peer()
                    raise shm_peer_gone(t.address)
            if not left:
                with s._cq_guard:
                    got, arrivals, failed = s._inline_poller.express_poll(
                        posts, tid, budget_of(scatter.nbytes))
            received: list[tuple[int, int]] = []
            imms: list[tuple[int, int]] = []
            if arrivals:
                received = [(rail, cnt) for rail, _ctx, _flags, _data, cnt in arrivals]
                imms = [(data, cnt) for _rail, _ctx, _flags, data, cnt in arrivals]
            if got >= posts:
                now = time.monotonic()
                with s._lock:
                    self.tid = -1
                    s.count_pieces(t.key, n, now)  # statistics count the caller's pieces
                    if received:
                        self._count_received(received)
                s.count_delivered(t.ours, n, scatter.nbytes)
                s.completed += 1
                self.completed += 1
                if imms:
                    s._imm_batches.append(imms)
                    s._deliver()
                return n
            deadline = trio.current_time() + limit - (time.perf_counter_ns() - start) / 1e9
            return self._hand_over(src, dst, scatter, imm, tid, deadline, got, bool(left), failed,
                                   received, imms)
        finally:
            s._poller.hold(False)

    def close(self) -> None:
        """Let go of every plan (and the shm segments they hold open)."""
        for plan in self._plans.values():
            plan.forget_peer()
        self._plans.clear()
        self._cursor.aimed = None

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
