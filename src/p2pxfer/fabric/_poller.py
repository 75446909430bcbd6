"""The poller that drains rails' CQs, and what one drain found.

``Poller.progress`` (and ``post``, ``express_poll``) run one C loop
(``native/src/p2p.c``) over every CQ and hand back runs of alike completions
(``Completions``), per piece: a grouped write's piece count is taken out of
its operation context in C, and out of an error entry's here
(``CompletionError.pieces``). One thread calls ``progress``; nothing here
keeps per-transfer state. What must not live here: a rail's objects
(``_rail.py``), posting decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._batch import WriteBatch, group_of
from ._binding import ffi, lib, raise_fabric_error

if TYPE_CHECKING:
    from ._rail import Rail

__all__ = ["FLAG_REMOTE_CQ_DATA", "CompletionError", "Completions", "Poller"]

FLAG_REMOTE_CQ_DATA = int(lib.FI_REMOTE_CQ_DATA)
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class CompletionError:
    """A failed operation as its CQ reported it: ``pieces`` of a write
    failed together (a grouped write's, ``_batch.py``)."""

    rail: int
    context: int
    flags: int
    code: int
    text: str
    pieces: int = 1


@dataclass(frozen=True)
class Completions:
    """What one poll found, as runs of alike completions. Arrays are views into
    the poller's buffers: valid until its next ``progress`` call."""

    rail: npt.NDArray[np.int32]
    context: U64
    flags: U64
    data: U64
    count: I64
    nbytes: I64
    error: CompletionError | None = None

    def __len__(self) -> int:
        return len(self.count)


class Poller:
    """Drains the CQs of a set of rails through one C call per batch.

    ``progress`` spins briefly, then sleeps on the CQs' wait fds (plus an
    optional wake-up eventfd), so an idle poller costs ~0% CPU. Where a CQ has
    no wait fd (shm) it sleeps a growing back-off capped at ``backoff_max_ns``;
    with ``bell_spin_ns`` it also sleeps on the rails' doorbells, and once
    rung spins at least that long. Not thread-safe: one thread calls
    ``progress``.
    """

    def __init__(
        self,
        rails: list[Rail],
        *,
        max_runs: int = 1024,
        wake_fd: int = -1,
        backoff_max_ns: int = 200_000,
        bell_spin_ns: int = 0,
    ) -> None:
        self.rails = list(rails)
        self._p = ffi.new("struct p2p_poller *")
        lib.p2p_poller_init(self._p, wake_fd, backoff_max_ns)
        if bell_spin_ns > 0:
            self._p.bell_spin_ns = bell_spin_ns
            for rail in self.rails:
                fd = rail.doorbell.fd if rail.doorbell is not None else -1
                if fd >= 0 and lib.p2p_poller_add_bell(self._p, fd) < 0:
                    raise_fabric_error("p2p_poller_add_bell", -int(lib.FI_ENOMEM),
                                       "too many rails for one poller")
        self._rail = np.zeros(max_runs, np.int32)
        self._ctx = np.zeros(max_runs, np.uint64)
        self._flags = np.zeros(max_runs, np.uint64)
        self._data = np.zeros(max_runs, np.uint64)
        self._count = np.zeros(max_runs, np.int64)
        self._bytes = np.zeros(max_runs, np.int64)
        p = self._p
        p.max_runs = max_runs
        p.run_cq = ffi.cast("int32_t *", self._rail.ctypes.data)
        p.run_ctx = ffi.cast("uint64_t *", self._ctx.ctypes.data)
        p.run_flags = ffi.cast("uint64_t *", self._flags.ctypes.data)
        p.run_data = ffi.cast("uint64_t *", self._data.ctypes.data)
        p.run_count = ffi.cast("int64_t *", self._count.ctypes.data)
        p.run_bytes = ffi.cast("int64_t *", self._bytes.ctypes.data)
        self._kept = ffi.new("int64_t *")
        for rail in self.rails:
            rc = lib.p2p_poller_add_cq(p, rail.fabric.handle, rail.cq.handle, rail.cq.wait_fd)
            if rc < 0:
                raise_fabric_error("p2p_poller_add_cq", rc, "too many rails for one poller")

    @property
    def blocks_on_fds(self) -> bool:
        return all(r.cq.wait_fd >= 0 for r in self.rails)

    def hold(self, on: bool) -> None:
        """While held, ``progress`` in another thread leaves the CQs alone
        (it naps on the wake fd): the holder is polling them itself for a small
        write's completion, and a steal would cost a thread hop. A plain store,
        read atomically in C; no GIL round."""
        self._p.hold = 1 if on else 0

    @property
    def backoff_max_ns(self) -> int:
        """Longest nap where a CQ has no wait fd (settable: a plain store)."""
        return int(self._p.backoff_max_ns)

    @backoff_max_ns.setter
    def backoff_max_ns(self, ns: int) -> None:
        self._p.backoff_max_ns = ns

    @property
    def entries(self) -> int:
        """Pieces completed (a grouped write's each counted) and arrivals
        seen over the poller's life."""
        return int(self._p.entries)

    @property
    def bells(self) -> int:
        """Times a peer's ring woke this poller, over its life."""
        return int(self._p.bells)

    @property
    def bells_refused(self) -> int:
        """Rings from another user's processes, read and ignored, over its
        life (no shm peer is another user's: segments are 0600)."""
        return int(self._p.bells_refused)

    def post(self, batch: WriteBatch, budget_ns: int = 2_000_000) -> Completions:
        """Post the batch's pieces; whenever a TX queue is full, drain
        completions (returned) instead of returning to Python."""
        n = lib.p2p_post_cursors(self._p, batch._c, len(batch), budget_ns)
        return self._completions(n)

    def progress(
        self, *, spin_ns: int = 0, timeout_ns: int = 0, min_entries: int = 1,
        max_entries: int = 1 << 16,
    ) -> Completions:
        """Drain until ``min_entries`` completions arrived, spinning ``spin_ns``
        after the last activity, then sleeping, for at most ``timeout_ns`` in all
        (negative: no limit; 0: just drain). A wake-up or the timeout returns
        what was found so far. Releases the GIL while in C."""
        return self._completions(lib.p2p_poller_progress(self._p, max_entries, min_entries,
                                                         spin_ns, timeout_ns))

    def runs(self, n: int) -> list[tuple[int, int, int, int, int]]:
        """The first ``n`` runs of the table: (rail, context, flags, data, count)."""
        return list(zip(self._rail[:n].tolist(), self._ctx[:n].tolist(),
                        self._flags[:n].tolist(), self._data[:n].tolist(),
                        self._count[:n].tolist(), strict=True))

    @property
    def handle(self) -> Any:
        """The C poller, for ``ExpressCursor.post`` (which holds its CQs)."""
        return self._p

    def express_poll(self, want: int, context: int, budget_ns: int
                     ) -> tuple[int, list[tuple[int, int, int, int, int]], Completions | None]:
        """Spin on the (held) CQs until ``want`` completions of ``context`` (an
        express write's own pieces) are read or ``budget_ns`` passed: how
        many were, the runs of peers' writes with immediates read meanwhile
        (as ``runs``), and, where a read stopped at an error entry, every run
        still in the table as ``Completions`` instead (that read's and the
        arrivals before it: not counted, the caller absorbs them). Runs of
        any other context are dropped."""
        got = lib.p2p_express_poll(self._p, want, context, budget_ns, FLAG_REMOTE_CQ_DATA,
                                   self._kept)
        if got < 0:
            raise_fabric_error("fi_cq_read", got, "poller")
        kept = self._kept[0]
        if self._p.err_cq >= 0:
            return got, [], self._completions(kept)
        return got, (self.runs(kept) if kept else []), None

    def completions(self, n: int) -> Completions:
        """The last poll's ``n`` runs (and its error entry) as ``Completions``."""
        return self._completions(n)

    def _completions(self, n: int) -> Completions:
        if n < 0:
            raise_fabric_error("fi_cq_read", n, "poller")
        error = None
        if self._p.err_cq >= 0:
            r = int(self._p.err_cq)
            ctx, flags, code, text = self.rails[r].cq.read_error()
            ctx, pieces = group_of(ctx)
            error = CompletionError(r, ctx, flags, code, text, pieces)
        return Completions(
            self._rail[:n], self._ctx[:n], self._flags[:n], self._data[:n],
            self._count[:n], self._bytes[:n], error,
        )
