"""The ``p2pxfer`` command line. Commands only parse options, call the library
and render results (rich); no transfer logic lives here."""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from p2pxfer._certs_cli import certs
from p2pxfer.errors import ConfigError, InvalidArgument, P2PXferError
from p2pxfer.log import configure

if TYPE_CHECKING:
    from p2pxfer.bench import BenchOptions

DEFAULT_SOCKET = "/run/p2pxfer/p2pxfer.sock"

console = Console()


def _size(text: str) -> int:
    from p2pxfer.address import parse_size

    try:
        return parse_size(text)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="p2pxfer", message="p2pxfer %(version)s")
@click.option("--log-level", default="WARNING", show_default=True, help="structlog level",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                                case_sensitive=False))
def main(log_level: str) -> None:
    """p2pxfer: RDMA writes of scatter lists between machines over libfabric."""
    configure(log_level)


main.add_command(certs)


@main.command()
@click.option("--provider", default="tcp;ofi_rxm", show_default=True,
              help="libfabric provider (tcp;ofi_rxm, shm, verbs;ofi_rxm, efa)")
@click.option("--pages", default=4096, show_default=True, help="pages per transfer")
@click.option("--page-size", default="64KiB", show_default=True, help="bytes per page")
@click.option("--region", "region_size", default="512MiB", show_default=True,
              help="size of the target region")
@click.option("--seed", default=1, show_default=True)
def demo(provider: str, pages: int, page_size: str, region_size: str, seed: int) -> None:
    """Write random pages into a region exported by a second process on this
    machine (a real loopback transfer through the engine) and verify every byte."""
    from p2pxfer.engine import BlockingEngine
    from p2pxfer.loopback import LoopbackTarget, digest, loopback_node
    from p2pxfer.scatter import ScatterList

    psize, rsize = _size(page_size), _size(region_size)
    slots = rsize // psize
    if pages <= 0 or pages > slots:
        raise click.BadParameter(f"--pages must be in 1..{slots} for this region and page size")
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, pages * psize, dtype=np.uint8)
    dst_pages = rng.choice(slots, pages, replace=False).astype(np.int64)
    scatter = ScatterList(np.arange(pages, dtype=np.int64) * psize, dst_pages * psize,
                          np.full(pages, psize, np.int64))
    expected = np.zeros(rsize, np.uint8)
    expected[0] = src[0]  # the warm-up write below
    expected.reshape(slots, psize)[dst_pages] = src.reshape(pages, psize)
    try:
        with BlockingEngine.open(provider, node=loopback_node(provider)) as t, \
                LoopbackTarget(provider, rsize) as target:
            t.register(src)
            # Connect and fault in pages first, so the timing is the transfer's.
            t.write(src, target.descriptor, ScatterList.contiguous(1), imm=41)
            target.wait_imm(41, 1)
            t0 = time.perf_counter()
            n = t.write(src, target.descriptor, scatter, imm=42)
            seconds = time.perf_counter() - t0
            landed = target.wait_imm(42, n)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc
    ok = landed == digest(expected)
    table = Table(title=f"p2pxfer demo over {provider}")
    for col in ("pieces", "bytes", "seconds", "GB/s", "verified"):
        table.add_column(col)
    table.add_row(str(n), str(scatter.nbytes), f"{seconds:.4f}",
                  f"{scatter.nbytes / seconds / 1e9:.2f}", "yes" if ok else "NO")
    console.print(table)
    if not ok:
        raise click.ClickException("destination bytes differ from what was written")


class _ConfigFailure(click.ClickException):
    """A wrong config: exit 78 (EX_CONFIG), which the systemd unit does not
    restart on (a restart cannot fix it)."""

    exit_code = 78


def _peer_flag(ctx: click.Context, param: click.Parameter,
               value: tuple[str, ...]) -> tuple[object, ...]:
    from p2pxfer.daemon._config import parse_peer

    try:
        return tuple(parse_peer(v) for v in value)
    except P2PXferError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML config (see deploy/p2pxfer.toml for every option)")
@click.option("--node", help="this node's name (config: node)")
@click.option("--socket", "socket_path", help="unix socket for clients (config: socket)")
@click.option("--control", metavar="HOST:PORT", help="control listener (config: control)")
@click.option("--peer", "peer_list", metavar="NAME=HOST:PORT", multiple=True,
              callback=_peer_flag, help="a peer daemon's control address; repeatable "
              "(added to the config's peers)")
@click.option("--provider", help="libfabric provider (config: provider)")
@click.option("--fabric-node", help="local address the fabric binds to (config: fabric_node)")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="file holding the cluster token (config: cluster_token_file)")
@click.option("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics (config: metrics)")
@click.option("--log-format", type=click.Choice(["console", "json"]),
              help="log lines as text or JSON (config: log_format)")
@click.option("--debug", is_flag=True, help="on a startup failure, show the traceback")
def daemon(config_path: str | None, node: str | None, socket_path: str | None,
           control: str | None, peer_list: tuple[object, ...], provider: str | None,
           fabric_node: str | None, token_file: str | None, metrics: str | None,
           log_format: str | None, debug: bool) -> None:
    """Run the node daemon in the foreground until interrupted (SIGINT, SIGTERM).

    \b
    Flags override the config file; without --config the defaults apply:
      p2pxfer daemon --node a --socket /tmp/a.sock --control 127.0.0.1:7700 \\
          --fabric-node 127.0.0.1 --peer b=127.0.0.1:7701
    """
    import trio

    from p2pxfer._startup import check_startup, one_line
    from p2pxfer.daemon import DaemonConfig, serve

    flags = {"node": node, "socket": socket_path, "control": control, "provider": provider,
             "fabric_node": fabric_node, "cluster_token_file": token_file,
             "metrics": metrics, "log_format": log_format}
    overrides: dict[str, object] = {k: v for k, v in flags.items() if v is not None}
    if peer_list:
        overrides["peers"] = list(peer_list)
    try:
        cfg = DaemonConfig.load(config_path, **overrides)
        configure(cfg.log_level, json=cfg.log_format == "json")
        check_startup(cfg)
    except P2PXferError as exc:
        if debug:
            raise
        if isinstance(exc, ConfigError):
            raise _ConfigFailure(str(exc)) from None
        raise click.ClickException(str(exc)) from None
    try:
        trio.run(partial(serve, cfg, handle_signals=True))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # the edge: everything becomes one line (or a traceback)
        if debug:
            raise
        raise click.ClickException(one_line(exc, cfg)) from None


def _client_call(socket_path: str, method: str, wait_s: float = 0.0) -> object:
    from p2pxfer.client._sync import call_daemon

    try:
        return call_daemon(socket_path, method, wait_s)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=0.0,
              metavar="SECONDS",
              help="wait up to SECONDS for a daemon that is still starting to answer")
@click.option("--quiet", "-q", is_flag=True, help="print nothing: the exit status says it all")
def status(socket_path: str, as_json: bool, wait_s: float, quiet: bool) -> None:
    """Regions, peers, transfers in flight and bytes per NIC of a running daemon.
    With --wait, also the way to wait for a daemon started in the background
    (exit status 0 once it answers, 1 if it did not in time)."""
    import json

    from p2pxfer._views import print_status

    st = _client_call(socket_path, "status", wait_s)
    assert isinstance(st, dict)
    if quiet:
        return
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    # Logs and pipes get the whole NIC table, not one cut to 80 columns.
    print_status(console if console.is_terminal else Console(width=max(console.width, 160)), st)


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def peers(socket_path: str, as_json: bool) -> None:
    """Peers the daemon knows (with membership: every member, its state,
    incarnation, address and when it was last heard)."""
    import json

    from p2pxfer._views import merge_links, print_peers

    result = _client_call(socket_path, "peers")
    assert isinstance(result, list)
    if as_json:  # the daemon's reply as it is (status --json has the links too)
        click.echo(json.dumps(result, indent=2))
        return
    if not any("state" in p for p in result):  # static peers: add their links' state
        st = _client_call(socket_path, "status")
        assert isinstance(st, dict)
        result = merge_links(result, st.get("links", []))
    print_peers(console, result)


# -- bench --------------------------------------------------------------------


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


@main.command()
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
              help="timed rounds per size [enough for ~256 MiB, 5..200]")
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
          quiet: bool) -> None:
    """Bandwidth test: our path against the raw C loop over the same provider,
    pattern and target, in the same run, next to this machine's memcpy.

    \b
      p2pxfer bench --loopback --sweep --plot bw.png
      p2pxfer bench --loopback --provider shm --pattern paged --pages 4096
      p2pxfer bench --server --port 7790          (on machine B)
      p2pxfer bench --client B:7790 --sweep       (on machine A)
      p2pxfer bench --via-daemon --peer node-b --region kv
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
            order=order or "random", pages_per_transfer=pages_per_transfer)
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
        summary_table,
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
        raise click.ClickException(f"{exc.text}; `fi_info -l` lists the providers "
                                   f"this machine has") from exc
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc
    # Logs and pipes get the whole table, not one cut to 80 columns.
    out = console if console.is_terminal else Console(width=max(console.width, 120))
    out.print(summary_table(report.results, report.memcpy_gbps,
                            title=f"p2pxfer bench ({opts.mode})"))
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if json_path:
        write_json(report.results, json_path)
        console.print(f"results: {json_path}")
    if plot_path:
        plot(report.results, plot_path)
        console.print(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
