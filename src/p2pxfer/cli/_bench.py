"""``p2pxfer bench``: option checks here, measuring in ``p2pxfer.bench``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from p2pxfer.errors import P2PXferError

from ._common import DEFAULT_SOCKET, console

if TYPE_CHECKING:
    from p2pxfer.bench import BenchOptions

__all__ = ["bench"]


def _size_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A positive size: 4096, 64KiB, 1MiB, 2GiB."""
    from p2pxfer.bench import BenchConfigError, parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except BenchConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


_PAGED_OPTIONS = ("page_size", "pages", "order", "pages_per_transfer")


def _given(ctx: click.Context, name: str) -> bool:
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


@click.command()
@click.option("--loopback", is_flag=True,
              help="target in a second process on this host (the default mode)")
@click.option("--server", is_flag=True, help="be the target for --client runs")
@click.option("--client", "client_addr", metavar="HOST[:PORT]",
              help="measure against `p2pxfer bench --server` on HOST")
@click.option("--via-daemon", is_flag=True,
              help="write through running daemons into --region on --peer")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="server: control port to listen on; client: port of a HOST without "
                   "one [7790]")
@click.option("--bind", default="0.0.0.0", show_default=True, help="server: address to listen on")
@click.option("--once", is_flag=True, help="server: exit after the first client")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
              help="via-daemon: the local daemon's socket")
@click.option("--peer", help="via-daemon: the node that exported --region")
@click.option("--region", "region_name", help="via-daemon: the region to write into")
@click.option("--provider", "providers", multiple=True,
              help="libfabric provider; repeat (or comma-separate) for several "
                   "[tcp;ofi_rxm]")
@click.option("--rails", type=int, help="use the first N interfaces of the provider [1]")
@click.option("--interfaces", help="use exactly these interfaces, comma-separated")
@click.option("--node", help="local fabric address to bind (IP providers)")
@click.option("--pattern", type=click.Choice(["contiguous", "paged"]),
              help="one piece per transfer, or pages scattered over a pool "
                   "[contiguous; paged if a page option is given]")
@click.option("--size", metavar="SIZE", callback=_size_option,
              help="contiguous: bytes per transfer [64MiB]")
@click.option("--sweep", is_flag=True, help="contiguous: every power of two from "
              "--min-size to --max-size")
@click.option("--min-size", metavar="SIZE", callback=_size_option,
              help="sweep: smallest transfer [4KiB]")
@click.option("--max-size", metavar="SIZE", callback=_size_option,
              help="sweep: largest transfer [64MiB]")
@click.option("--page-size", metavar="SIZE", callback=_size_option,
              help="paged: bytes per page [64KiB]")
@click.option("--pages", type=int, help="paged: pages in the pool [4096]")
@click.option("--order", type=click.Choice(["random", "sequential"]),
              help="paged: which pages a transfer takes [random]")
@click.option("--pages-per-transfer", type=int, help="paged: pages per transfer [all]")
@click.option("--region-size", metavar="SIZE", callback=_size_option,
              help="target region size [what the pattern needs]")
@click.option("--concurrency", type=int, default=1, show_default=True,
              help="transfers in flight (trio tasks)")
@click.option("--warmup", type=int, default=2, show_default=True, help="untimed rounds")
@click.option("--iterations", type=int,
              help="timed rounds per size [enough for ~256 MiB, 5..2000]")
@click.option("--memcpy-size", metavar="SIZE", callback=_size_option,
              default="256MiB", show_default=True,
              help="buffer for the memcpy reference")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="seconds one round or check may take")
@click.option("--connect-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, help="seconds to reach a server")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="write the results here (a JSON list)")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="draw bandwidth vs size here (PNG; needs matplotlib)")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--nixl", is_flag=True,
              help="loopback: NIXL (UCX backend) writes the same pages too, where installed")
@click.option("--device", "device_kind", type=click.Choice(["cuda"]),
              help="KV pushes of device memory (staged) against the host path and plain "
                   "CUDA copies (--provider [shm], --page-size [64KiB], --iterations)")
@click.option("--hmem", is_flag=True,
              help="--device: also device memory registered as is (EngineConfig.hmem), "
                   "where the provider can")
@click.option("--calibrate", is_flag=True,
              help="measure the shapes `p2pxfer plan` needs (loopback) and save each "
                   "provider's profile")
@click.option("--quick", is_flag=True, help="calibrate: small shapes only (a check, ~10 s)")
@click.option("--profile-dir", type=click.Path(file_okay=False),
              help="calibrate: where profiles go [$P2PXFER_PROFILE_DIR or ~/.cache/p2pxfer]")
@click.pass_context
def bench(ctx: click.Context, loopback: bool, server: bool, client_addr: str | None,
          via_daemon: bool, port: int | None, bind: str, once: bool, socket_path: str,
          peer: str | None, region_name: str | None, providers: tuple[str, ...],
          rails: int | None, interfaces: str | None, node: str | None, pattern: str | None,
          size: int | None, sweep: bool, min_size: int | None, max_size: int | None,
          page_size: int | None, pages: int | None, order: str | None,
          pages_per_transfer: int | None, region_size: int | None, concurrency: int,
          warmup: int, iterations: int | None, memcpy_size: int, timeout: float,
          connect_timeout: float, seed: int, json_path: str | None, plot_path: str | None,
          quiet: bool, nixl: bool, device_kind: str | None, hmem: bool, calibrate: bool,
          quick: bool, profile_dir: str | None) -> None:
    """Bandwidth test: our path against the raw C loop over the same provider,
    pattern and target, in the same run, next to this machine's memcpy.

    \b
      p2pxfer bench --loopback --sweep --plot bw.png
      p2pxfer bench --loopback --provider shm --pattern paged --pages 4096
      p2pxfer bench --server --port 7790          (on machine B)
      p2pxfer bench --client B:7790 --sweep       (on machine A)
      p2pxfer bench --via-daemon --peer node-b --region kv
      p2pxfer bench --calibrate --provider 'tcp;ofi_rxm,shm'   (for `p2pxfer plan`)
      p2pxfer bench --device cuda --provider shm --json gpu.json
    """
    import dataclasses

    from p2pxfer.bench import DEFAULT_PORT, BenchConfigError, BenchOptions, sweep_sizes

    modes = [name for name, on in (("--loopback", loopback), ("--server", server),
                                   ("--client", client_addr is not None),
                                   ("--via-daemon", via_daemon)) if on]
    if len(modes) > 1:
        raise click.UsageError(f"{' and '.join(modes)} cannot be combined: pick one mode")
    mode = {"--server": "server", "--client": "client",
            "--via-daemon": "via-daemon"}.get(modes[0] if modes else "", "loopback")
    provider_list = tuple(p.strip() for v in providers for p in v.split(","))
    if hmem and device_kind is None:
        raise click.UsageError("--hmem is for --device")
    if device_kind is not None:
        if modes and modes != ["--loopback"]:
            raise click.UsageError("--device measures in loopback mode")
        _device(provider_list or ("shm",), page_size or 64 << 10, iterations or 5, json_path,
                hmem)
        return
    if calibrate:
        if modes and modes != ["--loopback"]:
            raise click.UsageError("--calibrate measures in loopback mode")
        _calibrate(provider_list or ("tcp;ofi_rxm",), quick, profile_dir, rails, interfaces)
        return
    if quick or profile_dir is not None:
        raise click.UsageError("--quick and --profile-dir are for --calibrate")
    if mode == "server":
        _bench_server(bind, DEFAULT_PORT if port is None else port, node, provider_list,
                      interfaces, once)
        return
    provider_list = provider_list or ("tcp;ofi_rxm",)
    for flag, name in (("--once", "once"), ("--bind", "bind")):
        if _given(ctx, name):
            raise click.UsageError(f"{flag} is for --server")
    if port is not None and mode != "client":
        raise click.UsageError("--port is for --server and --client")
    if mode == "via-daemon" and _given(ctx, "providers"):
        raise click.UsageError("--via-daemon uses the daemons' provider; drop --provider")
    for name in ("peer", "region_name"):
        if mode != "via-daemon" and _given(ctx, name):
            raise click.UsageError(f"--{name.split('_')[0]} is for --via-daemon")
    paged_given = [n for n in _PAGED_OPTIONS if _given(ctx, n)]
    pattern = pattern or ("paged" if paged_given else "contiguous")
    if pattern == "contiguous" and paged_given:
        raise click.UsageError(f"--{paged_given[0].replace('_', '-')} is for --pattern paged")
    if pattern == "paged" and size is not None:
        raise click.UsageError("--size is for --pattern contiguous; paged transfers are "
                               "--page-size x --pages-per-transfer")
    if sweep and size is not None:
        raise click.UsageError("--size and --sweep cannot be combined (use --min-size and "
                               "--max-size)")
    if not sweep and (min_size is not None or max_size is not None):
        raise click.UsageError("--min-size/--max-size need --sweep")
    try:
        host, cport = "127.0.0.1", DEFAULT_PORT
        if client_addr is not None:
            from p2pxfer.bench import parse_hostport

            host, cport = parse_hostport(client_addr, DEFAULT_PORT if port is None else port)
        sizes = (sweep_sizes(min_size or 4 << 10, max_size or 64 << 20) if sweep
                 else (size or 64 << 20,))
        opts = BenchOptions(
            mode=mode, providers=provider_list, pattern=pattern, sizes=sizes, sweep=sweep,
            rails=rails, node=node, concurrency=concurrency, warmup=warmup,
            iterations=iterations, region_size=region_size, memcpy_size=memcpy_size,
            seed=seed, timeout=timeout, connect_timeout=connect_timeout, host=host,
            port=cport, socket=socket_path, peer=peer or "", region=region_name or "",
            interfaces=tuple(i.strip() for i in interfaces.split(",")) if interfaces else None,
            order=order or "random", pages_per_transfer=pages_per_transfer, nixl=nixl)
        if page_size is not None:
            opts = dataclasses.replace(opts, page_size=page_size)
        if pages is not None:
            opts = dataclasses.replace(opts, pages=pages)
        elif region_size is not None and pattern == "paged":
            opts = dataclasses.replace(opts, pages=max(1, region_size // opts.page_size))
        opts.check()
    except BenchConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    _bench_run(opts, json_path, plot_path, quiet)


def _calibrate(providers: tuple[str, ...], quick: bool, profile_dir: str | None,
               rails: int | None, interfaces: str | None) -> None:
    from p2pxfer.bench import calibrate
    from p2pxfer.plan import profile_path, save_profile

    for provider in providers:
        try:
            profile = calibrate(provider, quick=quick, rails=rails,
                                interfaces=tuple(interfaces.split(",")) if interfaces else None,
                                say=lambda text: console.print(f"calibrating {text}"))
        except P2PXferError as exc:
            raise click.ClickException(str(exc)) from exc
        path = save_profile(profile, profile_path(provider, profile_dir))
        console.print(f"{provider}: fixed {profile.latency_s * 1e6:.1f} us per transfer, "
                      f"{profile.per_piece_s * 1e9:.0f} ns per piece, one rail "
                      f"{profile.gbps:.2f} GB/s; worst fit "
                      f"{_worst_fit(profile.points):.0%} (saved to {path})")


def _worst_fit(points: tuple[dict[str, Any], ...]) -> float:
    return max((abs(p["model_s"] / p["seconds"] - 1) for p in points), default=0.0)


def _bench_server(bind: str, port: int, node: str | None, providers: tuple[str, ...],
                  interfaces: str | None, once: bool) -> None:
    import trio

    from p2pxfer.bench import ServerConfig, serve

    cfg = ServerConfig(bind=bind, port=port, node=node, providers=providers,
                       interfaces=tuple(interfaces.split(",")) if interfaces else None,
                       once=once)

    def listening(host: str, bound: int) -> None:
        console.print(f"bench server listening on {host}:{bound} "
                      f"(providers: {', '.join(providers) or 'any'}); Ctrl-C stops it")

    try:
        trio.run(lambda: serve(cfg, on_listen=listening))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from exc
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc


def _bench_run(opts: BenchOptions, json_path: str | None, plot_path: str | None,
               quiet: bool) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from p2pxfer.bench import (
        BenchConfigError,
        plot,
        require_matplotlib,
        run_bench,
        summary_tables,
        write_json,
    )
    from p2pxfer.errors import ProviderNotFound

    if plot_path:
        try:
            require_matplotlib()
        except P2PXferError as exc:
            raise click.ClickException(str(exc)) from exc
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True, disable=quiet)

    class _Bar:
        task = None

        def start(self, total: int) -> None:
            self.task = bar.add_task("starting", total=total)

        def advance(self, description: str, steps: int = 1) -> None:
            if self.task is not None:
                bar.update(self.task, advance=steps, description=description)

    try:
        with bar:
            report = run_bench(opts, _Bar())
    except BenchConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except ProviderNotFound as exc:
        raise click.ClickException(exc.text) from exc
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc
    # Two narrower tables where one would not fit the terminal (80 columns
    # in a pipe, or COLUMNS): no headline number is ever cut.
    for table in summary_tables(report.results, report.memcpy_gbps,
                                title=f"p2pxfer bench ({opts.mode})", width=console.width):
        console.print(table)
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if json_path:
        write_json(report.results, json_path)
        console.print(f"results: {json_path}")
    if plot_path:
        plot(report.results, plot_path)
        console.print(f"plot: {plot_path}")



def _device(providers: tuple[str, ...], block_bytes: int, rounds: int,
            json_path: str | None, hmem: bool) -> None:
    """``--device cuda``: one table per provider, and the records as JSON."""
    import json

    from rich.console import Console
    from rich.table import Table

    from p2pxfer.bench._device import run
    from p2pxfer.errors import DeviceError

    records = []
    for provider in providers:
        try:
            rows = run(provider, block_bytes, rounds, hmem)
        except DeviceError as exc:
            raise click.ClickException(str(exc)) from exc
        records.extend(rows)
        table = Table(title=f"device KV push, {provider}")
        for col in ("row", "GB/s", "first layer ms", "per layer ms", "ratio"):
            table.add_column(col)
        regs = {r["row"]: r for r in rows if r["row"].startswith("registration")}
        for r in rows:
            if r["row"] in regs:
                continue
            ratio = r.get("ratio_vs_min_host_copy", r.get("ratio_vs_host"))
            table.add_row(r["row"], f"{r['gbps']:.2f}", f"{r.get('first_layer_ms', 0):.2f}",
                          f"{r.get('per_layer_ms', 0):.2f}",
                          "" if ratio is None else f"{ratio:.2f}")
        console = Console()
        console.print(table)
        reg = regs["registration"]
        console.print(f"registration per GiB: staging miss {reg['staging_miss_s_per_gib']:.3f}"
                      f" s, hit {reg['staging_hit_s_per_gib']:.4f} s, fabric export "
                      f"{reg['export_s_per_gib']:.3f} s")
        direct = regs.get("registration direct")
        if direct is not None and direct["available"]:
            console.print(f"device memory registered as is, per GiB: miss "
                          f"{direct['device_export_miss_s_per_gib']:.4f} s, hit "
                          f"{direct['device_export_hit_s_per_gib']:.4f} s")
        elif direct is not None:
            console.print(f"device memory cannot be registered as is: {direct['reason']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": records}, f, indent=1)
