"""The engine: shards per NUMA node (opened by ``_open.py``).

Public calls raise plain ``P2PXferError`` subclasses, never exception
groups. Every method runs on the trio thread that opened the engine.

What lives here: routing writes to shards, immediates (counts, waiters,
routes) and statistics. What must not: posting, polling or counting
completions (the shards'), and reaching into a shard's rails, cache or
poller (ask the shard).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import trio

from p2pxfer.errors import (
    EngineClosed,
    InvalidArgument,
    TransferTimeout,
    UnregisteredMemory,
)
from p2pxfer.fabric import Rail
from p2pxfer.log import get_logger
from p2pxfer.memory import (
    LocalRegion,
    RailDescriptor,
    RegionDescriptor,
    buffer_span,
    numa_node_of,
)
from p2pxfer.scatter import ScatterList
from p2pxfer.topology import Shard as ShardTopology
from p2pxfer.topology import Topology

from ._config import EngineConfig, EngineStats
from ._express import alone_budget_ns
from ._imms import Immediates
from ._plan import Source
from ._shard import Shard
from ._state import NicStats, TransferState
from ._transfer import Transfer, _YieldClock

__all__ = ["Engine", "EngineConfig", "EngineStats", "NicStats", "Transfer"]

log = get_logger("p2pxfer.engine")

class Engine:
    """Many trio tasks' transfers over every NIC of the machine. Use
    :func:`open_engine`; do not construct directly."""

    def __init__(self, config: EngineConfig, topology: Topology) -> None:
        self.config = config
        self.topology = topology
        self.shards: list[Shard] = []
        self._arrivals = Immediates(self._pull_imms)
        self._exports: dict[str, Any] = {}
        #: per-engine state of layers above (e.g. the KV receiver), by name
        self.attachments: dict[str, Any] = {}
        self._closed = False
        #: set by a process that exits right after closing the engine (the
        #: daemon): ``Rail.close`` then leaves what crashes libfabric to exit
        self.process_exits = False
        self._clock = _YieldClock()
        self._alone_budget = functools.partial(alone_budget_ns, config)

    # -- memory ---------------------------------------------------------------

    def register(self, obj: Any, *, writable: bool = False,
                 numa_node: int | None = None) -> None:
        """Register ``obj`` as a source of writes (local access only; cached:
        registering twice is free) on one shard: the one on ``numa_node``, else
        on the NUMA node of ``obj``'s first page, else the shard with the
        fewest registered bytes. Writes from ``obj`` then go through that
        shard's NICs. ``writable`` checks that ``obj`` could back an export."""
        self._check_open()
        if numa_node is None and len(self.shards) > 1:
            # Already a source somewhere (its pages may have moved or been
            # touched since): keep it there rather than register it twice.
            span = buffer_span(obj)
            for shard in self.shards:
                if shard.memory.lookup(span) is not None:
                    shard.memory.register(obj, writable=writable)  # counts the hit, checks writable
                    return
        shard = self._home(obj, numa_node)
        region = shard.memory.register(obj, writable=writable)
        region.numa_node = shard.memory.numa_node

    def _home(self, obj: Any, numa_node: int | None) -> Shard:
        """The shard that registers ``obj`` as a source (see :meth:`register`)."""
        if len(self.shards) == 1:
            return self.shards[0]
        if numa_node is not None and (not isinstance(numa_node, int)
                                      or isinstance(numa_node, bool)):
            raise InvalidArgument(f"numa_node must be an integer, got {numa_node!r}")
        node = numa_node if numa_node is not None else numa_node_of(buffer_span(obj).address)
        for shard in self.shards:
            if shard.memory.numa_node == node:
                return shard
        return min(self.shards, key=lambda s: s.memory.registrations().nbytes)

    def export(self, obj: Any, name: str, *, numa_node: int | None = None) -> RegionDescriptor:
        """Register exactly ``obj``'s span for remote writes on every NIC of
        every shard, with keys of its own (a second export of the same memory
        gets other keys), and return the descriptor peers write through. The
        memory is also registered, pinned, as a source on its home shard (see
        :meth:`register`) until :meth:`unexport`."""
        self._check_open()
        if not name or not isinstance(name, str):
            raise InvalidArgument(f"region name must be a non-empty string, got {name!r}")
        if name in self._exports:
            raise InvalidArgument(f"a region named {name!r} is already exported")
        home = self._home(obj, numa_node)
        rails: list[RailDescriptor] = []
        length = 0
        done: list[Shard] = []
        try:
            for shard in self.shards:
                d = shard.memory.export(obj, name, local=shard is home)
                done.append(shard)
                rails.extend(d.rails)
                length = d.length
        except BaseException:
            for shard in done:
                shard.memory.unexport(name)
            raise
        self._exports[name] = obj
        log.info("region.exported", region=name, nbytes=length, rails=len(rails))
        return RegionDescriptor(name, length, tuple(rails), self.config.node_name,
                                self.config.incarnation)

    def unexport(self, name: str) -> None:
        """Close the region's registrations before returning: a write through
        a descriptor handed out earlier fails from now on (on providers that
        check keys; shm does not)."""
        self._unexport(name, linger=False)

    def unexport_later(self, name: str) -> Callable[[], None] | None:
        """Free ``name`` at once (it may be exported again; the memory may be
        deregistered) but keep the export's keys taking writes until the
        returned function is called; None, having closed them now, where a
        rail's NIC writes into pinned pages (``Rail.keys_are_virtual``
        false: there only a closed key keeps a late write out of the memory).

        The caller must put the exported pages out of everyone's sight
        before anyone may reuse them (the daemon swaps private pages in
        under the export's own mapping): a peer's write still on its way
        then lands there harmlessly. Through a closed key, tcp's provider
        takes such a write for a protocol error and drops the whole
        connection: every write queued behind it to this engine is lost
        though its writer was told it completed, and those posted before
        the writer's side notices fail with "Broken pipe"."""
        return self._unexport(name, linger=True)

    def _unexport(self, name: str, *, linger: bool) -> Callable[[], None] | None:
        if self._exports.pop(name, None) is None:
            raise InvalidArgument(f"no region named {name!r} is exported")
        linger = linger and all(shard.memory.keys_are_virtual for shard in self.shards)
        closers = [shard.memory.unexport_later(name) for shard in self.shards]
        log.info("region.unexported", region=name, keys="lingering" if linger else "closed")

        def close() -> None:
            for closer in closers:
                closer()

        if not linger:
            close()
            return None
        return close

    def deregister(self, obj: Any) -> None:
        """Drop ``obj``'s registration on every shard now (it must not be
        exported, nor the source of a write in flight)."""
        self._check_open()
        for shard in self.shards:
            shard.memory.deregister(obj)

    def exported(self) -> dict[str, int]:
        """Exported region names and their sizes."""
        return {name: buffer_span(obj).nbytes for name, obj in self._exports.items()}

    def export_kinds(self) -> dict[str, str]:
        """Exported region names and the memory each is: "host", or "cuda"
        (device memory registered as is, FI_HMEM)."""
        return {name: "host" if buffer_span(obj).device < 0 else "cuda"
                for name, obj in self._exports.items()}

    # -- transfers ------------------------------------------------------------

    @property
    def imm_bits(self) -> int:
        """How wide an immediate may be: the narrowest any rail carries (EFA and
        verbs carry 32 bits, tcp and shm 64), or ``EngineConfig.imm_bytes``."""
        bits = min(s.memory.imm_bits for s in self.shards)
        return min(bits, 8 * self.config.imm_bytes) if self.config.imm_bytes else bits

    def _check_imm_cap(self, imm: object) -> None:
        if self.config.imm_bytes and isinstance(imm, int) and imm >> self.imm_bits:
            raise InvalidArgument(f"immediate {imm!r} does not fit in {self.imm_bits} bits "
                                  f"(imm_bytes = {self.config.imm_bytes})")

    def _capped(self, imm: int | Callable[[int], int] | None
                ) -> int | Callable[[int], int] | None:
        """``imm`` checked against ``EngineConfig.imm_bytes`` (a callable once
        it is called: its value depends on the final piece count)."""
        if not self.config.imm_bytes or imm is None:
            return imm
        if not callable(imm):
            self._check_imm_cap(imm)
            return imm
        fn = imm

        def capped(pieces: int) -> int:
            value = fn(pieces)
            self._check_imm_cap(value)
            return value
        return capped

    def _pick_shard(self, src: Any) -> tuple[Shard, Any]:
        """The shard a write from ``src`` goes through, and the source to hand
        it: with one shard, that one; else the shard that registered ``src``
        (chosen by NUMA node at registration: this is one cache lookup per
        shard, no system call), the least busy if several did."""
        if len(self.shards) == 1:
            return self.shards[0], src
        if isinstance(src, LocalRegion):
            owner = next((s for s in self.shards if s.memory.owns(src)), None)
            if owner is None:
                raise UnregisteredMemory(f"{src!r} was not registered by this engine")
            return owner, src
        span = buffer_span(src)
        found = [(s, r) for s in self.shards if (r := s.memory.lookup(span)) is not None]
        if not found:
            raise UnregisteredMemory(f"{span.nbytes} bytes at {span.address:#x} are not "
                                     "registered: register the buffer first")
        shard, region = min(found, key=lambda sr: sr[0].in_flight)
        return shard, Source(region, span.address, span.nbytes)

    async def submit(self, src: Any, dst: RegionDescriptor, scatter: ScatterList, *,
                     imm: int | Callable[[int], int] | None = None, notify: bool = False,
                     notify_early: bool = False, dry_run: bool = False,
                     timeout: float | None = None) -> Transfer:
        """Validate and start a write; returns once it is queued (waiting for
        a slot if the shard is full), not when it completes. Writes submitted
        one after another from one task are posted in that order. Bad input
        raises before anything is posted. ``imm`` may be a function of the
        final piece count (striping can split pieces). Await
        :meth:`Transfer.wait`. ``timeout`` (seconds; default
        ``EngineConfig.write_timeout_s``) counts from now: waiting for a
        slot, posting and completing must all fit in it. ``notify``: see
        :meth:`write`.

        ``notify_early`` (with ``notify``; KV pushes): to a peer of one rail
        pair on an ordered rail, the notification rides right behind data of
        any size, not only ``EAGER_NOTIFY_BYTES``; if the write then fails,
        its receiver may have counted it (docs/architecture.md, "Notify
        mode"), so it must never be sent again blindly."""
        if notify_early and not notify:
            raise InvalidArgument("notify_early needs notify=True")
        shard, tr = await self._submit(src, dst, scatter, imm, dry_run, inline=False,
                                       timeout=timeout, notify=notify,
                                       notify_early=notify_early)
        return Transfer(self._clock, shard, tr, dst, self.config.cancel_grace_s)

    def _deadline(self, timeout: float | None) -> float:
        """The trio time a write must be done by: ``timeout`` from now, else
        ``EngineConfig.write_timeout_s`` from now, else never."""
        return trio.current_time() + self._timeout(timeout)

    def _timeout(self, timeout: float | None) -> float:
        """A write's time limit in seconds, checked: ``timeout``, else
        ``EngineConfig.write_timeout_s``, else inf."""
        if timeout is None:
            timeout = self.config.write_timeout_s
            return float("inf") if timeout is None else timeout
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not timeout > 0):
            raise InvalidArgument(f"timeout must be a number of seconds > 0, got {timeout!r}")
        return timeout

    async def _submit(self, src: Any, dst: RegionDescriptor, scatter: ScatterList,
                      imm: int | Callable[[int], int] | None, dry_run: bool, *,
                      inline: bool, timeout: float | None, notify: bool = False,
                      notify_early: bool = False) -> tuple[Shard, TransferState]:
        self._check_open()
        imm = self._capped(imm)
        deadline = self._deadline(timeout)
        # Already cancelled: raise before posting anything (costs nothing otherwise).
        await trio.lowlevel.checkpoint_if_cancelled()
        shard, src = self._pick_shard(src)
        try:
            # No scheduler round when a slot is free: waiting checkpoints anyway.
            shard.slots.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_at(deadline) as waited:
                await shard.slots.acquire()
            if waited.cancelled_caught:
                raise TransferTimeout(
                    f"write to {dst.name!r} on {dst.node!r} timed out waiting for one of "
                    f"the {shard.slots.max_value} transfer slots: 0 pieces posted",
                    peer=dst.name, pieces=0, completed=0) from None
        try:
            self._check_open()  # the engine may have closed while we waited for a slot
            tr = shard.prepare(src, dst, scatter, imm, dry_run, notify)
            tr.deadline = deadline
            tr.notify_early = notify_early
            shard.submit(tr, inline=inline)
        except BaseException:
            shard.slots.release()
            raise
        return shard, tr

    async def write(self, src: Any, dst: RegionDescriptor, scatter: ScatterList, *,
                    imm: int | None = None, notify: bool = False, dry_run: bool = False,
                    timeout: float | None = None) -> int:
        """Write ``scatter`` from ``src`` (a registered buffer) into ``dst``.

        Returns how many immediates the target counts for it (it waits for
        that many with :meth:`wait_imm`): without ``notify``, the number of
        pieces written, each carrying ``imm`` (or none). Bad input raises
        before anything is posted; a failed piece raises ``TransferError``
        with the provider's words once every posted piece has finished.

        ``notify=True`` (needs ``imm``): the target counts exactly one ``imm``
        for the write, and only once every byte of it is in the target's
        memory; the write returns 1 once that notification was acknowledged
        (delivery-complete), so a return also means "landed". The pieces
        carry no immediate; the last piece of each rail pair's share is
        posted delivery-complete (the providers order writes on a connection,
        so it covers the pieces before it); once all are acknowledged, one
        small write re-writes the first bytes of the first piece with the
        immediate. Such a write fails over when a rail pair fails (its
        pieces move to the peer's other pairs); the notification itself is
        never sent twice: if its outcome is unknown the write raises
        ``NotificationUnknown``. A write whose every piece carries ``imm``
        (the default) cannot fail over: a rail failing under it raises
        ``RailFailedUnderImmediates``; with no rail pair left to the peer a
        write raises ``RailsExhausted``.

        Deadline: ``timeout`` seconds (default ``EngineConfig.write_timeout_s``;
        slot, posting and completion included). When it passes, posting stops,
        the connections carrying its pieces are torn down rather than waited
        on, and ``TransferTimeout`` says how many pieces were acknowledged: a
        silent peer (packets dropped, no reset) fails this way.

        Cancellation: a cancelled write stops posting new pieces, then waits,
        shielded, until the pieces already posted have completed or failed (at
        most ``EngineConfig.cancel_grace_s``; after that their connections are
        torn down), and only then raises ``trio.Cancelled``: ``src`` may be
        reused once this returns or raises, never earlier.

        ``dry_run`` does everything but the provider calls (for measuring the
        engine's own cost per page).

        Checkpoints: a write always checks for cancellation before posting,
        but a small write that completes while the trio thread polls for it
        returns without a schedule point unless the engine has not yielded for
        ``YIELD_EVERY_NS`` (1 ms): a deadline may be noticed that much late.
        """
        inline = self.config.inline_poll_ns > 0
        if inline and not notify and not dry_run and len(self.shards) == 1:
            # The express path (``_express.py``): a small write on a quiet shard.
            self._check_open()
            capped = self._capped(imm)
            limit = self._timeout(timeout)  # a deadline is made only if it is handed over
            await trio.lowlevel.checkpoint_if_cancelled()
            shard = self.shards[0]
            if not callable(capped):
                out = shard.express.write(src, dst, scatter, capped, limit,
                                          self._alone_budget)
                if isinstance(out, int):
                    await self._clock.maybe_yield()
                    return out
                if out is not None:
                    return await Transfer(self._clock, shard, out, dst,
                                          self.config.cancel_grace_s).wait()
        shard, tr = await self._submit(src, dst, scatter, imm, dry_run, inline=inline,
                                       timeout=timeout, notify=notify)
        if inline and tr.direct:
            shard.poll_inline(tr, self._inline_budget(shard, tr))
        t = Transfer(self._clock, shard, tr, dst, self.config.cancel_grace_s)
        pieces = await t.wait()
        return t.imms if notify else pieces

    def _inline_budget(self, shard: Shard, tr: TransferState) -> int:
        """How long the trio thread polls for ``tr`` before handing it to the
        poller thread: ``alone_budget_ns`` when nothing else of its shard is
        in flight, else ``inline_poll_ns`` (others keep the event loop and
        the poller thread pipelining)."""
        if shard.alone(tr):
            return self._alone_budget(tr.w.nbytes)
        return self.config.inline_poll_ns

    async def wait_imm(self, imm: int, count: int, *, timeout: float | None = None) -> None:
        """Return once ``count`` pieces carrying ``imm`` have landed here (and
        consume them). Cancellation leaves the counts in place for a later wait;
        so does ``timeout`` (seconds), after which ``WaitTimeout`` says how
        many arrived. No default deadline: a receiver may wait for a sender
        that has not started yet."""
        self._check_open()
        limit = math.inf if timeout is None else self._deadline(timeout) - trio.current_time()
        for shard in self.shards:
            shard.memory.check_imm(imm)
        self._check_imm_cap(imm)
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise InvalidArgument(f"count must be an integer > 0, got {count!r}")
        await self._arrivals.wait(imm, count, timeout, limit)

    def _pull_imms(self) -> None:
        for shard in self.shards:
            shard.pull_imms()

    def route_imms(self, shift: int, tag: int, handler: Any) -> None:
        """Send arrivals whose ``imm >> shift == tag`` to ``handler(imm, count)``
        (called in trio) instead of counting them for :meth:`wait_imm`: for
        protocols that encode more than a counter in the immediate (KV pages)."""
        self._arrivals.route(shift, tag, handler)

    def imm_count(self, imm: int) -> int:
        """Pieces with ``imm`` that landed and no waiter has consumed yet."""
        return self._arrivals.count(imm)

    def statistics(self) -> EngineStats:
        """A frozen snapshot: per NIC what was posted, completed, received and
        failed; per shard the queue depth and the registration cache."""
        nics = [n for shard in self.shards for n in shard.nic_stats()]
        return EngineStats(tuple(nics), tuple(s.in_flight for s in self.shards),
                           sum(s.completed for s in self.shards),
                           sum(s.failed for s in self.shards),
                           sum(s.cancelled for s in self.shards),
                           tuple(s.memory.registrations() for s in self.shards),
                           sum(s.read_inline for s in self.shards),
                           sum(s.read_by_poller for s in self.shards),
                           self._arrivals.awaited,
                           sum(s.failover_counts()[0] for s in self.shards),
                           sum(s.failover_counts()[1] for s in self.shards),
                           sum(s.express.completed for s in self.shards),
                           sum(s.express.handed_over for s in self.shards))

    def add_shard(self, topo: ShardTopology, rails: list[Rail],
                  token: trio.lowlevel.TrioToken) -> Shard:
        """A shard over ``rails`` (its NICs' rails, opened by the caller, now
        owned by the shard), delivering its immediates here; not started."""
        c = self.config
        shard = Shard(
            len(self.shards), topo, rails, token=token, deliver_imms=self._arrivals.deliver,
            imms_wanted=self._arrivals.wanted, max_inflight=c.max_inflight,
            spin_ns=c.spin_ns, idle_timeout_ns=c.idle_timeout_ns, pin=c.pin_threads,
            cache_entries=c.cache_entries, backoff_max_ns=c.backoff_max_ns,
            peer_pieces=c.peer_pieces, rail_stall_s=c.rail_stall_s,
            rail_retry_s=c.rail_retry_s, rail_retry_max_s=c.rail_retry_max_s)
        self.shards.append(shard)
        return shard

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("engine is closed")
        for shard in self.shards:
            if shard.thread_error is not None:
                raise EngineClosed(f"the engine cannot write: shard {shard.index}'s poller "
                                   f"thread failed ({shard.thread_error!r})")

    async def poller_failure(self) -> BaseException:
        """Returns once a shard's poller thread has died of an error (a bug):
        that error. Never returns while every poller is well, nor after they
        stopped with the engine's close. The engine writes nothing more once
        it returned (``_check_open``): its owner should stop."""
        failed: list[BaseException] = []
        async with trio.open_nursery() as nursery:
            async def watch(shard: Shard) -> None:
                await shard.thread_done.wait()
                if shard.thread_error is not None:
                    failed.append(shard.thread_error)
                    nursery.cancel_scope.cancel()

            for shard in self.shards:
                nursery.start_soon(watch, shard)
        if not failed:
            await trio.sleep_forever()
        return failed[0]

    async def aclose(self) -> None:
        """Stop the pollers, fail what is in flight with ``EngineClosed``, close rails."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            for shard in self.shards:
                shard.stop()
            for shard in self.shards:
                await shard.thread_done.wait()
        self._arrivals.close()
        for shard in self.shards:
            shard.close(process_exits=self.process_exits)
        log.info("engine.closed", shards=len(self.shards))
