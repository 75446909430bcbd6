"""``p2pxfer ping PEER``: is the way from this node's daemon to PEER's
working, end to end? The steps run in the daemon (``daemon/_ping.py``);
this prints them and exits 0 only if every one passed."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from p2pxfer.errors import P2PXferError

from ._common import DEFAULT_SOCKET, console

__all__ = ["ping"]


@click.command()
@click.argument("peer")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
              help="this node's daemon")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True, max=600), default=10.0,
              show_default=True, help="seconds each step may take")
@click.option("--json", "as_json", is_flag=True, help="print the daemon's answer as JSON")
def ping(peer: str, socket_path: str, timeout: float, as_json: bool) -> None:
    """Check the way to PEER through the local daemon: a control round trip,
    then a small write over every rail pair to PEER, each checked byte for
    byte by PEER's daemon. Says which step failed and, where a port does not
    answer, which port (exit 1).

    \b
      p2pxfer ping node-b --socket /run/p2pxfer/p2pxfer.sock
    """
    from p2pxfer.client import SyncClient

    try:
        with SyncClient(socket_path) as client:
            result = client.ping(peer, timeout=timeout)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        _show(result)
    if not result.get("ok"):
        raise click.ClickException(f"ping {peer}: {result.get('failed', 'failed')}")


def _show(r: dict[str, Any]) -> None:
    if "control_ms" in r:
        console.print(f"control  {r['node']} -> {r['peer']} at {r['control']}: "
                      f"ok, {r['control_ms']:.1f} ms")
    table = Table(title=f"writes over {r['provider']}", title_justify="left")
    for col in ("peer rail", "via (ours)", "bytes", "ms", "checked"):
        table.add_column(col, overflow="fold")
    for step in r.get("rails", []):
        peer_rail = f"{step.get('peer_nic') or '?'} {step.get('peer_rail', '')}"
        table.add_row(peer_rail, ", ".join(step.get("via", [])) or "-", str(step["bytes"]),
                      f"{step['ms']:.1f}" if "ms" in step else "-",
                      "[green]ok[/green]" if step["ok"] else "[red]FAILED[/red]")
    if r.get("rails"):
        console.print(table)
    if r.get("ok"):
        console.print(f"[green]ok[/green]: {r['node']} reaches {r['peer']} over "
                      f"{len(r['rails'])} rail(s), every byte checked")
