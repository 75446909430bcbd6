"""The same-daemon fast path: a client's write into a region that a client of
this same daemon exported is a copy between the two shared mappings (both
mapped in this process), not a trip through a libfabric provider.

``LocalCopies`` runs a write into an ``Export`` of this daemon's clients
(``_exports``: the owner's shared memory, the span, the immediate slot):
the same checks as the fabric path (the writer's uid may write into it:
``Exports.check_writer``; the scatter list
against both sizes: ``ScatterList.check_bounds``), then ``copy_scatter`` (C,
``memmove`` per piece, no Python per piece, without the GIL), then the
immediates, routed by the region's slot (or a KV request's) through
``ImmTable.deliver`` exactly as the engine's arrivals are: counted after the
bytes are there, one per piece (or one in notify mode), so the owner sees
what a remote write of the same pieces shows it. Plain writes
(``Writes._copy``) and KV pushes into a pool of this daemon
(``_kv_push``) copy through here.

Small copies run on the trio thread (a thread hop costs more than they do);
larger ones on worker threads, and from ``PARALLEL_MIN`` on, split over
``threads`` of them like a write over rails: pieces too large to balance are
cut (``ScatterList.split``), each thread takes a contiguous range of about
equal bytes (``ScatterList.stripes``), and the reply's ``pieces`` counts the
cut pieces. A copy stops only between pieces (``CopyStop``), so a cancelled
write, or one cut short by an unexport, leaves whole pieces.

Lifetime: each copy is in its export's ``copies`` while it runs; an export
leaves the registry before it goes (``Exports.remove``, from ``unexport``
and a client's disconnect): new writes are refused at once, and copies into
it are stopped and waited for (shielded; at most the pieces in hand), so no
byte lands in the owner's memory after ``unexport`` answers and
nothing is copied into a mapping that is being retired. A copy holds buffer
exports of both mappings while it runs, so neither can be closed under it.

Where either side is device memory (``_device``), the copy is one batch of
CUDA copies on the daemon's stream, waited for on a worker thread; it is not
stopped part way (it is over in microseconds to milliseconds).

What must not live here: the fabric path (``_writes``, ``p2pxfer.engine``),
the uid rules (``_sessions``), the C loop (``p2pxfer.fabric``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import outcome
import trio

from p2pxfer.errors import UnknownRegion
from p2pxfer.log import get_logger
from p2pxfer.pages import CopyStop, copy_scatter
from p2pxfer.scatter import ScatterList

from ._device import copy_device, is_device

if TYPE_CHECKING:
    from ._exports import Exports
    from ._imms import ImmTable
    from ._sessions import ClientSession

__all__ = [
    "INLINE_MAX",
    "MAX_AUTO_THREADS",
    "PARALLEL_MIN",
    "LocalCopies",
    "auto_threads",
]

log = get_logger("p2pxfer.daemon")

#: copies of at most this many bytes run on the trio thread: a hop to a worker
#: thread and back costs 100-200 us on these machines, 256 KiB about 30 us
INLINE_MAX = 256 << 10
#: copies from this many bytes on are split over the configured threads
PARALLEL_MIN = 4 << 20
#: ``local_copy_threads = 0`` uses half the CPUs of the daemon's first NUMA
#: node, at most this many (a node's memory bandwidth is spent by a few
#: copying threads)
MAX_AUTO_THREADS = 8


def auto_threads(node_cpus: tuple[int, ...]) -> int:
    """Threads for ``local_copy_threads = 0``: half the CPUs of the daemon's
    node (else of those it may run on), at least 1, at most MAX_AUTO_THREADS.
    Half, because the clients and the engine's pollers run there too: on a
    2-CPU machine, 2 copy threads moved 64 MiB at 0.65-0.66 of memcpy, 1 at
    0.83-0.93 (``bench/same_daemon.py``, two runs)."""
    n = len(node_cpus) or len(os.sched_getaffinity(0))
    return max(1, min(n // 2, MAX_AUTO_THREADS))


@dataclass(eq=False)
class _Copy:
    """One copy running into a target."""

    stop: CopyStop = field(default_factory=CopyStop)
    done: trio.Event = field(default_factory=trio.Event)


class LocalCopies:
    """Copies into this daemon's clients' exports."""

    def __init__(self, node: str, exports: Exports, imm_slots: Callable[[], ImmTable], *,
                 enabled: bool, threads: int) -> None:
        self.node = node
        self.exports = exports
        self._imm_slots = imm_slots
        self.enabled = enabled
        self.threads = max(1, threads)
        self.writes = 0  # copies that ran (whole or stopped)
        self.pieces = 0  # pieces copied
        self.bytes = 0  # bytes asked of the copies that finished whole
        self.stopped = 0  # copies cut short by an unexport

    def statistics(self) -> dict[str, Any]:
        """For ``status``: whether the fast path is on, and what it copied."""
        return {"enabled": self.enabled, "threads": self.threads, "writes": self.writes,
                "pieces": self.pieces, "bytes": self.bytes, "stopped": self.stopped}

    # -- copies -------------------------------------------------------------------------

    async def write(self, writer: ClientSession, src: Any, scatter: ScatterList,
                    region: str, imm: int | None, notify: bool = False, *,
                    slot: int | None = None) -> int:
        """Copy ``scatter`` from ``src`` into this daemon's export ``region``;
        the pieces written (each carrying ``imm`` to the region's owner), or
        with ``notify`` 1: ``imm`` counted once, when every piece is there
        (never for a write stopped part way, as the engine's notify mode).
        ``slot``: the immediate slot ``imm`` is counted under, where not the
        region's own (a KV push's request slot, ``kv_begin``).
        ``UnknownRegion`` if no client of this daemon exports it, or none the
        writer's uid may write into, or when it is unexported before the copy
        is over; ``ScatterError`` for a piece outside either buffer.

        Cancellation: stops between pieces, waits for the pieces in hand,
        counts their immediates, then raises: ``src`` is no longer read."""
        target = self.exports.get(region)
        if target is None:
            raise self.exports.absent(region, writer.uid, writer.privileged)
        writer.may_write_into(region)
        scatter.check_bounds(len(src), target.length)
        slots = self._imm_slots()
        full_imm = None if imm is None else slots.compose(
            target.slot if slot is None else slot, imm)
        dst = target.mem.view(target.offset, target.length)
        device = is_device(dst) or is_device(src)
        sl, parts = (scatter, [(0, len(scatter))]) if device else self._plan(scatter)
        copy = _Copy()
        target.copies.add(copy)
        counts = [0] * len(parts)
        try:
            if device:  # one batch on the GPU's copy engines; not stopped part way
                counts[0] = await self._on_device(dst, src, sl)
            elif scatter.nbytes <= INLINE_MAX:
                counts[0] = copy_scatter(dst, src, sl.src, sl.dst, sl.length, 0, len(sl),
                                         copy.stop)
            else:
                assert isinstance(dst, memoryview)  # device memory went the GPU's way
                await self._in_threads(dst, src, sl, parts, copy.stop, counts)
        finally:
            done = sum(counts)
            target.copies.discard(copy)
            self.writes += 1
            self.pieces += done
            if full_imm is not None and done and not notify:
                slots.deliver(full_imm, done)
            elif full_imm is not None and notify and done == len(sl):
                slots.deliver(full_imm, 1)
            copy.done.set()
        if done < len(sl):
            self.stopped += 1
            raise UnknownRegion(f"region {region!r} on {self.node} was unexported during "
                                f"the write ({done} of {len(sl)} pieces landed)")
        self.bytes += scatter.nbytes
        return 1 if notify else len(sl)

    async def _on_device(self, dst: Any, src: Any, sl: ScatterList) -> int:
        """``copy_device`` on a worker thread, each device memory's share
        marked busy meanwhile: its client cannot give it back (``unshare``)
        under the copy."""
        shares = [v.owner for v in (dst, src) if is_device(v)]
        for share in shares:
            share.busy += 1
        try:
            return await trio.to_thread.run_sync(copy_device, dst, src, sl)
        finally:
            for share in shares:
                share.busy -= 1

    def _plan(self, scatter: ScatterList) -> tuple[ScatterList, list[tuple[int, int]]]:
        """The pieces to copy and each thread's contiguous range of them."""
        if self.threads == 1 or scatter.nbytes < PARALLEL_MIN:
            return scatter, [(0, len(scatter))]
        sl, ranges = scatter.stripe(self.threads)  # as the engine stripes over rails
        return sl, [(a, b) for a, b in ranges if b > a]

    async def _in_threads(self, dst: memoryview, src: memoryview, sl: ScatterList,
                          parts: list[tuple[int, int]], stop: CopyStop,
                          counts: list[int]) -> None:
        """Each part on a thread of trio's cache; returns once every one has
        returned (cancelled: after setting ``stop``), filling ``counts``."""
        token = trio.lowlevel.current_trio_token()
        results: list[outcome.Outcome[int] | None] = [None] * len(parts)
        left = len(parts)
        finished = trio.Event()

        def one_done(i: int, result: outcome.Outcome[int]) -> None:  # trio thread
            nonlocal left
            results[i] = result
            if isinstance(result, outcome.Error):
                stop.set()  # the others stop too: the write fails as a whole
            left -= 1
            if left == 0:
                finished.set()

        def reporter(i: int) -> Callable[[outcome.Outcome[int]], None]:
            def report(result: outcome.Outcome[int]) -> None:  # the worker thread
                token.run_sync_soon(one_done, i, result)
            return report

        for i, (a, b) in enumerate(parts):
            trio.lowlevel.start_thread_soon(
                functools.partial(copy_scatter, dst, src, sl.src, sl.dst, sl.length, a, b,
                                  stop),
                reporter(i),
                name=f"p2pxfer local copy {i}")
        try:
            await finished.wait()
        except trio.Cancelled:
            stop.set()
            with trio.CancelScope(shield=True):
                await finished.wait()
            raise
        finally:
            for i, r in enumerate(results):
                if isinstance(r, outcome.Value):
                    counts[i] = r.value
        for r in results:
            if isinstance(r, outcome.Error):
                r.unwrap()
