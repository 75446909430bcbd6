"""``Transfer``: a submitted write, and how waiting for it ends (completed,
failed, past its deadline, cancelled, aborted). What must not live here:
posting or counting completions (the shard's), choosing a shard (the
engine's).
"""

from __future__ import annotations

import time

import trio

from p2pxfer.log import get_logger
from p2pxfer.memory import RegionDescriptor

from ._shard import Shard
from ._state import TransferState

__all__ = ["YIELD_EVERY_NS", "Transfer"]

log = get_logger("p2pxfer.engine")

# A write that completed without waiting still passes through the scheduler
# when the engine has not yielded for this long (see ``Transfer.wait``).
YIELD_EVERY_NS = 1_000_000


class _YieldClock:
    """When the engine's writes last went through the scheduler (see
    ``Transfer.wait``), shared by the engine and its transfers."""

    def __init__(self) -> None:
        self.yielded_ns = 0

    def mark(self) -> None:
        self.yielded_ns = time.perf_counter_ns()

    async def maybe_yield(self) -> None:
        now = time.perf_counter_ns()
        if now - self.yielded_ns >= YIELD_EVERY_NS:
            self.yielded_ns = now
            await trio.lowlevel.cancel_shielded_checkpoint()


#: how long a cancelled write under way may take to end when drained
#: (``Transfer.wait``): a KV layer's remaining pieces, then its notification
DRAIN_S = 5.0


class Transfer:
    """A submitted write. ``await wait()`` for its completion."""

    def __init__(self, clock: _YieldClock, shard: Shard, tr: TransferState,
                 dst: RegionDescriptor, grace_s: float = 1.0) -> None:
        self._clock = clock
        self._grace_s = grace_s
        self._shard = shard
        self._tr = tr
        self._dst = dst

    @property
    def pieces(self) -> int:
        """Pieces this write posts (each carrying its immediate, unless in
        notify mode; a piece sent as head and tail, ``imm_tails``, counts
        once)."""
        return self._tr.w.written

    @property
    def imms(self) -> int:
        """How many immediates the receiver counts for this write: 1 in
        notify mode, the piece count with per-piece immediates, else 0."""
        return self._tr.w.imms

    @property
    def nbytes(self) -> int:
        return self._tr.w.nbytes

    @property
    def done(self) -> bool:
        return self._tr.done.is_set()

    def cancel(self, *, drain: bool = False) -> None:
        """Stop posting this write's remaining pieces (those posted still
        complete); :meth:`wait` then raises ``TransferError``. With
        ``drain``, only a write none of which was posted yet stops; one
        under way goes on to its end, so that everything it posted has
        landed once it ends (a completion alone says that only where the
        provider places one peer's writes in order and the write's tail or
        notification was delivery-complete)."""
        if not self._tr.done.is_set():
            self._shard.cancel(self._tr, drain=drain)

    def abort(self, reason: str) -> None:
        """Give this write up now, without waiting for its posted pieces: the
        connections carrying them are torn down (other writes with pieces in
        flight on them fail too), and :meth:`wait` raises ``TransferAborted``
        saying ``reason`` and how many pieces were acknowledged. For a peer
        known dead (membership's verdict). No-op once done."""
        self._shard.abort(self._tr, reason)

    async def wait(self, *, drain: bool = False) -> int:
        """Return the piece count once every piece completed; raise
        ``TransferError``/``EngineClosed`` if one failed, ``TransferTimeout``
        when its deadline passed first (the write is torn down, see
        :meth:`abort`). Cancellation stops posting, waits (shielded) up to
        ``EngineConfig.cancel_grace_s`` for what was posted, tears down what
        is still in flight after that, then re-raises: either way nothing of
        it is posted any more when this returns or raises. With ``drain``,
        cancellation is :meth:`cancel` ``(drain=True)``: a write under way
        gets up to ``DRAIN_S`` (or the grace, if longer) to end.

        A transfer already complete returns without a trip through the
        scheduler, unless the engine has not yielded for ``YIELD_EVERY_NS``:
        a small write's latency is mostly scheduler rounds on small machines,
        and the budget still keeps a loop of such writes from starving other
        tasks."""
        tr, shard = self._tr, self._shard
        if tr.done.is_set():
            # Done already: at most a schedule point, never a cancellation of
            # a write that has in fact completed.
            await self._clock.maybe_yield()
        else:
            try:
                with trio.move_on_at(tr.deadline):
                    await tr.done.wait()
                if not tr.done.is_set():
                    shard.abort(tr, "timed out: its deadline passed", timed_out=True)
                    with trio.CancelScope(shield=True):
                        await tr.done.wait()
            except trio.Cancelled:
                shard.cancel(tr, drain=drain)
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(max(self._grace_s, DRAIN_S) if drain
                                            else self._grace_s):
                        await tr.done.wait()
                    if not tr.done.is_set():
                        waited = max(self._grace_s, DRAIN_S) if drain else self._grace_s
                        shard.abort(tr, f"was cancelled and its posted pieces did not "
                                        f"finish within {waited:g} s")
                        await tr.done.wait()
                raise
            finally:
                self._clock.mark()
        if (exc := tr.exception()) is not None:
            raise exc
        log.debug("transfer.complete", transfer_id=tr.w.tid, nbytes=tr.w.nbytes,
                  pieces=tr.w.written, peer=self._dst.node, region=self._dst.name)
        return tr.w.written
