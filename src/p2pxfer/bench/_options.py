"""What a bandwidth test runs: sizes, options, and the transfer patterns.

What lives here: parsing sizes ("64KiB"), the frozen ``BenchOptions`` a
command line turns into, checking them (``BenchConfigError`` names the
option at fault), and ``Case``: one pattern at one size with its scatter
lists built ahead of time, so no numpy work falls inside a timed section.
What must not: opening providers, sockets or processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from p2pxfer import address
from p2pxfer.errors import InvalidArgument, P2PXferError
from p2pxfer.plan import MEMORY
from p2pxfer.scatter import ScatterList

__all__ = [
    "DEFAULT_PORT",
    "BenchConfigError",
    "BenchError",
    "BenchOptions",
    "Case",
    "build_cases",
    "format_size",
    "parse_hostport",
    "parse_size",
    "sweep_sizes",
]

DEFAULT_PORT = 7790
KIB, MIB, GIB = address.KIB, address.MIB, address.GIB
# Scatter lists built per case and cycled through the rounds: enough variety
# that random pages differ between rounds, little enough to build quickly.
VARIANTS = 4


class BenchError(P2PXferError):
    """A bandwidth test could not run (server unreachable, target failed, ...)."""


class BenchConfigError(BenchError, InvalidArgument):
    """The options do not describe a test that can run; nothing was started."""


def parse_size(text: str | int) -> int:
    """``4096``, ``64KiB``, ``1M``, ``2GiB`` (units are binary; ``KB`` = ``KiB``)
    as a positive number of bytes. Raises ``BenchConfigError`` otherwise."""
    try:
        return address.parse_size(text)
    except InvalidArgument as exc:
        raise BenchConfigError(str(exc)) from None


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that divides them (``65536`` -> ``64KiB``)."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def parse_hostport(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[V6ADDR]:PORT``."""
    try:
        return address.parse_hostport(text, default_port=default_port, port_zero=False)
    except InvalidArgument as exc:
        raise BenchConfigError(str(exc)) from None


def sweep_sizes(lo: int, hi: int) -> tuple[int, ...]:
    """``lo``, ``2 lo``, ``4 lo``, ... up to ``hi`` (and ``hi`` itself)."""
    if lo > hi:
        raise BenchConfigError(f"--min-size {format_size(lo)} is larger than "
                               f"--max-size {format_size(hi)}")
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    if out[-1] != hi:
        out.append(hi)
    return tuple(out)


@dataclass(frozen=True)
class BenchOptions:
    """One bandwidth test, as the command line describes it.

    ``iterations=None`` picks, per size, enough timed rounds to move about
    ``auto_bytes`` (``AUTO_MIN_ROUNDS``..``AUTO_MAX_ROUNDS`` rounds). A round
    is ``concurrency`` transfers in flight at once."""

    mode: str = "loopback"  # loopback | client | via-daemon
    providers: tuple[str, ...] = ("tcp;ofi_rxm",)
    pattern: str = "contiguous"  # contiguous | paged
    sizes: tuple[int, ...] = (64 * MIB,)
    sweep: bool = False
    page_size: int = 64 * KIB
    pages: int = 4096
    #: None: all pages in one transfer; else a round's transfers, submitted
    #: together, notify as a KV push's layers do (``notify_early``)
    pages_per_transfer: int | None = None
    order: str = "random"  # random | sequential
    #: our two ends' buffers: anonymous memory, or memfd pages (as daemons' pools);
    #: the C reference's target stays anonymous
    memory: str = "private"  # private | shared
    concurrency: int = 1
    warmup: int = 2
    iterations: int | None = None
    auto_bytes: int = 256 * MIB
    rails: int | None = None  # None: 1, or len(interfaces)
    interfaces: tuple[str, ...] | None = None
    region_size: int | None = None
    node: str | None = None  # local fabric bind address; None: chosen per mode
    memcpy_size: int = 256 * MIB
    seed: int = 1
    timeout: float = 60.0
    connect_timeout: float = 5.0
    # client mode
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    #: loopback over tcp: measure Mooncake Transfer Engine on the same pages too
    mooncake: bool = False
    #: loopback over tcp or shm: measure NIXL (UCX backend) on the same pages too
    nixl: bool = False
    # via-daemon mode
    socket: str = ""
    peer: str = ""
    region: str = ""

    def nrails(self) -> int:
        if self.interfaces:
            return len(self.interfaces)
        return self.rails or 1

    def check(self) -> None:
        """Raise ``BenchConfigError`` naming the first option that cannot work."""
        if self.mode not in ("loopback", "client", "via-daemon"):
            raise BenchConfigError(f"unknown mode {self.mode!r}")
        if not self.providers or any(not p.strip() for p in self.providers):
            raise BenchConfigError("--provider must name a libfabric provider")
        if self.pattern not in ("contiguous", "paged"):
            raise BenchConfigError(f"--pattern must be contiguous or paged, got {self.pattern!r}")
        if self.order not in ("random", "sequential"):
            raise BenchConfigError(f"--order must be random or sequential, got {self.order!r}")
        if self.memory not in MEMORY:
            raise BenchConfigError(f"--memory must be {' or '.join(MEMORY)}, got "
                                   f"{self.memory!r}")
        if self.memory == "shared" and self.mode != "loopback":
            raise BenchConfigError("--memory shared runs in loopback mode only")
        for name, value, least in (("--concurrency", self.concurrency, 1),
                                   ("--warmup", self.warmup, 0),
                                   ("--iterations", self.iterations, 1),
                                   ("--rails", self.rails, 1), ("--pages", self.pages, 1),
                                   ("--pages-per-transfer", self.pages_per_transfer, 1)):
            if value is not None and value < least:
                raise BenchConfigError(f"{name} must be >= {least}, got {value}")
        if self.interfaces is not None:
            if not self.interfaces or any(not i for i in self.interfaces):
                raise BenchConfigError("--interfaces must list interface names, e.g. veth0,veth1")
            if self.rails is not None and self.rails != len(self.interfaces):
                raise BenchConfigError(f"--rails {self.rails} but --interfaces names "
                                       f"{len(self.interfaces)}")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise BenchConfigError("timeouts must be > 0")
        if self.mooncake and self.mode != "loopback":
            raise BenchConfigError("the Mooncake row runs in loopback mode only")
        if self.nixl and self.mode != "loopback":
            raise BenchConfigError("the NIXL row runs in loopback mode only")
        if self.mode == "via-daemon" and not (self.socket and self.peer and self.region):
            raise BenchConfigError("--via-daemon needs --socket, --peer and --region")
        if self.pattern == "paged":
            if self.sweep:
                raise BenchConfigError("--sweep measures contiguous sizes; it cannot be "
                                       "combined with --pattern paged")
            if self.pages_per_transfer is not None and self.pages_per_transfer > self.pages:
                raise BenchConfigError(f"--pages-per-transfer {self.pages_per_transfer} is "
                                       f"more than --pages {self.pages}")
            if self.region_size is not None:
                if self.page_size > self.region_size:
                    raise BenchConfigError(
                        f"--page-size {format_size(self.page_size)} is larger than the region "
                        f"({format_size(self.region_size)})")
                if self.pages * self.page_size > self.region_size:
                    raise BenchConfigError(
                        f"--pages {self.pages} x --page-size {format_size(self.page_size)} "
                        f"does not fit the region ({format_size(self.region_size)})")
        else:
            if not self.sizes:
                raise BenchConfigError("no transfer size given")
            need = max(self.sizes) * self.concurrency
            if self.region_size is not None and need > self.region_size:
                raise BenchConfigError(
                    f"transfers of {format_size(max(self.sizes))} x --concurrency "
                    f"{self.concurrency} need a {format_size(need)} region; --region-size is "
                    f"{format_size(self.region_size)}")

    def region_bytes(self) -> int:
        """How large the target region is (and the local source buffer)."""
        if self.region_size is not None:
            return self.region_size
        if self.pattern == "paged":
            return self.pages * self.page_size
        return max(self.sizes) * self.concurrency


@dataclass(eq=False)
class Case:
    """One measured point: a pattern at one transfer size.

    ``rounds[k][j]`` is transfer ``j`` of round variant ``k`` (rounds cycle
    through the variants); ``merged[k]`` is round ``k`` as one scatter list,
    which is what the C baseline posts (a whole round in one call, the C
    loop's way of having many transfers in flight)."""

    index: int
    pattern: str
    order: str | None
    page_size: int
    pages: int  # pieces per transfer
    pool_pages: int
    concurrency: int
    warmup: int
    iterations: int
    rounds: list[list[ScatterList]] = field(repr=False)
    merged: list[ScatterList] = field(repr=False)

    @property
    def bytes(self) -> int:
        """Bytes of one transfer."""
        return self.page_size * self.pages

    @property
    def label(self) -> str:
        if self.pattern == "paged":
            return (f"{self.pages}x{format_size(self.page_size)} {self.order} "
                    f"(pool {self.pool_pages})")
        return format_size(self.bytes)

    def round(self, k: int) -> tuple[list[ScatterList], ScatterList]:
        v = k % len(self.rounds)
        return self.rounds[v], self.merged[v]


#: timed rounds per case when the options leave it to ``auto_bytes``: at most
#: AUTO_MAX_ROUNDS, so that small writes are measured over more than a scheduler
#: tick (200 rounds of one 4 KiB shm write were ~1.5 ms, and the first few
#: writes after each alternation with the reference, 2x the rest, moved the
#: ratio by a third)
AUTO_MIN_ROUNDS, AUTO_MAX_ROUNDS = 5, 2000


def _iterations(opts: BenchOptions, round_bytes: int) -> int:
    if opts.iterations is not None:
        return opts.iterations
    return max(AUTO_MIN_ROUNDS, min(AUTO_MAX_ROUNDS, math.ceil(opts.auto_bytes / round_bytes)))


def _merge(lists: list[ScatterList]) -> ScatterList:
    if len(lists) == 1:
        return lists[0]
    return ScatterList(np.concatenate([s.src for s in lists]),
                       np.concatenate([s.dst for s in lists]),
                       np.concatenate([s.length for s in lists]))


def _contiguous(opts: BenchOptions, index: int, size: int) -> Case:
    # Transfer j of a round writes bytes [j*size, (j+1)*size) on both sides.
    rnd = [ScatterList.contiguous(size, j * size, j * size) for j in range(opts.concurrency)]
    return Case(index, "contiguous", None, size, 1, 1, opts.concurrency, opts.warmup,
                _iterations(opts, size * opts.concurrency), [rnd], [_merge(rnd)])


def _paged(opts: BenchOptions, index: int) -> Case:
    rng = np.random.default_rng(opts.seed)
    psize, pool = opts.page_size, opts.pages
    per = opts.pages_per_transfer or pool
    lengths = np.full(per, psize, np.int64)
    rounds: list[list[ScatterList]] = []
    cursor = 0
    for _ in range(VARIANTS):
        rnd = []
        for _ in range(opts.concurrency):
            if opts.order == "random":
                src = rng.choice(pool, per, replace=False).astype(np.int64)
                dst = rng.choice(pool, per, replace=False).astype(np.int64)
            else:
                src = dst = (cursor + np.arange(per, dtype=np.int64)) % pool
                cursor = (cursor + per) % pool
            rnd.append(ScatterList(src * psize, dst * psize, lengths))
        rounds.append(rnd)
    return Case(index, "paged", opts.order, psize, per, pool, opts.concurrency, opts.warmup,
                _iterations(opts, psize * per * opts.concurrency), rounds,
                [_merge(r) for r in rounds])


def build_cases(opts: BenchOptions) -> list[Case]:
    """The measured points of ``opts``, in the order they run."""
    opts.check()
    if opts.pattern == "paged":
        return [_paged(opts, 0)]
    return [_contiguous(opts, i, size) for i, size in enumerate(opts.sizes)]
