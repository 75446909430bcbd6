"""The ``p2pxfer`` command line. Commands only parse options, call the library
and render results (rich); no transfer logic lives here."""

from __future__ import annotations

import time
from functools import partial

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from p2pxfer.errors import P2PXferError
from p2pxfer.log import configure

DEFAULT_SOCKET = "/run/p2pxfer/p2pxfer.sock"

console = Console()


def _size(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gib": 1 << 30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    if not num.isdigit() or unit not in units:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 4096, 64KiB, 1MiB)")
    return int(num) * units[unit]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="WARNING", show_default=True, help="structlog level")
def main(log_level: str) -> None:
    """p2pxfer: RDMA writes of scatter lists between machines over libfabric."""
    configure(log_level)


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
    machine (a real loopback transfer) and verify every byte."""
    from p2pxfer.loopback import LoopbackTarget, digest, loopback_node
    from p2pxfer.scatter import ScatterList
    from p2pxfer.transport import Transport

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
        with Transport.open(provider, node=loopback_node(provider)) as t, \
                LoopbackTarget(provider, rsize) as target:
            region = t.register(src)
            # Connect and fault in pages first, so the timing is the transfer's.
            t.write(region, target.descriptor, ScatterList.contiguous(1), imm=41)
            target.wait_imm(41, 1)
            t0 = time.perf_counter()
            n = t.write(region, target.descriptor, scatter, imm=42)
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


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="TOML config (see deploy/p2pxfer.toml for every option)")
@click.option("--socket", "socket_path", help="override the config's unix socket path")
@click.option("--control", help="override the config's control host:port")
@click.option("--node", help="override the config's node name")
def daemon(config_path: str | None, socket_path: str | None, control: str | None,
           node: str | None) -> None:
    """Run the node daemon in the foreground until interrupted."""
    import dataclasses

    import trio

    from p2pxfer.daemon import DaemonConfig, serve

    try:
        cfg = DaemonConfig.from_toml(config_path) if config_path else DaemonConfig()
        cfg = dataclasses.replace(cfg, socket=socket_path or cfg.socket,
                                  control=control or cfg.control, node=node or cfg.node)
        configure(cfg.log_level)
        trio.run(partial(serve, cfg, handle_signals=True))
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc


def _client_call(socket_path: str, method: str) -> object:
    from p2pxfer.client import SyncClient

    try:
        with SyncClient(socket_path) as client:
            return getattr(client, method)()
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
def status(socket_path: str, as_json: bool) -> None:
    """Regions, peers, transfers in flight and bytes per NIC of a running daemon."""
    import json

    st = _client_call(socket_path, "status")
    assert isinstance(st, dict)
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    console.print(f"[bold]{st['node']}[/bold] incarnation {st['incarnation']} "
                  f"provider {st['provider']} control {st['control']} clients {st['clients']} "
                  f"transfers in flight {st['transfers_in_flight']}")
    regions = Table(title="regions")
    for col in ("name", "bytes", "client"):
        regions.add_column(col)
    for r in st["regions"]:
        regions.add_row(r["name"], str(r["length"]), r["client"])
    nics = Table(title="NICs")
    for col in ("shard", "nic", "bytes sent", "pieces", "in flight", "received", "errors"):
        nics.add_column(col)
    for n in st["nics"]:
        nics.add_row(str(n["shard"]), n["name"], str(n["bytes"]), str(n["pieces"]),
                     str(n["inflight"]), str(n["received"]), str(n["errors"]))
    console.print(regions)
    console.print(nics)


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def peers(socket_path: str, as_json: bool) -> None:
    """Peers the daemon knows."""
    import json

    result = _client_call(socket_path, "peers")
    assert isinstance(result, list)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    table = Table(title="peers")
    table.add_column("name")
    table.add_column("control address")
    for p in result:
        table.add_row(p["name"], p["address"])
    console.print(table)


if __name__ == "__main__":
    main()
