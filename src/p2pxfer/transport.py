"""The single-threaded transfer core: rails, registrations, posting, counting.

A ``Transport`` owns one or more rails (NICs) of one provider, their
registration cache and one poller. ``write`` validates a scatter list against
both regions, stripes it across rails by bytes, posts it through the C helper
(resuming where the TX queue pushed back) and progresses the CQs until every
piece has completed. ``wait_imm`` progresses until enough immediates arrived.

It is blocking and not thread-safe: the async engine drives the same pieces
from its poller thread. What must not live here: trio, sockets, Python loops
over pieces.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import numpy as np
import structlog

from p2pxfer.errors import (
    DescriptorError,
    InvalidArgument,
    RemoteClosed,
    TransferError,
    UnregisteredMemory,
    WaitTimeout,
)
from p2pxfer.fabric import (
    FLAG_REMOTE_CQ_DATA,
    INT64_MAX,
    Completions,
    Poller,
    Rail,
    StallWatch,
    WriteBatch,
    getinfo,
)
from p2pxfer.memory import LocalRegion, RegionDescriptor, RegistrationCache, buffer_span
from p2pxfer.scatter import ScatterList

__all__ = ["PreparedWrite", "Stripe", "Tally", "Transport", "plan_stripes", "tally"]

log = structlog.get_logger("p2pxfer.transport")

SPIN_NS = 50_000
BLOCK_NS = 100_000_000
# A blocking write returns to Python from the posting loop only this often
# (to check its deadline): each return is a Python round.
POST_BUDGET_NS = 50_000_000


@dataclass(frozen=True)
class PreparedWrite:
    """A validated write laid out on rails, ready for ``Poller.post``."""

    tid: int
    region: LocalRegion
    batch: WriteBatch
    pieces: int
    nbytes: int
    dst_name: str


@dataclass(frozen=True)
class Tally:
    """Completions summed per transfer id and per immediate value."""

    done: list[tuple[int, int]]
    imms: list[tuple[int, int]]
    entries: int


def tally(c: Completions) -> Tally:
    """Sum a poll's runs; O(runs), never O(pieces). An error entry counts in
    ``entries`` but is left to the caller (``c.error``)."""
    done: list[tuple[int, int]] = []
    imms: list[tuple[int, int]] = []
    n = 1 if c.error is not None else 0
    if len(c):
        remote = ((c.flags & np.uint64(FLAG_REMOTE_CQ_DATA)) != 0).tolist()
        counts = c.count.tolist()
        n += sum(counts)
        for is_remote, ctx, data, cnt in zip(remote, c.context.tolist(), c.data.tolist(),
                                             counts, strict=True):
            if is_remote:
                imms.append((data, cnt))
            else:
                done.append((ctx, cnt))
    return Tally(done, imms, n)


@dataclass(frozen=True)
class Stripe:
    """Pieces ``[start, end)`` of a scatter list go out on ``rail``."""

    rail: int
    start: int
    end: int


def plan_stripes(scatter: ScatterList, nrails: int, max_msg: int) -> tuple[ScatterList,
                                                                        list[Stripe]]:
    """Split pieces the provider cannot take in one message, and, with several
    rails, pieces too large to balance; then give each rail a contiguous range
    of about equal bytes. Deterministic: the target can compute the count."""
    sl = scatter.split(max_msg)
    if nrails == 1:
        return sl, [Stripe(0, 0, len(sl))]
    # Aim for >= 4 pieces per rail so a few big pieces still balance.
    sl = sl.split(max(1 << 16, -(-sl.nbytes // (4 * nrails))))
    return sl, [Stripe(r, s, e) for r, (s, e) in enumerate(sl.stripes(nrails)) if e > s]


class Transport:
    """Blocking transfers over the rails of one provider."""

    def __init__(self, rails: list[Rail], *, cache_entries: int = 1024, wake_fd: int = -1,
                 backoff_max_ns: int = 200_000) -> None:
        if not rails:
            raise InvalidArgument("a transport needs at least one rail")
        providers = {r.provider for r in rails}
        if len(providers) != 1:
            raise InvalidArgument(f"rails of one transport must share a provider: {providers}")
        self.rails = rails
        self.provider = rails[0].provider
        self.cache = RegistrationCache(rails, max_entries=cache_entries)
        self.poller = Poller(rails, wake_fd=wake_fd, backoff_max_ns=backoff_max_ns)
        self.max_msg = min(INT64_MAX, *(r.info.max_msg_size for r in rails))
        self.imm_bits = 8 * min(r.imm_bytes for r in rails)
        self._next_id = 1
        self._remaining: dict[int, int] = {}
        self._failures: dict[int, str] = {}
        self._imm: Counter[int] = Counter()
        # Transfers whose caller stopped waiting (timeout) with pieces in flight:
        # forgotten once their last completion arrives.
        self._abandoned: set[int] = set()
        self.bytes_posted = [0] * len(rails)
        self.pieces_posted = [0] * len(rails)

    @classmethod
    def open(cls, provider: str, *, node: str | None = None,
             domains: list[str] | None = None) -> Transport:
        """One rail per named domain (NIC), or the first interface found."""
        if domains:
            infos = [getinfo(provider, node=node, domain=d)[0] for d in domains]
        else:
            infos = getinfo(provider, node=node)[:1]
        rails: list[Rail] = []
        try:
            for info in infos:
                rails.append(Rail(info))
        except BaseException:
            for r in rails:
                r.close()
            raise
        return cls(rails)

    # -- memory ---------------------------------------------------------------

    def register(self, obj: Any, *, writable: bool = False, pin: bool = False) -> LocalRegion:
        return self.cache.register(obj, writable=writable, pin=pin)

    def export(self, obj: Any, name: str, *, node: str = "",
               incarnation: int = 0) -> RegionDescriptor:
        """Register ``obj`` for remote writes, pin it, and describe it for peers."""
        region = self.cache.register(obj, writable=True, pin=True)
        region.name = name
        return region.descriptor(name, node, incarnation, buffer_span(obj))

    def source(self, src: Any) -> tuple[LocalRegion, int, int]:
        """(registration, base address, size) of a write's source."""
        if isinstance(src, LocalRegion):
            if src.closed:
                raise UnregisteredMemory(f"{src!r} was deregistered")
            return src, src.address, src.length
        span = buffer_span(src)
        return self.cache.require_span(span), span.address, span.nbytes

    # -- writes ---------------------------------------------------------------

    def check_imm(self, imm: int | None) -> None:
        if imm is not None and not (isinstance(imm, int) and 0 <= imm < 1 << self.imm_bits):
            raise InvalidArgument(f"immediate {imm!r} does not fit in {self.imm_bits} bits")

    def check_destination(self, dst: RegionDescriptor) -> None:
        if not isinstance(dst, RegionDescriptor):
            raise DescriptorError(f"destination must be a RegionDescriptor, got {type(dst)}")
        for r in dst.rails:
            if r.provider != self.provider:
                raise DescriptorError(
                    f"region {dst.name!r} is on provider {r.provider!r}, this transport "
                    f"speaks {self.provider!r}"
                )

    def prepare(self, src: Any, dst: RegionDescriptor, scatter: ScatterList,
                imm: int | Callable[[int], int] | None, tid: int,
                rail_offset: int = 0) -> PreparedWrite:
        """Validate a write and lay it out on the rails, posting nothing.

        Raises ``ScatterError``/``InvalidArgument``/``DescriptorError``/
        ``UnregisteredMemory`` naming what is wrong. ``imm`` may be a function
        of the final piece count (for protocols that put the count in the
        immediate). ``rail_offset`` rotates which of the target's rails our
        rail 0 writes to."""
        if not isinstance(scatter, ScatterList):
            raise InvalidArgument(f"scatter must be a ScatterList, got {type(scatter).__name__}")
        if not callable(imm):
            self.check_imm(imm)
        self.check_destination(dst)
        region, base, size = self.source(src)
        scatter.check_bounds(size, dst.length)
        nrails = min(len(self.rails), len(dst.rails))
        sl, stripes = plan_stripes(scatter, nrails, self.max_msg)
        if callable(imm):
            imm = imm(len(sl))
            self.check_imm(imm)
        batch = WriteBatch(sl.src, sl.dst, sl.length, tid, imm, len(stripes))
        for st in stripes:
            rail = self.rails[st.rail]
            rd = dst.rails[(st.rail + rail_offset) % len(dst.rails)]
            batch.add(st.rail, rail, rail.peer(rd.address), st.start, st.end, base,
                      region.mrs[st.rail].desc, rd.base, rd.key, rd.address)
        return PreparedWrite(tid, region, batch, len(sl), sl.nbytes, dst.name)

    def write(self, src: Any, dst: RegionDescriptor, scatter: ScatterList, *,
              imm: int | None = None, timeout: float | None = None) -> int:
        """Write every piece of ``scatter`` from ``src`` (a registered buffer or
        region) into the peer region ``dst``; returns the number of pieces posted
        (each carries ``imm``, so the target waits for that many).

        Raises ``ScatterError``/``InvalidArgument`` before posting anything on bad
        input, ``TransferError`` with the provider's words if a piece fails (after
        every posted piece has finished), ``WaitTimeout`` if ``timeout`` passes.
        """
        tid = self._next_id
        self._next_id += 1
        w = self.prepare(src, dst, scatter, imm, tid)
        self._remaining[tid] = w.pieces
        w.region.pins += 1
        try:
            self._run(w, timeout)
        finally:
            if self._remaining.get(tid) == 0:
                del self._remaining[tid]
            else:
                self._abandoned.add(tid)
            self.cache.unpin(w.region)
        failure = self._failures.pop(tid, None)
        if failure is not None:
            raise TransferError(f"write to {dst.name!r} failed: {failure}")
        log.debug("transfer.complete", transfer_id=tid, nbytes=w.nbytes, pieces=w.pieces)
        return w.pieces

    def _run(self, w: PreparedWrite, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        tid, batch = w.tid, w.batch
        watch = StallWatch()
        try:
            while not batch.posted:
                self._absorb(self.poller.post(batch, POST_BUDGET_NS))
                if tid in self._failures:
                    break
                if (gone := watch.check(batch)) is not None:
                    raise RemoteClosed(f"write to {w.dst_name!r} failed: {gone}")
                self._check_deadline(deadline, w)
        finally:
            for r, pieces, nbytes in batch.progress():
                self.pieces_posted[r] += pieces
                self.bytes_posted[r] += nbytes
            # Pieces that will never go out will never complete either.
            never = batch.cancel()
            if failures := batch.failures():
                self._failures.setdefault(tid, "; ".join(failures))
            self._remaining[tid] -= never
        while self._remaining[tid] > 0:
            self._check_deadline(deadline, w)
            # Ask C to gather everything still due in one call, not a batch per round.
            self.progress(spin_ns=SPIN_NS, timeout_ns=BLOCK_NS, min_entries=self._remaining[tid])

    def _check_deadline(self, deadline: float | None, w: PreparedWrite) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise WaitTimeout(f"write to {w.dst_name!r} timed out with "
                              f"{self._remaining[w.tid]} pieces outstanding")

    # -- completions ----------------------------------------------------------

    def progress(self, *, spin_ns: int = 0, timeout_ns: int = 0, min_entries: int = 1) -> int:
        """Drain the CQs (waiting as told); returns completions absorbed."""
        c = self.poller.progress(spin_ns=spin_ns, timeout_ns=timeout_ns, min_entries=min_entries)
        return self._absorb(c)

    def _absorb(self, c: Completions) -> int:
        t = tally(c)
        for ctx, cnt in t.done:
            if ctx in self._remaining:
                self._remaining[ctx] -= cnt
                self._forget_if_abandoned(ctx)
        for imm, cnt in t.imms:
            self._imm[imm] += cnt
        if (e := c.error) is not None:
            if e.context in self._remaining:
                self._remaining[e.context] -= 1
                self._failures.setdefault(e.context, e.text)
                self._forget_if_abandoned(e.context)
            log.warning("transfer.piece_failed", transfer_id=e.context, code=e.code,
                        error=e.text, rail=self.rails[e.rail].name)
        return t.entries

    def _forget_if_abandoned(self, tid: int) -> None:
        if tid in self._abandoned and self._remaining[tid] <= 0:
            self._abandoned.discard(tid)
            del self._remaining[tid]
            self._failures.pop(tid, None)

    def wait_imm(self, imm: int, count: int, *, timeout: float | None = None) -> None:
        """Progress until ``count`` pieces carrying ``imm`` have landed, then
        consume them. Raises ``WaitTimeout`` if ``timeout`` passes first."""
        self.check_imm(imm)
        if count <= 0:
            raise InvalidArgument(f"count must be > 0, got {count}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._imm[imm] < count:
            left = BLOCK_NS if deadline is None else int((deadline - time.monotonic()) * 1e9)
            if left <= 0:
                raise WaitTimeout(f"only {self._imm[imm]} of {count} pieces with immediate "
                                  f"{imm} arrived")
            self.progress(spin_ns=SPIN_NS, timeout_ns=min(left, BLOCK_NS),
                          min_entries=count - self._imm[imm])
        self._imm[imm] -= count
        if self._imm[imm] == 0:
            del self._imm[imm]

    def imm_count(self, imm: int) -> int:
        return self._imm[imm]

    def close(self) -> None:
        self.cache.close()
        for rail in self.rails:
            rail.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
