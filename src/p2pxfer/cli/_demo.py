"""``p2pxfer demo``: a real loopback transfer, every byte verified."""

from __future__ import annotations

import time

import click
import numpy as np
from rich.table import Table

from p2pxfer.errors import P2PXferError

from ._common import console, parse_size_flag

__all__ = ["demo"]


@click.command()
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

    psize, rsize = parse_size_flag(page_size), parse_size_flag(region_size)
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


