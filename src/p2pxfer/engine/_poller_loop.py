"""The poller thread of one shard: its loop, the commands it takes from the
trio thread, posting what waits, and how long it spins and sleeps.

It owns the shard's CQs (pplx-garden's worker model): each turn takes the
inbox's commands, posts the destinations' queue heads within their bounds,
then drains the CQs in one C call (spinning, then sleeping on the wait fds or
a back-off) and absorbs what it read under the shard's lock. Completions and
immediates go back to trio through the shard (``Shard._flush``).

What must not live here: validation, the trio side (``Shard``), deciding
failover (``Failover``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from p2pxfer._sigmask import main_thread_signals
from p2pxfer.errors import P2PXferError

if TYPE_CHECKING:
    from ._shard import Shard
    from ._state import TransferState

__all__ = ["PollerLoop"]

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
CLOSE_DRAIN_NS = 20_000_000  # at close, progress this long first (``_shutdown``)
#: at close, wait at most this long for the pieces already posted to complete
#: (a silent peer's never do)
CLOSE_FLUSH_S = 2.0
# A turn this much longer than its nap means the thread was not scheduled.
STARVED_SLACK_S = 0.05


class PollerLoop:
    """The poller thread of ``shard`` (``run`` is the thread's body)."""

    def __init__(self, shard: Shard) -> None:
        self._s = shard

    def run(self) -> None:
        """The thread's body: commands, posting, polling, until ``stop``."""
        s = self._s
        # The thread comes from trio's cache and goes back to it: pinned for
        # our loop only, then as it was.
        before = os.sched_getaffinity(0)
        if s._pin and s.topo.cpus:  # the node's CPUs, not one core
            os.sched_setaffinity(0, s.topo.cpus)
        try:
            with main_thread_signals():  # Ctrl-C wakes the caller, not this thread
                self._loop()
        except BaseException as exc:
            # A bug killed this loop: nothing on the shard would be posted or
            # completed again, and its writers would wait for ever. They fail
            # now, naming it (the engine refuses new writes: ``thread_error``).
            self._fail_all(f"the shard's poller thread failed: {exc!r}")
            raise
        finally:
            if s._pin and s.topo.cpus:
                os.sched_setaffinity(0, before)

    def _loop(self) -> None:
        s = self._s
        poller = s._poller
        turn = time.monotonic()  # when the last turn ended
        while True:
            with s._lock:
                if s._inbox and self._take_commands():
                    break
            busy = self._post_pending()
            with s._lock:
                need = min((tr.remaining for tr in s._inflight.values()), default=1)
                if s._queues:  # room to post opens with half a peer's bound back
                    need = max(1, min(need, s._queues.bound // 2))
            s._flush()
            # Outside the lock: spin, then sleep, gathering in C what the closest
            # transfer still needs (each return to Python is a GIL round with trio).
            spin, nap = self._pace()
            c = poller.progress(spin_ns=0 if busy else spin,
                                timeout_ns=0 if busy else nap, min_entries=need)
            with s._lock:
                s._absorb(c)
                now = time.monotonic()
                # A turn that took far longer than its nap: this thread was
                # not scheduled (a busy host) and read nothing meanwhile. No
                # rail pair is blamed for that time.
                lost = now - turn - (0 if busy else nap) / 1e9 - STARVED_SLACK_S
                if lost > 0:
                    s._health.forgive(lost)
                turn = now
                if len(c):
                    s._recent = now
                s._failover.run_pending(now)  # pairs pieces failed on: fail over
                if now >= s._next_check:  # rail pairs that stalled: fail over
                    s._next_check = now + s._health.stall_s / 10
                    s._failover.check(now)
            s._flush()
        self._shutdown()

    def _pace(self) -> tuple[int, int]:
        """How long the next poll spins after the last activity, and how long
        it may last in all; sets the back-off cap where CQs have no wait fd.

        Without CQ wait fds (shm) a nap delays every completion and arrival:
        with transfers in flight, or within LINGER_S of the last arrival (a
        writer's loop), spin longer first.
        With wait fds (tcp) the same holds for a target in a writer's loop: a
        thread woken from ppoll answers tens of microseconds late, so within
        LINGER_S of the last completion it spins FD_LINGER_SPIN_NS after each.
        Deep idle (no completion for DEEP_IDLE_S, nothing in flight): it comes
        back to Python seldom (the fds and the wake fd still wake it at once;
        reset connections' knocks wait that long) and, without wait fds, naps
        up to DEEP_IDLE_NAP_NS, which the first arrival after such a pause may
        wait: every wake-up of an idle daemon costs CPU."""
        s = self._s
        spin, nap = s._spin_ns, s._idle_ns
        quiet = time.monotonic() - s._recent
        recent = quiet < LINGER_S
        deep = not s._inflight and quiet > DEEP_IDLE_S
        if s._inflight:
            nap = min(nap, INFLIGHT_NAP_NS)
        elif deep:
            nap = max(nap, DEEP_IDLE_RETURN_NS)
        if s._blocks_on_fds:
            if recent:
                spin = max(spin, FD_LINGER_SPIN_NS)
        else:
            if s._inflight or recent:
                spin = max(spin, INFLIGHT_SPIN_NS)
            s._poller.backoff_max_ns = (max(s._backoff_max_ns, DEEP_IDLE_NAP_NS) if deep
                                        else s._backoff_max_ns)
        return spin, nap

    def _take_commands(self) -> bool:
        s = self._s
        while s._inbox:
            # Peek, act, then pop: the trio thread (checking both before
            # posting directly) never sees inbox and queue empty while a write
            # is due: writes go out in submission order.
            what, tr = s._inbox[0]
            if what == "stop":
                s._inbox.popleft()
                return True
            assert tr is not None
            if what == "write":
                if tr.dry_run:
                    tr.remaining -= tr.w.batch.cancel()
                    s._finish_if_done(tr)
                else:
                    s._queues.push(tr)
            elif what in ("cancel", "drain"):
                # Drained: only a write none of which went out stops here; one
                # under way goes on to its end (its notification too), so what
                # it posted lands before it ends (``Shard.cancel``).
                under_way = what == "drain" and any(tr.w.batch.posted_by_cursor())
                if not under_way and s._queues.remove(tr):
                    tr.cancel_requested = True
                    never = tr.w.batch.cancel()
                    tr.w.batch.unposted_at_cancel += never  # a second cancel adds 0
                    tr.remaining -= never
                    if tr.w.batch.posted:
                        s._finish_if_done(tr)
                    else:
                        # A head went out and its tail did not (its TX queue
                        # was full, ``P2P_IMM_TAILS``): the tail still goes,
                        # so what landed is whole pieces, each counted.
                        s._queues.push_front(tr)
            elif what == "abort":
                s._failover.abort(tr)
            s._inbox.popleft()
        return False

    def _post_pending(self) -> bool:
        """Post what waits, per destination in submission order (KV layers
        must land in order), destinations in turn, each within its bound of
        pieces in flight (``DestQueues``). True if some write could post more
        right now (a TX queue was full); False when every waiting write waits
        for its peer's completions. The C call runs outside the lock."""
        s = self._s
        poller, busy = s._poller, False
        with s._lock:  # the trio thread queues notifications (new destinations)
            heads = s._queues.heads()
        for head in heads:
            tr: TransferState | None = head
            while tr is not None:
                batch = tr.w.batch
                with s._lock:
                    batch.refresh()  # after a teardown, post to the new connection
                    can = batch.window(s._queues.room(tr))
                c = poller.post(batch) if can else None
                # Outside the lock: asking a stalled peer may take a moment.
                gone = None if batch.posted else tr.stall.check(batch)
                with s._lock:
                    s._queues.note_posted(tr)
                    if c is not None:
                        s._absorb(c)
                    if tr.error is not None:
                        tr.remaining -= batch.cancel()  # stop posting after a failure
                    if not batch.posted:
                        if gone is None:
                            busy = busy or batch.window(s._queues.room(tr))
                            break
                        # Its peer is gone: what is not posted never will be.
                        tr.gone = gone
                        tr.remaining -= batch.cancel()
                    nxt = s._queues.next_after(tr)
                    if failures := batch.failures():
                        tr.error = tr.error or "; ".join(failures)
                        # A failed post counts in what cancel() reports as never posted.
                        tr.remaining -= batch.cancel()
                    s._finish_if_done(tr)
                tr = nxt
        return busy

    def _fail_all(self, error: str | None) -> None:
        """End every write in flight or queued: closed with the engine
        (``error`` None), or failed with ``error``."""
        s = self._s

        def end(tr: TransferState) -> None:
            if error is None:
                tr.closed = True
            else:
                tr.error = tr.error or error
            s._finished.append(tr)

        with s._lock:
            for tr in list(s._inflight.values()):
                tr.w.batch.cancel()
                end(tr)
            s._inflight.clear()
            s._queues.clear()
            while s._inbox:
                what, queued = s._inbox.popleft()
                if what == "write" and queued is not None:
                    end(queued)

    def _shutdown(self) -> None:
        """The engine is closing: stop posting, let the pieces already posted
        complete (at most ``CLOSE_FLUSH_S``), then fail everything still
        queued or in flight with ``EngineClosed``, then progress a moment
        (what it reads is dropped). A connection closed in the middle of a
        message leaves the peer's ofi_rxm receiving it for ever, and
        libfabric 1.17 dies (NULL dereference) in ``fi_close`` of that
        peer's endpoint: a peer engine closed later crashed its process."""
        s = self._s
        with s._lock:
            for tr in s._inflight.values():
                tr.closed = True
                # No notification goes out either (``_finish_if_done``).
                tr.error = tr.error or "the engine closed"
                tr.remaining -= tr.w.batch.cancel()
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while time.monotonic() < deadline:
            with s._lock:
                left = sum(max(tr.remaining, 0) for tr in s._inflight.values())
            if not left:
                break
            try:
                c = s._poller.progress(spin_ns=s._spin_ns, timeout_ns=INFLIGHT_NAP_NS,
                                       min_entries=left)
            except P2PXferError:
                break  # closing anyway
            with s._lock:
                s._absorb(c)
        self._fail_all(None)
        with contextlib.suppress(P2PXferError):  # closing anyway
            s._poller.progress(spin_ns=0, timeout_ns=CLOSE_DRAIN_NS, min_entries=1 << 30)
