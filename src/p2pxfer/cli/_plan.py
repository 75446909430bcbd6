"""``p2pxfer plan``: how long a write or a KV push will take, before it runs
(``p2pxfer.plan``, from the profile ``p2pxfer bench --calibrate`` saved)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
import numpy as np
from rich.table import Table

from p2pxfer.errors import P2PXferError

from ._common import console, parse_size_flag

if TYPE_CHECKING:
    from p2pxfer.kv_plan import KVLayout

__all__ = ["plan"]


@click.command()
@click.option("--provider", default="tcp;ofi_rxm", show_default=True,
              help="whose profile to read")
@click.option("--profile", "profile_file", type=click.Path(dir_okay=False),
              help="the profile file [what --calibrate saved for --provider]")
@click.option("--rails", type=click.IntRange(min=1), default=1, show_default=True,
              help="rails the write is striped over")
@click.option("--size", help="one contiguous piece of SIZE (e.g. 64MiB)")
@click.option("--pages", type=click.IntRange(min=1), help="a write of N pages ...")
@click.option("--page-size", default="64KiB", show_default=True, help="... of this size")
@click.option("--order", type=click.Choice(["random", "sequential"]), default="random",
              show_default=True, help="pages (and KV blocks) at random places, or in a row")
@click.option("--kv", "kv_shape", metavar="LAYERS,BLOCKS,BLOCK_SIZE[,PLANES]",
              help="a KV push between two pools of this layout ...")
@click.option("--blocks", type=click.IntRange(min=1), help="... of this many blocks")
@click.option("--shared", is_flag=True, help="between shared-memory buffers (through "
              "daemons: their pools and clients' shares are memfd pages)")
@click.option("--seed", type=int, default=1, show_default=True, help="for random places")
@click.option("--json", "as_json", is_flag=True, help="print the prediction as JSON")
def plan(provider: str, profile_file: str | None, rails: int, size: str | None,
         pages: int | None, page_size: str, order: str, kv_shape: str | None,
         blocks: int | None, shared: bool, seed: int, as_json: bool) -> None:
    """Predict one write or KV push from this machine's calibration profile:
    its time, bandwidth, pieces after coalescing, rails, and what bounds it
    (the fixed cost per transfer, the cost per piece, bandwidth, or a KV
    push's further transfers: one per layer).

    \b
      p2pxfer bench --calibrate --provider 'tcp;ofi_rxm'     (once, ~1 min)
      p2pxfer plan --size 64MiB
      p2pxfer plan --pages 4096 --page-size 16KiB
      p2pxfer plan --kv 32,1024,16KiB --blocks 64 --shared
    """
    from p2pxfer.plan import load_profile, predict, predict_kv
    from p2pxfer.scatter import ScatterList

    shapes = [n for n, given in (("--size", size), ("--pages", pages), ("--kv", kv_shape))
              if given is not None]
    if len(shapes) != 1:
        raise click.UsageError("give one of --size, --pages or --kv")
    if blocks is not None and kv_shape is None:
        raise click.UsageError("--blocks is for --kv")
    rng = np.random.default_rng(seed)
    try:
        profile = load_profile(provider, profile_file)
        if size is not None:
            what = f"one piece of {size}"
            prediction = predict(profile, ScatterList.contiguous(parse_size_flag(size)),
                                 rails=rails, shared=shared)
        elif pages is not None:
            psize = parse_size_flag(page_size)
            where = rng.permutation(pages) if order == "random" else np.arange(pages)
            off = where.astype(np.int64) * psize
            lengths = np.full(pages, psize, np.int64)
            sl = ScatterList(off, rng.permutation(off) if order == "random" else off, lengths)
            what = f"{pages} {order} pages of {page_size}"
            # plain writes post as given
            prediction = predict(profile, sl, rails=rails, shared=shared)
        else:
            assert kv_shape is not None
            layout = _kv_layout(kv_shape)
            n = blocks or layout.num_blocks
            if n > layout.num_blocks:
                raise click.UsageError(f"--blocks {n} is more than the pool's "
                                       f"{layout.num_blocks}")
            pick = (rng.choice(layout.num_blocks, n, replace=False) if order == "random"
                    else np.arange(n))
            dst = rng.choice(layout.num_blocks, n, replace=False) if order == "random" else pick
            what = f"KV push of {n} {order} blocks x {layout.num_layers} layers"
            prediction = predict_kv(profile, layout, pick, dst, rails=rails, shared=shared)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"what": what, "provider": provider, "shared": shared,
                               **prediction.to_json()}, indent=2))
        return
    console.print(f"{what} over {provider}" + (" between shared memory:" if shared else ":"))
    table = Table()
    for col in ("time", "GB/s", "pieces", "rails", "bound by"):
        table.add_column(col, justify="right")
    table.add_row(_seconds(prediction.seconds), f"{prediction.gbps:.2f}",
                  str(prediction.pieces), str(prediction.rails), prediction.bound)
    console.print(table)
    terms = ", ".join(f"{k} {_seconds(v)}" for k, v in prediction.terms.items())
    console.print(f"terms: {terms} (profile of {profile.host}, {len(profile.points)} "
                  f"measurements; one rail {profile.gbps:.2f} GB/s)")


def _kv_layout(text: str) -> KVLayout:
    from p2pxfer.kv_plan import KVLayout

    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise click.UsageError("--kv is LAYERS,BLOCKS,BLOCK_SIZE[,PLANES], e.g. 32,1024,16KiB")
    try:
        layers, nblocks = int(parts[0]), int(parts[1])
        planes = int(parts[3]) if len(parts) == 4 else 1
    except ValueError:
        raise click.UsageError(f"--kv {text!r}: LAYERS, BLOCKS and PLANES are integers") \
            from None
    return KVLayout(layers, nblocks, parse_size_flag(parts[2]), planes)


def _seconds(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"
