"""Measuring one case: our path, the reference and peers, round by round.

``measure_case`` runs a case's warm-up rounds on every path, then its timed
rounds in a few blocks whose order rotates (ours, reference, peers; then the
next first), so all paths see the same noise and each runs in its steady state
within a block. It records bandwidth, per-transfer latency and the CPU seconds
both ends spent per GB moved.

What must not live here: opening engines, targets or sockets (the sessions in
``_run`` and ``_daemon`` do), parsing options, rendering.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

from p2pxfer.scatter import ScatterList

from ._options import BenchError, BenchOptions, Case
from ._paths import OurPath
from ._reference import (
    C_INITIATOR,
    C_TO_C,
    ReferenceInitiator,
    ReferenceTarget,
    RefStripe,
    process_cpu_seconds,
)
from ._report import BenchResult, RailResult

__all__ = ["ALTERNATIONS", "Check", "NullProgress", "Peer", "Progress", "Reference",
           "connect_paths", "measure_case", "measure_memcpy"]

CONNECT_IMM = 1
# Timed rounds run in this many blocks, rotating which path goes first.
ALTERNATIONS = 6

Check = Callable[[int, int], Awaitable[None]]


class Progress(Protocol):
    """What the bench tells its caller while it runs (the CLI draws a bar)."""

    def start(self, total: int) -> None: ...

    def advance(self, description: str, steps: int = 1) -> None: ...


class NullProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, description: str, steps: int = 1) -> None:
        pass


def measure_memcpy(nbytes: int, repeat: int = 3) -> float:
    """Best-of-``repeat`` single-thread copy bandwidth (``np.copyto``), GB/s of
    bytes copied."""
    a = np.full(nbytes, 1, np.uint8)
    b = np.zeros(nbytes, np.uint8)
    np.copyto(b, a)  # fault both in
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e6


async def with_timeout(what: str, seconds: float, aw: Awaitable[Any]) -> Any:
    try:
        with trio.fail_after(seconds):
            return await aw
    except trio.TooSlowError:
        raise BenchError(f"{what} did not complete within {seconds:g} s") from None


class Peer(Protocol):
    """Another engine measured beside ours (Mooncake, NIXL): blocking, whole blocks."""

    name: str

    def plan(self, sl: ScatterList) -> Any: ...

    def block(self, plans: list[Any], timeout: float) -> tuple[int, list[float], float | None]:
        """Run the planned rounds; (pieces, seconds per round, target CPU seconds)."""
        ...


class Reference:
    """The C initiator, and the C target it writes into (``C_TO_C``) or, where
    none runs, our own target (``C_INITIATOR``, checked through ``check``)."""

    def __init__(self, ini: ReferenceInitiator, target: ReferenceTarget | None, *,
                 check: Check | None = None, target_pid: int | None = None) -> None:
        self.ini, self.target, self.check, self.target_pid = ini, target, check, target_pid
        self.kind = C_TO_C if target is not None else C_INITIATOR

    @property
    def nrails(self) -> int:
        return self.ini.nrails

    def plan(self, sl: ScatterList) -> list[RefStripe]:
        return self.ini.plan(sl)

    def block(self, plans: list[list[RefStripe]], imm: int | None,
              timeout: float, gap_s: float = 0.0) -> tuple[int, list[float], float | None]:
        """Run the planned rounds back to back (``gap_s`` apart, untimed; the
        C target busy-polls meanwhile); (writes, which a target counts with
        ``imm``; seconds per round; target CPU seconds or None where unknown)."""
        cpu0 = None
        if self.target is not None:
            counts = [0] * self.nrails
            for plan in plans:
                for s in plan:
                    counts[s.rail] += self.ini.writes(s.rail, len(s.length))
            self.target.expect(counts, timeout * len(plans))
        elif self.target_pid is not None:
            cpu0 = process_cpu_seconds(self.target_pid)
        n, dts = 0, []
        for plan in plans:
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            n += self.ini.round(plan, imm, timeout)
            dts.append(time.perf_counter() - t0)
        if self.target is not None:
            return n, dts, self.target.collect(timeout * len(plans))
        if self.target_pid is not None and cpu0 is not None:
            return n, dts, process_cpu_seconds(self.target_pid) - cpu0
        return n, dts, None


async def connect_paths(ours: OurPath, base: Reference | None, check: Check | None,
                        timeout: float, peers: Sequence[Peer] = ()) -> None:
    """One small untimed write on each path and each rail: connections are set
    up and first-touch costs paid before anything is timed."""
    n = base.nrails if base is not None else 1
    sl = ScatterList(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64),
                     np.ones(n, np.int64))
    imm = CONNECT_IMM if ours.imm else None
    pieces, _ = await with_timeout("the first write", timeout, ours.round([sl], imm))
    if check is not None and imm is not None:
        await check(imm, pieces)
    if base is not None:
        base_imm = CONNECT_IMM if base.kind == C_TO_C else imm
        base_writes = base.block([base.plan(sl)], base_imm, timeout)[0]
        if base.kind == C_INITIATOR and check is not None and imm is not None:
            await check(imm, base_writes)
    for peer in peers:
        peer.block([peer.plan(sl)], timeout)


@dataclass
class _Tally:
    n: int = 0
    seconds: float = 0.0
    lat: list[float] = field(default_factory=list)
    cpu: float = 0.0  # initiator (this process)
    target_cpu: float | None = 0.0

    def add_target(self, cpu: float | None) -> None:
        self.target_cpu = None if cpu is None or self.target_cpu is None \
            else self.target_cpu + cpu

    def cpu_per_gb(self, nbytes: int) -> float | None:
        if self.target_cpu is None or nbytes <= 0:
            return None
        return (self.cpu + self.target_cpu) / (nbytes / 1e9)


async def measure_case(case: Case, ours: OurPath, base: Reference | None, check: Check | None,
                       opts: BenchOptions, provider: str, target: str, progress: Progress,
                       *, target_pid: int | None = None,
                       peers: Sequence[Peer] = ()) -> BenchResult:
    """Measure ``case`` on every path; ``target_pid`` is our target's process,
    where it runs on this host (for its CPU time)."""
    imm_ours = 2 + 2 * case.index if ours.imm else None
    # A C target counts every arrival; our target counts the immediates we name.
    c_to_c = base is not None and base.kind == C_TO_C
    imm_base = 3 + 2 * case.index if ours.imm or c_to_c else None
    plans = [base.plan(m) for m in case.merged] if base is not None else []
    peer_plans = [[p.plan(m) for m in case.merged] for p in peers]
    # What exists now (cases, plans, engines) is never walked by the garbage
    # collector again: a full collection over it landing inside a round
    # would skew that round's mean; what the rounds make is still collected,
    # every path alike.
    gc.collect()
    gc.freeze()
    what = f"{provider} {case.label}"
    t_ours, t_base = _Tally(), _Tally()
    t_peers = [_Tally() for _ in peers]
    if target_pid is None:
        t_ours.target_cpu = None

    async def ours_round(k: int) -> tuple[int, list[float], float]:
        # Timed around our call only, like the reference's C round: the
        # deadline is the caller's, per block (a cancel scope per round cost
        # a 4 KiB round ~20% more than the write).
        lists, _ = case.round(k)
        t0 = time.perf_counter()
        n, lat = await ours.round(lists, imm_ours)
        return n, lat, time.perf_counter() - t0

    base_rail_bytes = [0] * (base.nrails if base is not None else 0)
    n_warm_ours = 0
    for k in range(case.warmup):
        n_warm_ours += (await with_timeout(f"a round of {what}", opts.timeout,
                                           ours_round(k)))[0]
        progress.advance(f"{what} warm-up")
    warm = range(case.warmup)
    n_warm_base = 0
    if base is not None and case.warmup:
        n_warm_base = base.block([plans[k % len(plans)] for k in warm], imm_base,
                                 opts.timeout)[0]
    for p, pp in zip(peers, peer_plans, strict=True):
        if case.warmup:
            p.block([pp[k % len(pp)] for k in warm], opts.timeout)
    before = await ours.rail_bytes()
    names = ["ours"] + ["base"] * (base is not None) + [f"peer{i}" for i in range(len(peers))]
    nblocks = min(case.iterations, ALTERNATIONS)
    bounds = [case.iterations * b // nblocks for b in range(nblocks + 1)]
    for b in range(nblocks):
        block = range(case.warmup + bounds[b], case.warmup + bounds[b + 1])
        for which in names[b % len(names):] + names[:b % len(names)]:
            cpu0 = process_cpu_seconds()
            if which == "ours":
                tcpu0 = process_cpu_seconds(target_pid) if target_pid is not None else 0.0

                async def ours_block(block: range = block) -> None:
                    for k in block:
                        n, lat, dt = await ours_round(k)
                        t_ours.n, t_ours.seconds = t_ours.n + n, t_ours.seconds + dt
                        t_ours.lat += lat
                        progress.advance(what)
                await with_timeout(f"{len(block)} rounds of {what}", opts.timeout * len(block),
                                   ours_block())
                t_ours.cpu += process_cpu_seconds() - cpu0
                if target_pid is not None:
                    t_ours.add_target(process_cpu_seconds(target_pid) - tcpu0)
                continue
            if which == "base":
                assert base is not None
                chosen = [plans[k % len(plans)] for k in block]
                n, dts, tcpu = base.block(chosen, imm_base, opts.timeout)
                for plan in chosen:
                    for s in plan:
                        base_rail_bytes[s.rail] += s.nbytes
                tally = t_base
            else:
                i = int(which[4:])
                pp = peer_plans[i]
                n, dts, tcpu = peers[i].block([pp[k % len(pp)] for k in block], opts.timeout)
                tally = t_peers[i]
            tally.cpu += process_cpu_seconds() - cpu0
            tally.add_target(tcpu)
            tally.n, tally.seconds = tally.n + n, tally.seconds + sum(dts)
            tally.lat += dts
    after = await ours.rail_bytes()
    if check is not None and imm_ours is not None:
        await check(imm_ours, t_ours.n + n_warm_ours)
        if base is not None and base.kind == C_INITIATOR and imm_base is not None:
            await check(imm_base, t_base.n + n_warm_base)

    transfers = case.iterations * case.concurrency
    total = transfers * case.bytes
    gbps = total / t_ours.seconds / 1e9
    base_gbps = total / t_base.seconds / 1e9 if base is not None else None
    rails: list[RailResult] = []
    moved = {name: b1 - b0 for (name, b0), (_, b1) in zip(before, after, strict=True)}
    base_names = base.ini.rail_names if base is not None else []
    for name, nbytes in moved.items():
        if len(moved) == 1:
            # One rail carried everything (also when the daemon's NIC counters
            # include other traffic): the totals are the rail's numbers.
            rail_gbps, rail_base = gbps, base_gbps
        else:
            rail_gbps = nbytes / t_ours.seconds / 1e9
            rail_base = (base_rail_bytes[base_names.index(name)] / t_base.seconds / 1e9
                         if name in base_names and t_base.seconds > 0 else None)
        rails.append(RailResult(name, rail_gbps, rail_base))
    by_name = {p.name: t for p, t in zip(peers, t_peers, strict=True)}
    mc, nx = by_name.get("mooncake"), by_name.get("nixl")
    return BenchResult(
        mode=opts.mode, provider=provider, pattern=case.pattern, order=case.order,
        page_size=case.page_size, pages=case.pages, pool_pages=case.pool_pages,
        bytes=case.bytes, concurrency=case.concurrency, warmup=case.warmup,
        iterations=case.iterations, transfers=transfers, total_bytes=total,
        seconds=t_ours.seconds, gbps=gbps,
        baseline_seconds=t_base.seconds if base is not None else None, baseline_gbps=base_gbps,
        ratio=gbps / base_gbps if base_gbps else None,
        p50_us=_pct(t_ours.lat, 50), p99_us=_pct(t_ours.lat, 99),
        baseline_p50_us=_pct(t_base.lat, 50) if t_base.lat else None,
        baseline_p99_us=_pct(t_base.lat, 99) if t_base.lat else None,
        memcpy_gbps=0.0, nrails=len(rails) or 1, target=target, rails=rails,
        reference=base.kind if base is not None else "",
        cpu_s_per_gb=t_ours.cpu_per_gb(total),
        baseline_cpu_s_per_gb=t_base.cpu_per_gb(total) if base is not None else None,
        mooncake_gbps=total / mc.seconds / 1e9 if mc else None,
        mooncake_p50_us=_pct(mc.lat, 50) if mc else None,
        mooncake_cpu_s_per_gb=mc.cpu_per_gb(total) if mc else None,
        nixl_gbps=total / nx.seconds / 1e9 if nx else None,
        nixl_p50_us=_pct(nx.lat, 50) if nx else None,
        nixl_cpu_s_per_gb=nx.cpu_per_gb(total) if nx else None,
        # a daemon moves a client's share (memfd pages) into its peer's region
        memory="shared" if opts.mode == "via-daemon" else opts.memory,
    )
