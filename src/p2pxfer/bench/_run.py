"""Measuring: our path against the raw C loop, round by round, same run.

``run_bench(opts, progress)`` runs every case of ``opts`` for every provider
and returns a ``BenchReport``. Per case it alternates timed rounds between
our path and the C baseline (``p2p_baseline_write`` on a ``Transport`` over
the same provider, writing the same pattern into the same target), so both
see the same noise. "Our path" is the async engine (``--loopback`` and
``--client``) or the node daemons (``--via-daemon``).

- loopback: a bench server (``_server.serve``) in a second, spawned process
  on 127.0.0.1, then the client path below against it;
- client: a TCP handshake with a bench server gives the region's descriptor,
  and the server confirms every piece landed (immediate counts);
- via-daemon: ``p2pxfer.connect`` to the local daemon, shared memory as the
  source, writes into a region exported on a peer; the baseline writes into
  the same region straight from this process, with the descriptor asked from
  the peer daemon's control port.

Also measures this machine's single-thread memcpy bandwidth, the physical
ceiling for same-node transfers. What must not live here: parsing options
(``_options``) and rendering (``_report``, the CLI).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import structlog
import trio

from p2pxfer.engine import Engine, EngineConfig, open_engine, plan_stripes
from p2pxfer.engine import RailGroup as Transport
from p2pxfer.errors import P2PXferError, ProviderNotFound
from p2pxfer.fabric import FabricInfo, Rail, baseline_write, getinfo
from p2pxfer.memory import LocalRegion, RegionDescriptor
from p2pxfer.scatter import ScatterList

from ._options import (
    BenchConfigError,
    BenchError,
    BenchOptions,
    Case,
    build_cases,
    format_size,
    parse_hostport,
)
from ._report import BenchResult, RailResult
from ._server import (
    ServerConfig,
    ServerLink,
    connect_server,
    fabric_node,
    pick_interfaces,
    resolve_region,
    serve,
)

__all__ = ["BenchReport", "NullProgress", "Progress", "fabric_node", "measure_memcpy",
           "run_bench"]

log = structlog.get_logger("p2pxfer.bench")

CONNECT_IMM = 1
# Timed rounds alternate between our path and the baseline in this many blocks.
ALTERNATIONS = 6
FILL = 0xA5


class Progress(Protocol):
    """What the bench tells its caller while it runs (the CLI draws a bar)."""

    def start(self, total: int) -> None: ...

    def advance(self, description: str, steps: int = 1) -> None: ...


class NullProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, description: str, steps: int = 1) -> None:
        pass


@dataclass
class BenchReport:
    results: list[BenchResult] = field(default_factory=list)
    memcpy_gbps: float = 0.0
    notes: list[str] = field(default_factory=list)


# -- helpers ------------------------------------------------------------------


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


def _unwrap(exc: BaseException) -> BaseException:
    """The first of our errors inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        ours = [e for e in exc.exceptions if isinstance(e, P2PXferError | BaseExceptionGroup)]
        exc = (ours or list(exc.exceptions))[0]
    return exc


# -- our paths ----------------------------------------------------------------


class OurPath(Protocol):
    imm: bool

    async def round(self, lists: list[ScatterList], imm: int | None) -> tuple[int, list[float]]:
        """Write ``lists`` at once; (pieces, seconds per transfer)."""
        ...

    async def rail_bytes(self) -> list[tuple[str, int]]: ...


class EnginePath:
    """Writes through ``Engine.write``, ``len(lists)`` trio tasks at a time."""

    imm = True

    def __init__(self, engine: Engine, src: npt.NDArray[np.uint8], dst: RegionDescriptor) -> None:
        self.engine, self.src, self.dst = engine, src, dst

    async def _one(self, sl: ScatterList, imm: int | None, out: list[tuple[int, float]]) -> None:
        t0 = time.perf_counter()
        n = await self.engine.write(self.src, self.dst, sl, imm=imm)
        out.append((n, time.perf_counter() - t0))

    async def round(self, lists: list[ScatterList], imm: int | None) -> tuple[int, list[float]]:
        out: list[tuple[int, float]] = []
        if len(lists) == 1:
            await self._one(lists[0], imm, out)
        else:
            async with trio.open_nursery() as nursery:
                for sl in lists:
                    nursery.start_soon(self._one, sl, imm, out)
        return sum(n for n, _ in out), [s for _, s in out]

    async def rail_bytes(self) -> list[tuple[str, int]]:
        return [(n.name, n.bytes) for n in self.engine.statistics().nics]


class DaemonPath:
    """Writes through the local daemon (``Client.write``) into a peer's region."""

    imm = False  # a daemon's immediates are node-wide; leave the peer's counts alone

    def __init__(self, client: Any, mem: Any, peer: str, region: str) -> None:
        self.client, self.mem, self.peer, self.region = client, mem, peer, region

    async def _one(self, sl: ScatterList, out: list[tuple[int, float]]) -> None:
        t0 = time.perf_counter()
        n = await self.client.write(self.peer, self.region, sl, src=self.mem)
        out.append((n, time.perf_counter() - t0))

    async def round(self, lists: list[ScatterList], imm: int | None) -> tuple[int, list[float]]:
        out: list[tuple[int, float]] = []
        if len(lists) == 1:
            await self._one(lists[0], out)
        else:
            async with trio.open_nursery() as nursery:
                for sl in lists:
                    nursery.start_soon(self._one, sl, out)
        return sum(n for n, _ in out), [s for _, s in out]

    async def rail_bytes(self) -> list[tuple[str, int]]:
        st = await self.client.status()
        return [(str(n["name"]), int(n["bytes"])) for n in st.get("nics", [])]


# -- the C baseline -----------------------------------------------------------


@dataclass(frozen=True)
class _CStripe:
    rail: int
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    nbytes: int


class CBaseline:
    """``p2p_baseline_write`` over a transport's rails: the whole post-and-drain
    loop in C. With several rails, each gets the same stripe the engine would
    give it and its own thread (cffi drops the GIL around the call)."""

    def __init__(self, transport: Transport, src: Any, dst: RegionDescriptor) -> None:
        self.t = transport
        self.dst = dst
        self.region: LocalRegion = transport.register(src)
        self.nrails = min(len(transport.rails), len(dst.rails))
        self.dest = [transport.rails[r].peer(dst.rails[r].address) for r in range(self.nrails)]

    @property
    def rail_names(self) -> list[str]:
        return [r.name for r in self.t.rails[:self.nrails]]

    def plan(self, sl: ScatterList) -> list[_CStripe]:
        sl.check_bounds(self.region.length, self.dst.length)
        split, stripes = plan_stripes(sl, self.nrails, self.t.max_msg)
        return [_CStripe(st.rail, split.src[st.start:st.end].copy(),
                         split.dst[st.start:st.end].copy(),
                         split.length[st.start:st.end].copy(),
                         int(split.length[st.start:st.end].sum())) for st in stripes]

    def _post(self, s: _CStripe, imm: int | None) -> None:
        rail, rd = self.t.rails[s.rail], self.dst.rails[s.rail]
        baseline_write(rail, self.dest[s.rail], s.src, s.dst, s.length, self.region.address,
                       self.region.mrs[s.rail].desc, rd.base, rd.key, imm)

    def round(self, plan: list[_CStripe], imm: int | None) -> int:
        """Post a planned round and wait for all of it; returns pieces."""
        if len(plan) == 1:
            self._post(plan[0], imm)
        else:
            errors: list[BaseException] = []

            def post(s: _CStripe) -> None:
                try:
                    self._post(s, imm)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=post, args=(s,)) for s in plan]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if errors:
                raise errors[0]
        return sum(len(s.length) for s in plan)


def open_transport(provider: str, node: str | None, names: tuple[str, ...]) -> Transport:
    """A transport with one rail per named interface, in that order. (Picks
    from one ``getinfo`` by domain name: the provider may ignore a domain
    hint, as tcp does, and hand back its first interface for every name.)"""
    infos: dict[str, FabricInfo] = {}
    for info in getinfo(provider, node=node):
        infos.setdefault(info.domain_name, info)
    missing = [n for n in names if n not in infos]
    if missing:
        raise BenchError(f"{provider} has no interface {', '.join(missing)} "
                         f"(found: {', '.join(infos)})")
    rails: list[Rail] = []
    try:
        for n in names:
            rails.append(Rail(infos[n]))
        return Transport(rails)
    except BaseException:
        for r in rails:
            r.close()
        raise


# -- one case -----------------------------------------------------------------


Check = Callable[[int, int], Awaitable[None]]


async def _with_timeout(what: str, seconds: float, aw: Awaitable[Any]) -> Any:
    try:
        with trio.fail_after(seconds):
            return await aw
    except trio.TooSlowError:
        raise BenchError(f"{what} did not complete within {seconds:g} s") from None


async def _connect(ours: OurPath, base: CBaseline | None, check: Check | None,
                   timeout: float) -> None:
    """One small untimed write on each path and each rail: connections are set
    up and first-touch costs paid before anything is timed."""
    n = base.nrails if base is not None else 1
    sl = ScatterList(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64),
                     np.ones(n, np.int64))
    imm = CONNECT_IMM if ours.imm else None
    pieces, _ = await _with_timeout("the first write", timeout, ours.round([sl], imm))
    if base is not None:
        pieces += base.round(base.plan(sl), imm)
    if check is not None and imm is not None:
        await check(imm, pieces)


async def _measure(case: Case, ours: OurPath, base: CBaseline | None, check: Check | None,
                   opts: BenchOptions, provider: str, memcpy: float, target: str,
                   progress: Progress) -> BenchResult:
    imm_ours = 2 + 2 * case.index if ours.imm else None
    imm_base = 3 + 2 * case.index if ours.imm else None
    plans = [base.plan(m) for m in case.merged] if base is not None else []
    what = f"{provider} {case.label}"
    n_ours = n_base = 0
    ours_lat: list[float] = []
    base_lat: list[float] = []
    ours_s = base_s = 0.0

    async def ours_round(k: int) -> tuple[int, list[float], float]:
        lists, _ = case.round(k)
        t0 = time.perf_counter()
        n, lat = await _with_timeout(f"a round of {what}", opts.timeout,
                                     ours.round(lists, imm_ours))
        return n, lat, time.perf_counter() - t0

    base_rail_bytes = [0] * (base.nrails if base is not None else 0)

    def base_round(k: int, timed: bool) -> tuple[int, float]:
        assert base is not None
        plan = plans[k % len(plans)]
        t0 = time.perf_counter()
        n = base.round(plan, imm_base)
        dt = time.perf_counter() - t0
        if timed:
            for s in plan:
                base_rail_bytes[s.rail] += s.nbytes
        return n, dt

    for k in range(case.warmup):
        n_ours += (await ours_round(k))[0]
        progress.advance(f"{what} warm-up")
    for k in range(case.warmup if base is not None else 0):
        n_base += base_round(k, False)[0]
    before = await ours.rail_bytes()
    # Timed rounds run in a few alternating blocks: both paths see the same
    # noise, and within a block each runs in its steady state (back to back,
    # as a bandwidth test should), not always just after the other's wake-up.
    nblocks = min(case.iterations, ALTERNATIONS)
    bounds = [case.iterations * b // nblocks for b in range(nblocks + 1)]
    for b in range(nblocks):
        block = range(case.warmup + bounds[b], case.warmup + bounds[b + 1])
        for which in ("ours", "base") if b % 2 == 0 else ("base", "ours"):
            if which == "ours":
                for k in block:
                    n, lat, dt = await ours_round(k)
                    n_ours, ours_s = n_ours + n, ours_s + dt
                    ours_lat += lat
                    progress.advance(what)
            elif base is not None:
                for k in block:
                    n, dt = base_round(k, True)
                    n_base, base_s = n_base + n, base_s + dt
                    base_lat.append(dt)
    after = await ours.rail_bytes()
    if check is not None and imm_ours is not None and imm_base is not None:
        await check(imm_ours, n_ours)
        if base is not None:
            await check(imm_base, n_base)

    transfers = case.iterations * case.concurrency
    total = transfers * case.bytes
    gbps = total / ours_s / 1e9
    base_gbps = total / base_s / 1e9 if base is not None else None
    rails: list[RailResult] = []
    moved = {name: b1 - b0 for (name, b0), (_, b1) in zip(before, after, strict=True)}
    base_names = base.rail_names if base is not None else []
    for name, nbytes in moved.items():
        if len(moved) == 1:
            # One rail carried everything (also when the daemon's NIC counters
            # include other traffic): the totals are the rail's numbers.
            rail_gbps, rail_base = gbps, base_gbps
        else:
            rail_gbps = nbytes / ours_s / 1e9
            rail_base = (base_rail_bytes[base_names.index(name)] / base_s / 1e9
                         if name in base_names and base_s > 0 else None)
        rails.append(RailResult(name, rail_gbps, rail_base))
    return BenchResult(
        mode=opts.mode, provider=provider, pattern=case.pattern, order=case.order,
        page_size=case.page_size, pages=case.pages, pool_pages=case.pool_pages,
        bytes=case.bytes, concurrency=case.concurrency, warmup=case.warmup,
        iterations=case.iterations, transfers=transfers, total_bytes=total,
        seconds=ours_s, gbps=gbps,
        baseline_seconds=base_s if base is not None else None, baseline_gbps=base_gbps,
        ratio=gbps / base_gbps if base_gbps else None,
        p50_us=_pct(ours_lat, 50), p99_us=_pct(ours_lat, 99),
        baseline_p50_us=_pct(base_lat, 50) if base_lat else None,
        baseline_p99_us=_pct(base_lat, 99) if base_lat else None,
        memcpy_gbps=memcpy, nrails=len(rails) or 1, target=target, rails=rails,
    )


# -- sessions -----------------------------------------------------------------


async def _server_session(opts: BenchOptions, provider: str, link: ServerLink, host: str,
                          cases: list[Case], progress: Progress) -> list[BenchResult]:
    node = fabric_node(provider, opts.node, host, opts.interfaces)
    names = pick_interfaces(provider, node, opts.nrails(), opts.interfaces)
    size = opts.region_bytes()
    # A loopback target shares this host's interfaces: name them for it.
    same_host = names if opts.mode == "loopback" and opts.interfaces else None
    async with link.region(provider, size, len(names), same_host) as dst:
        if dst.length < size:
            raise BenchError(f"the server exported {format_size(dst.length)}, not "
                             f"{format_size(size)}")
        src = np.empty(size, np.uint8)
        src.fill(FILL)
        target = f"{link.host}@{link.address}" if link.host else link.address
        async with open_engine(EngineConfig(provider=provider, node=node,
                                            interfaces=names)) as engine:
            engine.register(src)
            ours = EnginePath(engine, src, dst)
            with open_transport(provider, node, names) as t:
                base = CBaseline(t, src, dst)
                await _connect(ours, base, link.check, opts.timeout)
                return [await _measure(c, ours, base, link.check, opts, provider, 0.0,
                                       target, progress) for c in cases]


async def _against_server(opts: BenchOptions, host: str, port: int, cases: list[Case],
                          progress: Progress) -> list[BenchResult]:
    results: list[BenchResult] = []
    async with connect_server(host, port, connect_timeout=opts.connect_timeout,
                              timeout=opts.timeout) as link:
        for p in opts.providers:
            results += await _server_session(opts, p, link, host, cases, progress)
    return results


def _loopback_main(conn: Any, backoff_max_ns: int) -> None:
    """Entry point of the loopback target process."""
    def ready(host: str, port: int) -> None:
        conn.send(("port", port))

    cfg = ServerConfig(bind="127.0.0.1", port=0, backoff_max_ns=backoff_max_ns)
    try:
        trio.run(lambda: serve(cfg, on_listen=ready))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


@asynccontextmanager
async def loopback_server(start_timeout: float = 60.0,
                          backoff_max_ns: int = ServerConfig.backoff_max_ns
                          ) -> AsyncIterator[int]:
    """A bench server in a second (spawned) process on 127.0.0.1; yields its port."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_loopback_main, args=(child, backoff_max_ns), daemon=True,
                       name="p2pxfer-bench-target")
    proc.start()
    try:
        deadline = trio.current_time() + start_timeout
        while not await trio.to_thread.run_sync(parent.poll, 0.2):
            if not proc.is_alive():
                raise BenchError(f"the loopback target exited (code {proc.exitcode}) before "
                                 f"it was ready")
            if trio.current_time() > deadline:
                raise BenchError(f"the loopback target did not start within "
                                 f"{start_timeout:g} s")
        msg = parent.recv()
        if msg[0] != "port":
            raise BenchError(f"the loopback target failed: {msg[1]}")
        yield int(msg[1])
    finally:
        proc.terminate()
        await trio.to_thread.run_sync(proc.join, 10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


async def _daemon_session(opts: BenchOptions, cases: list[Case], progress: Progress,
                          notes: list[str]) -> list[BenchResult]:
    from p2pxfer.client import connect

    async with connect(opts.socket) as client:
        status = await client.status()
        provider = str(status["provider"])
        peers = {p["name"]: p["address"] for p in await client.peers()}
        if opts.peer not in peers:
            raise BenchConfigError(f"the daemon at {opts.socket} knows no peer {opts.peer!r} "
                                   f"(known: {', '.join(sorted(peers)) or 'none'})")
        address = peers[opts.peer]
        dst: RegionDescriptor | None = None
        try:
            dst = await resolve_region(address, opts.region, opts.connect_timeout,
                                       peer=opts.peer)
        except (OSError, trio.TooSlowError, P2PXferError) as exc:
            why = str(exc) or type(exc).__name__
            notes.append(f"no C baseline: could not ask {opts.peer} ({address}) for region "
                         f"{opts.region!r}: {why}")
        size = opts.region_bytes()
        if dst is not None and size > dst.length:
            raise BenchConfigError(f"region {opts.region!r} on {opts.peer} is "
                                   f"{format_size(dst.length)}; this pattern needs "
                                   f"{format_size(size)}")
        mem = await client.alloc(size, "p2pxfer-bench")
        mem.array.fill(FILL)
        ours = DaemonPath(client, mem, opts.peer, opts.region)
        target = f"{opts.peer}:{opts.region}"
        if dst is None:
            await _connect(ours, None, None, opts.timeout)
            return [await _measure(c, ours, None, None, opts, provider, 0.0, target,
                                   progress) for c in cases]
        base_provider = dst.rails[0].provider
        node = fabric_node(base_provider, opts.node, parse_hostport(address)[0],
                           opts.interfaces)
        names = pick_interfaces(base_provider, node, min(opts.nrails(), len(dst.rails)),
                                opts.interfaces)
        with open_transport(base_provider, node, names) as t:
            base = CBaseline(t, mem.array, dst)
            await _connect(ours, base, None, opts.timeout)
            return [await _measure(c, ours, base, None, opts, provider, 0.0, target,
                                   progress) for c in cases]


async def _run(opts: BenchOptions, progress: Progress) -> BenchReport:
    cases = build_cases(opts)
    report = BenchReport()
    per_provider = sum(c.warmup + c.iterations for c in cases)
    nproviders = 1 if opts.mode == "via-daemon" else len(opts.providers)
    progress.start(per_provider * nproviders)
    if opts.mode != "via-daemon":
        # Fail on an unknown provider or missing NICs before starting anything.
        for p in opts.providers:
            node = fabric_node(p, opts.node, opts.host if opts.mode == "client" else None,
                               opts.interfaces)
            try:
                getinfo(p, node=node)
            except ProviderNotFound as exc:
                where = f" at {node}" if node else ""
                raise ProviderNotFound(exc.call, exc.code, f"libfabric offers no provider "
                                       f"{p!r}{where} on this machine ({exc.text})") from exc
            pick_interfaces(p, node, opts.nrails(), opts.interfaces)
    if opts.mode == "via-daemon":
        report.results += await _daemon_session(opts, cases, progress, report.notes)
    elif opts.mode == "client":
        report.results += await _against_server(opts, opts.host, opts.port, cases, progress)
    else:
        async with loopback_server() as port:
            report.results += await _against_server(opts, "127.0.0.1", port, cases, progress)
    # Last, so a bad option or an unreachable server fails at once, and the
    # copy runs on a machine no longer busy with the target.
    report.memcpy_gbps = measure_memcpy(opts.memcpy_size)
    log.info("bench.memcpy", gbps=report.memcpy_gbps, nbytes=opts.memcpy_size)
    report.results = [dataclasses.replace(r, memcpy_gbps=report.memcpy_gbps)
                      for r in report.results]
    return report


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> BenchReport:
    """Run the bandwidth test ``opts`` describes (blocking; starts its own trio
    loop). Raises one plain ``P2PXferError`` (``BenchConfigError`` for options
    that cannot work, ``ProviderNotFound``, ``BenchError``, ...), never a group."""
    try:
        return trio.run(_run, opts, progress or NullProgress())
    except BaseExceptionGroup as group:
        raise _unwrap(group) from None

