"""Posting queues of one shard: FIFO per destination, round-robin across them,
and a bound on the pieces in flight to each destination over each rail.

A destination is the set of a peer's rail addresses (``PreparedWrite.dest``):
every region of one peer engine shares it. Writes to one destination go out
in submission order (a KV pool's layers land in order), but a write to a
stalled or dead peer never holds back writes to any other: each destination
has its own queue, and the poller posts their heads in turn. The bound keeps
one stalled peer from filling a rail's whole TX queue (tcp;ofi_rxm: 2048
operations per endpoint), which would stall every peer on that rail.

Used by the poller thread (and the trio thread posting a small write
directly), always under the shard's lock; ``tear_down`` removes a peer's
endpoint from the rails (``Rail.disconnect``). What must not live here: posting, reading
CQs, or anything per piece.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from p2pxfer.log import get_logger

if TYPE_CHECKING:
    from ._owner import ShardLock
    from ._state import TransferState

__all__ = ["DestQueues"]

log = get_logger("p2pxfer.engine")

Dest = tuple[bytes, ...]


class DestQueues:
    """Transfers waiting to be fully posted, one FIFO per destination, and the
    pieces in flight per (destination, rail)."""

    def __init__(self, bound: int, lock: ShardLock) -> None:
        #: most pieces in flight to one destination over one rail
        self.bound = bound
        self._lock = lock
        self._queues: dict[Dest, deque[TransferState]] = {}
        self._turn = 0
        self._inflight: dict[tuple[Dest, int], int] = {}
        #: notify-mode writes per destination, in submission order
        self._notifiers: dict[Dest, deque[TransferState]] = {}

    def __bool__(self) -> bool:
        return bool(self._queues)

    def push(self, tr: TransferState) -> None:
        self._lock.require("DestQueues.push")
        self._queues.setdefault(tr.w.dest, deque()).append(tr)

    def push_front(self, tr: TransferState) -> None:
        """Queue ``tr`` ahead of its destination's writes that have not
        started, behind those already under way (their notification, pieces
        moved off a failed rail pair): two KV layers' notifications queued
        this way went out last-first, and layer 6 was seen before layer 5."""
        self._lock.require("DestQueues.push_front")
        q = self._queues.setdefault(tr.w.dest, deque())
        i = 0
        while i < len(q) and q[i].under_way:
            i += 1
        q.insert(i, tr)
        tr.under_way = True

    def under_way(self, dest: Dest) -> bool:
        """A write to ``dest`` already under way waits to be posted: what
        follows it (another notification) must wait too."""
        q = self._queues.get(dest)
        return q is not None and bool(q) and q[0].under_way

    def is_head(self, tr: TransferState) -> bool:
        q = self._queues.get(tr.w.dest)
        return q is not None and bool(q) and q[0] is tr

    def holds(self, tr: TransferState) -> bool:
        q = self._queues.get(tr.w.dest)
        return q is not None and tr in q

    def waiting_for(self, dest: Dest) -> bool:
        """Something to ``dest`` is not fully posted yet."""
        return dest in self._queues

    def remove(self, tr: TransferState) -> bool:
        self._lock.require("DestQueues.remove")
        q = self._queues.get(tr.w.dest)
        if q is None or tr not in q:
            return False
        q.remove(tr)
        if not q:
            del self._queues[tr.w.dest]
        return True

    def heads(self) -> list[TransferState]:
        """The first transfer of every destination, starting one further each
        call: no destination is always served first."""
        heads = [q[0] for q in self._queues.values()]
        if len(heads) > 1:
            self._turn = (self._turn + 1) % len(heads)
            heads = heads[self._turn:] + heads[:self._turn]
        return heads

    def next_after(self, tr: TransferState) -> TransferState | None:
        """Drop ``tr`` (fully posted) from its queue's head; the next one."""
        q = self._queues.get(tr.w.dest)
        if q is None:
            return None
        if q and q[0] is tr:
            q.popleft()
        if not q:
            del self._queues[tr.w.dest]
            return None
        return q[0]

    def clear(self) -> None:
        self._lock.require("DestQueues.clear")
        self._queues.clear()
        self._notifiers.clear()

    # -- notification order ------------------------------------------------------
    # Notifications to one destination go out in the order their writes were
    # submitted: each write's goes once its data is acknowledged, and with
    # several in flight on a fresh tcp;ofi_rxm connection the acknowledgements
    # can come out of order (a KV layer would be counted before the one
    # before it: ``test_layers_land_in_order``).

    def will_notify(self, tr: TransferState) -> None:
        """``tr`` (notify mode) was submitted: it notifies after those before it."""
        self._lock.require("DestQueues.will_notify")
        self._notifiers.setdefault(tr.w.dest, deque()).append(tr)

    def notify_turn(self, tr: TransferState) -> bool:
        """No earlier write to ``tr``'s destination still has to notify."""
        q = self._notifiers.get(tr.w.dest)
        return q is None or q[0] is tr

    def notified(self, tr: TransferState) -> TransferState | None:
        """``tr`` sent its notification or ended without one; returns the
        write whose turn it is now, if ``tr`` was the one holding it."""
        self._lock.require("DestQueues.notified")
        q = self._notifiers.get(tr.w.dest)
        if q is None or tr not in q:
            return None
        head = q[0] is tr
        q.remove(tr)
        if not q:
            del self._notifiers[tr.w.dest]
            return None
        return q[0] if head else None

    def tear_down(self, tr: TransferState, inflight: list[TransferState],
                  ) -> tuple[list[TransferState], list[str], dict[int, int]]:
        """Give ``tr`` up (see ``Shard.abort``): disconnect its peer from
        the rails that carry its pieces (``Rail.disconnect``: their TCP
        connections are reset, dropping what is queued on them), and with it
        every write in ``inflight`` to the same destination that has pieces
        in flight on them. Returns the
        transfers now finished (``tr`` first), the connections torn down and
        the pieces abandoned per rail."""
        self._lock.require("DestQueues.tear_down")
        doomed = [tr] + [o for o in inflight if o is not tr and o.w.dest == tr.w.dest
                         and any(n > 0 for n in o.outstanding.values())]
        links = {(rail, address) for o in doomed for rail, address in o.w.batch.peers
                 if address}
        names = []
        for rail, address in links:
            names.append(f"{rail.name}->{rail.av.straddr(address)}")
            try:
                reset = rail.disconnect(address)
            except Exception as exc:  # keep failing the transfers; say what went wrong
                log.warning("transfer.teardown_failed", connection=names[-1],
                            error=str(exc))
            else:
                if reset:
                    names[-1] += f" (reset {', '.join(reset)})"
        lost: dict[int, int] = {}
        for o in doomed:
            o.w.batch.cancel()
            self.remove(o)
            for r, n in self.drop(o).items():
                lost[r] = lost.get(r, 0) + n
            if o is not tr:
                o.aborted = (f"failed: its connection was torn down when write "
                             f"{tr.w.tid} to the same peer was given up ({tr.aborted})")
            o.remaining = 0
        return doomed, sorted(names), lost

    # -- pieces in flight -------------------------------------------------------

    def room(self, tr: TransferState) -> list[int]:
        """Per cursor of ``tr``'s batch, how many more pieces it may post;
        cursors on one rail share that rail's room in turn."""
        dest, b = tr.w.dest, tr.w.batch
        left: dict[int, int] = {}
        out = []
        for i, posted in enumerate(b.posted_by_cursor()):
            rail = b.rails[i]
            have = left.get(rail)
            if have is None:
                have = max(self.bound - self._inflight.get((dest, rail), 0), 0)
            take = min(have, b.ends[i] - b.starts[i] - posted)
            out.append(take)
            left[rail] = have - max(take, 0)
        return out

    def note_posted(self, tr: TransferState) -> None:
        """Count what ``tr``'s cursors posted since the last call."""
        self._lock.require("DestQueues.note_posted")
        now = tr.w.batch.posted_by_cursor()
        for i, rail in enumerate(tr.w.batch.rails):
            d = now[i] - tr.seen[i]
            if d:
                tr.seen[i] = now[i]
                self._add(tr, rail, d)

    def note_done(self, tr: TransferState, rail: int, n: int) -> None:
        """``n`` of ``tr``'s pieces on ``rail`` completed or failed."""
        self._lock.require("DestQueues.note_done")
        self._add(tr, rail, -n)

    def drop(self, tr: TransferState) -> dict[int, int]:
        """Forget ``tr``'s pieces still in flight (torn down with their
        connection); returns them per rail."""
        self._lock.require("DestQueues.drop")
        lost = {r: n for r, n in tr.outstanding.items() if n > 0}
        for rail, n in lost.items():
            self._add(tr, rail, -n)
        return lost

    def _add(self, tr: TransferState, rail: int, n: int) -> None:
        tr.outstanding[rail] = tr.outstanding.get(rail, 0) + n
        key = (tr.w.dest, rail)
        v = self._inflight.get(key, 0) + n
        if v:
            self._inflight[key] = v
        else:
            self._inflight.pop(key, None)
