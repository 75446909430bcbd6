"""Tables for ``p2pxfer status`` and ``p2pxfer peers``: rich renderings of
the daemon's replies, nothing else (no requests, no option parsing)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["merge_links", "print_peers", "print_status"]


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s ago"


def merge_links(peers: list[dict[str, Any]], links: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Static peers (no membership) with their control connection's state and
    last answer; members (which carry a state already) as they are."""
    by_name = {link["name"]: link for link in links}
    out = []
    for p in peers:
        if "state" in p:
            out.append(p)
            continue
        link = by_name.get(p["name"], {})
        out.append({**p, "state": link.get("state", "not contacted"),
                    "last_heard_s": link.get("last_heard_s"), "error": link.get("error", "")})
    return out


def _peer_table(peers: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    members = any("incarnation" in p for p in peers)  # membership on: their lives
    last = "incarnation" if members else "error"
    for col in ("name", "state", "address", "last heard", last):
        # A long error wraps within its column rather than widen the table.
        table.add_column(col, overflow="fold", no_wrap=col != last)
    for p in peers:
        table.add_row(p["name"], p["state"], p["address"], _ago(p.get("last_heard_s")),
                      str(p.get(last, "")))
    return table


def print_peers(console: Console, peers: list[dict[str, Any]]) -> None:
    console.print(_peer_table(peers, "peers"))


def _bytes(n: int) -> str:
    """``n`` bytes, short (``status --json`` has the exact count)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _address(text: str) -> str:
    """A rail's endpoint address as people write it (``host:port`` for IP;
    parsed here so that printing a table loads no libfabric)."""
    scheme, sep, rest = text.partition("://")
    return rest if sep and scheme.startswith("fi_sockaddr_in") else text


def print_status(console: Console, st: dict[str, Any]) -> None:
    """The daemon's state in tables that fit 80 columns: where each NIC is
    (rails) apart from what it carried (traffic)."""
    console.print(f"[bold]{st['node']}[/bold] incarnation {st['incarnation']} "
                  f"provider {st['provider']} control {st['control']} clients {st['clients']} "
                  f"transfers in flight {st['transfers_in_flight']}")
    regions = Table(title="regions")
    for col in ("name", "bytes", "client"):
        regions.add_column(col, overflow="fold")
    for r in st["regions"]:
        regions.add_row(r["name"], str(r["length"]), r["client"])
    where = {(r["shard"], r["nic"]): r for r in st.get("rails", [])}
    nics = Table(title="NICs")
    for col in ("shard", "nic", "provider", "address", "NUMA"):
        nics.add_column(col, overflow="fold")
    traffic = Table(title="traffic per NIC")
    for col in ("shard", "nic", "bytes sent", "pieces", "in flight", "received", "errors"):
        traffic.add_column(col, overflow="fold", no_wrap=col != "nic",
                           justify="left" if col == "nic" else "right")
    for n in st["nics"]:
        rail = where.get((n["shard"], n["name"]), {})
        nics.add_row(str(n["shard"]), n["name"], n.get("provider", ""),
                     _address(rail.get("address", "")), str(rail.get("numa_node", "")))
        traffic.add_row(str(n["shard"]), n["name"], _bytes(n["bytes"]), str(n["pieces"]),
                        str(n["inflight"]), str(n["received"]), str(n["errors"]))
    console.print(regions)
    console.print(_peer_table(merge_links(st["peers"], st.get("links", [])),
                              f"peers (membership: {st.get('membership', 'none')})"))
    console.print(nics)
    console.print(traffic)
    for note in st.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")
