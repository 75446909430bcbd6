"""Running a bandwidth test: our path against the C reference, same run.

``run_bench(opts, progress)`` runs every case of ``opts`` for every provider
and returns a ``BenchReport``. "Our path" is the engine (``--loopback`` and
``--client``: ``Engine.write`` into a bench server's region, its pieces
confirmed by the server) or the node daemons (``--via-daemon``, see
``_daemon``). The reference is C at both ends where its target can run on this
host (``--loopback``: a ``ReferenceTarget`` process busy-polling its CQ), else
the C initiator into our own target; each result names which. With
``opts.mooncake`` (loopback, tcp), Mooncake Transfer Engine writes the same
pages in the same run too.

- loopback: a bench server (``_server.serve``) in a second, spawned process on
  127.0.0.1, and a reference target in a third;
- client: a TCP handshake with a bench server gives the region's descriptor,
  and the server confirms every piece landed (immediate counts).

Also measures this machine's single-thread memcpy bandwidth, the physical
ceiling for same-node transfers. What must not live here: parsing options
(``_options``), the measuring loop (``_measure``), rendering (``_report``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.errors import P2PXferError, ProviderNotFound
from p2pxfer.fabric import getinfo
from p2pxfer.log import get_logger

from ._daemon import daemon_session
from ._measure import (
    NullProgress,
    Peer,
    Progress,
    Reference,
    connect_paths,
    measure_case,
    measure_memcpy,
)
from ._mooncake import MooncakePeer, mooncake_missing
from ._nixl import NixlPeer, nixl_missing
from ._options import BenchError, BenchOptions, Case, build_cases, format_size
from ._paths import EnginePath
from ._reference import ReferenceInitiator, ReferenceTarget, close_rails, open_rails
from ._report import BenchResult, with_predictions
from ._server import (
    ServerConfig,
    ServerLink,
    bench_buffer,
    connect_server,
    fabric_node,
    pick_interfaces,
    serve,
)

__all__ = ["BenchReport", "NullProgress", "Progress", "fabric_node", "loopback_server",
           "measure_memcpy", "run_bench", "unwrap_group"]

log = get_logger("p2pxfer.bench")

FILL = 0xA5


@dataclass
class BenchReport:
    results: list[BenchResult] = field(default_factory=list)
    memcpy_gbps: float = 0.0
    notes: list[str] = field(default_factory=list)


def unwrap_group(exc: BaseException) -> BaseException:
    """The first of our errors inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        ours = [e for e in exc.exceptions if isinstance(e, P2PXferError | BaseExceptionGroup)]
        exc = (ours or list(exc.exceptions))[0]
    return exc


async def _server_session(opts: BenchOptions, provider: str, link: ServerLink, host: str,
                          cases: list[Case], progress: Progress, target_pid: int | None,
                          notes: list[str]) -> list[BenchResult]:
    node = fabric_node(provider, opts.node, host, opts.interfaces)
    names = pick_interfaces(provider, node, opts.nrails(), opts.interfaces)
    size = opts.region_bytes()
    loopback = opts.mode == "loopback"
    # A loopback target shares this host's interfaces: name them for it.
    same_host = names if loopback and opts.interfaces else None
    async with AsyncExitStack() as stack:
        dst = await stack.enter_async_context(link.region(provider, size, len(names),
                                                          same_host, opts.memory))
        if dst.length < size:
            raise BenchError(f"the server exported {format_size(dst.length)}, not "
                             f"{format_size(size)}")
        src = bench_buffer(size, opts.memory == "shared", stack)  # freed after the engine
        src.fill(FILL)
        target = f"{link.host}@{link.address}" if link.host else link.address
        engine = await stack.enter_async_context(open_engine(EngineConfig(
            provider=provider, node=node, interfaces=names)))
        engine.register(src)
        # A round's transfers submitted together are a KV push's layers
        # (``--pages-per-transfer``; what calibration measures them for):
        # their notifications go as ``push_pages`` sends them.
        ours = EnginePath(engine, src, dst, notify_early=opts.pages_per_transfer is not None)
        # The C target runs where it can: on this host, beside the loopback server.
        ref_target = stack.enter_context(ReferenceTarget(provider, node, names, size)) \
            if loopback else None
        rails = open_rails(provider, node, names)
        stack.callback(close_rails, rails)
        ini = ReferenceInitiator(rails, src, ref_target.descriptor if ref_target else dst)
        stack.callback(ini.close)
        base = Reference(ini, ref_target, check=link.check, target_pid=target_pid)
        peers: list[Peer] = []
        if opts.mooncake:
            why = mooncake_missing(provider) if loopback else "Mooncake runs in --loopback only"
            if why is None:
                peers.append(stack.enter_context(MooncakePeer(src, size, opts.timeout)))
            else:
                notes.append(f"no Mooncake row for {provider}: {why}")
        if opts.nixl:
            why = nixl_missing(provider) if loopback else "NIXL runs in --loopback only"
            if why is None:
                peers.append(stack.enter_context(NixlPeer(src, size, provider, opts.timeout)))
            else:
                notes.append(f"no NIXL row for {provider}: {why}")
        await connect_paths(ours, base, link.check, opts.timeout, peers)
        return [await measure_case(c, ours, base, link.check, opts, provider, target, progress,
                                   target_pid=target_pid, peers=peers) for c in cases]
    raise AssertionError("unreachable")  # pragma: no cover (mypy: the stack may swallow)


async def _against_server(opts: BenchOptions, host: str, port: int, cases: list[Case],
                          progress: Progress, target_pid: int | None,
                          notes: list[str]) -> list[BenchResult]:
    results: list[BenchResult] = []
    async with connect_server(host, port, connect_timeout=opts.connect_timeout,
                              timeout=opts.timeout) as link:
        for p in opts.providers:
            results += await _server_session(opts, p, link, host, cases, progress, target_pid,
                                             notes)
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
                          ) -> AsyncIterator[tuple[int, int]]:
    """A bench server in a second (spawned) process on 127.0.0.1; yields its
    port and process id."""
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
        assert proc.pid is not None
        yield int(msg[1]), proc.pid
    finally:
        proc.terminate()
        await trio.to_thread.run_sync(proc.join, 10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


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
        report.results += await daemon_session(opts, cases, progress, report.notes)
    elif opts.mode == "client":
        report.results += await _against_server(opts, opts.host, opts.port, cases, progress,
                                                None, report.notes)
    else:
        async with loopback_server() as (port, pid):
            report.results += await _against_server(opts, "127.0.0.1", port, cases, progress,
                                                    pid, report.notes)
    # Last, so a bad option or an unreachable server fails at once, and the
    # copy runs on a machine no longer busy with the target.
    report.memcpy_gbps = measure_memcpy(opts.memcpy_size)
    log.info("bench.memcpy", gbps=report.memcpy_gbps, nbytes=opts.memcpy_size)
    report.results = with_predictions([dataclasses.replace(r, memcpy_gbps=report.memcpy_gbps)
                                       for r in report.results])
    return report


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> BenchReport:
    """Run the bandwidth test ``opts`` describes (blocking; starts its own trio
    loop). Raises one plain ``P2PXferError`` (``BenchConfigError`` for options
    that cannot work, ``ProviderNotFound``, ``BenchError``, ...), never a group."""
    try:
        return trio.run(_run, opts, progress or NullProgress())
    except BaseExceptionGroup as group:
        raise unwrap_group(group) from None
