"""``python -m p2pxfer.bench``: every benchmark scenario from one command line.

    python -m p2pxfer.bench write --pattern paged --pages 4096 --mooncake --json r.json
    python -m p2pxfer.bench latency --size 4KiB --size 64KiB --json lat.json
    python -m p2pxfer.bench kv | dry-run | idle | control-rtt --socket S

``write`` is ``p2pxfer bench --loopback`` (ours against the C-to-C reference,
plus the Mooncake row when asked) and writes the same JSON list; the other
scenarios (``_scenarios``) write ``{"benchmark", "machine", "cpus",
"results"}``. Each prints its JSON too. What must not live here: measuring.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import click

from p2pxfer.errors import P2PXferError
from p2pxfer.log import configure
from p2pxfer.plan import MEMORY

from ._options import BenchConfigError, BenchOptions, parse_size
from ._report import write_document, write_json
from ._run import run_bench
from ._scenarios import run_scenario


def _size(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    try:
        if isinstance(value, tuple):
            return tuple(parse_size(v) for v in value)
        return None if value is None else parse_size(value)
    except BenchConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _providers(value: tuple[str, ...]) -> list[str]:
    return [p.strip() for v in value for p in v.split(",") if p.strip()] or ["tcp;ofi_rxm"]


def _emit(name: str, results: list[dict[str, Any]], path: str | None) -> None:
    sys.stdout.write(write_document(name, results, path))


def _run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BenchConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc


def _per_provider(name: str, providers: tuple[str, ...], json_path: str | None,
                  **kwargs: Any) -> None:
    results: list[dict[str, Any]] = []
    for p in _providers(providers):
        results += _run(partial(run_scenario, name, provider=p, **kwargs))
    _emit(name, results, json_path)


PROVIDER = click.option("--provider", "providers", multiple=True,
                        help="libfabric provider; repeat or comma-separate [tcp;ofi_rxm]")
JSON = click.option("--json", "json_path", type=click.Path(dir_okay=False),
                    help="also write the JSON here")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="WARNING", show_default=True)
def main(log_level: str) -> None:
    """p2pxfer benchmarks: ours against the C-to-C reference, same run."""
    configure(log_level)


@main.command()
@PROVIDER
@JSON
@click.option("--pattern", type=click.Choice(["contiguous", "paged"]), default="paged",
              show_default=True)
@click.option("--size", "sizes", multiple=True, callback=_size, help="contiguous: bytes")
@click.option("--page-size", default="64KiB", callback=_size, show_default=True)
@click.option("--pages", type=int, default=4096, show_default=True)
@click.option("--order", type=click.Choice(["random", "sequential"]), default="random",
              show_default=True)
@click.option("--concurrency", type=int, default=1, show_default=True)
@click.option("--pages-per-transfer", type=int,
              help="paged: pieces per transfer, the transfers submitted together as a KV "
                   "push's layers (notified early) [all in one]")
@click.option("--memory", type=click.Choice(MEMORY), default="private",
              show_default=True, help="our two ends' buffers: anonymous memory, or memfd "
              "pages as daemons' pools (the C target's stays anonymous)")
@click.option("--warmup", type=int, default=2, show_default=True)
@click.option("--iterations", type=int, help="timed rounds [enough for ~256 MiB]")
@click.option("--memcpy-size", default="256MiB", callback=_size, show_default=True)
@click.option("--mooncake", is_flag=True, help="Mooncake Transfer Engine on the same pages")
@click.option("--nixl", is_flag=True, help="NIXL (UCX backend) on the same pages")
def write(providers: tuple[str, ...], json_path: str | None, pattern: str,
          sizes: tuple[int, ...], page_size: int, pages: int, order: str, concurrency: int,
          pages_per_transfer: int | None, memory: str, warmup: int, iterations: int | None,
          memcpy_size: int, mooncake: bool, nixl: bool) -> None:
    """Scatter writes over loopback: ours, the C reference (and NIXL, Mooncake)."""
    opts = BenchOptions(providers=tuple(_providers(providers)), pattern=pattern,
                        sizes=sizes or (64 << 20,), page_size=page_size, pages=pages,
                        order=order, concurrency=concurrency,
                        pages_per_transfer=pages_per_transfer, memory=memory, warmup=warmup,
                        iterations=iterations, memcpy_size=memcpy_size, mooncake=mooncake,
                        nixl=nixl)
    _run(opts.check)
    report = _run(lambda: run_bench(opts))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    if json_path:
        write_json(report.results, json_path)
    sys.stdout.write(json.dumps([r.to_json() for r in report.results], indent=2) + "\n")


@main.command("dry-run")
@PROVIDER
@JSON
@click.option("--pages", type=int, default=4096, show_default=True)
@click.option("--page-size", default="64KiB", callback=_size, show_default=True)
@click.option("--repeat", type=click.IntRange(1), default=20, show_default=True)
def dry_run(providers: tuple[str, ...], json_path: str | None, pages: int, page_size: int,
            repeat: int) -> None:
    """The engine's own cost per page (no provider calls)."""
    _per_provider("dry-run", providers, json_path, pages=pages, page_size=page_size,
                  repeat=repeat)


@main.command()
@PROVIDER
@JSON
@click.option("--size", "sizes", multiple=True, callback=_size,
              help="bytes per write; repeat [4KiB, 64KiB, 1MiB]")
@click.option("--iterations", type=click.IntRange(1), default=400, show_default=True)
@click.option("--gap-ms", "gaps_ms", multiple=True, type=click.FloatRange(min=0.0),
              help="also each size once after the target idled this long; repeat")
@click.option("--gap-iterations", type=click.IntRange(1), default=50, show_default=True)
def latency(providers: tuple[str, ...], json_path: str | None, sizes: tuple[int, ...],
            iterations: int, gaps_ms: tuple[float, ...], gap_iterations: int) -> None:
    """One write at a time: ours, the C reference's, and a C ping-pong; with
    --gap-ms, single writes after the target idled."""
    _per_provider("latency", providers, json_path, sizes=sizes or (4 << 10, 64 << 10, 1 << 20),
                  iters=iterations, gaps_ms=gaps_ms, gap_iters=gap_iterations)


@main.command()
@PROVIDER
@JSON
@click.option("--seconds", type=click.FloatRange(min=0.1), default=10.0, show_default=True)
def idle(providers: tuple[str, ...], json_path: str | None, seconds: float) -> None:
    """CPU of an open engine with no traffic."""
    _per_provider("idle", providers, json_path, seconds=seconds)


@main.command()
@PROVIDER
@JSON
@click.option("--layers", type=click.IntRange(1), default=32, show_default=True)
@click.option("--blocks", type=click.IntRange(1), default=1024, show_default=True)
@click.option("--block-size", "block_sizes", multiple=True, callback=_size,
              help="repeat [16KiB, 64KiB]")
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True)
@click.option("--describe-blocks", type=click.IntRange(1), default=1750, show_default=True)
def kv(providers: tuple[str, ...], json_path: str | None, layers: int, blocks: int,
       block_sizes: tuple[int, ...], repeat: int, describe_blocks: int) -> None:
    """KV push of whole layers against the C reference; describe cost."""
    _per_provider("kv", providers, json_path, layers=layers, blocks=blocks,
                  block_sizes=block_sizes or (16 << 10, 64 << 10), repeat=repeat,
                  describe_blocks=describe_blocks)


@main.command("control-rtt")
@JSON
@click.option("--socket", "socket_path", required=True, help="a running daemon's socket")
@click.option("--count", type=click.IntRange(1), default=500, show_default=True,
              help="timed round trips per path and round")
@click.option("--rounds", type=click.IntRange(1), default=5, show_default=True,
              help="rounds, the order of the paths rotating")
def control_rtt(json_path: str | None, socket_path: str, count: int, rounds: int) -> None:
    """Round trips of a no-op request through a daemon: trio, asyncio and
    blocking clients against raw sockets, ratios to the raw blocking one."""
    _emit("control-rtt", _run(partial(run_scenario, "control-rtt", socket=socket_path,
                                      n=count, rounds=rounds)), json_path)


if __name__ == "__main__":
    main()
