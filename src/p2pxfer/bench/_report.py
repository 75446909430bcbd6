"""Results of a bandwidth test and the ways they are shown.

``BenchResult`` is one measured point; ``to_json`` gives the record written
by ``--json`` (``RESULT_FIELDS`` lists the fields every record has and their
types). ``plot_series`` returns the lines ``--plot`` draws, ``plot`` draws
them with matplotlib (imported only here, so the package works without it),
and ``summary_table`` builds the rich table the terminal shows.
What must not live here: measuring.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from p2pxfer.plan import Profile, find_profile

from ._options import BenchError, format_size

__all__ = [
    "RESULT_FIELDS",
    "BenchResult",
    "RailResult",
    "plot",
    "plot_series",
    "read_json",
    "require_matplotlib",
    "summary_table",
    "summary_tables",
    "with_predictions",
    "write_document",
    "write_json",
]

#: Fields every JSON record has, and their types. ``baseline_gbps``, ``ratio``
#: and the baseline percentiles are ``null`` only where no baseline could be
#: measured (``--via-daemon`` when the peer's control port could not be asked).
#: ``reference`` says what the baseline was: ``"c-to-c"`` (a C initiator here
#: into a busy-polling C target in its own process: the provider's limit) or
#: ``"c-initiator"`` (the C initiator into our own target, where no C target
#: can run at the other end). ``cpu_s_per_gb`` / ``baseline_cpu_s_per_gb``:
#: CPU seconds of both ends (initiator and target processes) per GB moved,
#: ``null`` where the target's CPU cannot be read (a remote target). The
#: ``mooncake_*`` fields are Mooncake Transfer Engine's numbers on the same
#: pages in the same run, ``null`` unless it was asked for and could run; the
#: ``nixl_*`` fields NIXL's (UCX backend), likewise.
#: ``predicted_us``: what ``p2pxfer plan`` predicts for one transfer from the
#: provider's calibration profile, ``null`` where none was saved. ``memory``:
#: ``private`` (anonymous memory at both ends) or ``shared`` (memfd pages, as
#: a daemon's pools and clients' shares are).
RESULT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "mode": str,
    "provider": str,
    "pattern": str,
    "order": (str, type(None)),
    "page_size": int,
    "pages": int,
    "pool_pages": int,
    "bytes": int,
    "concurrency": int,
    "warmup": int,
    "iterations": int,
    "transfers": int,
    "total_bytes": int,
    "seconds": float,
    "gbps": float,
    "baseline_seconds": (float, type(None)),
    "baseline_gbps": (float, type(None)),
    "ratio": (float, type(None)),
    "p50_us": float,
    "p99_us": float,
    "baseline_p50_us": (float, type(None)),
    "baseline_p99_us": (float, type(None)),
    "memcpy_gbps": float,
    "nrails": int,
    "rails": list,
    "target": str,
    "reference": str,
    "cpu_s_per_gb": (float, type(None)),
    "baseline_cpu_s_per_gb": (float, type(None)),
    "mooncake_gbps": (float, type(None)),
    "mooncake_p50_us": (float, type(None)),
    "mooncake_cpu_s_per_gb": (float, type(None)),
    "nixl_gbps": (float, type(None)),
    "nixl_p50_us": (float, type(None)),
    "nixl_cpu_s_per_gb": (float, type(None)),
    "predicted_us": (float, type(None)),
    "memory": str,
}


@dataclass(frozen=True)
class RailResult:
    """Bandwidth one rail (NIC) carried: its bytes over the path's timed seconds."""

    name: str
    gbps: float
    baseline_gbps: float | None


@dataclass(frozen=True)
class BenchResult:
    """One measured point. ``bytes`` is one transfer (``page_size * pages``);
    ``seconds`` is the timed time of all ``transfers`` through our path, so
    ``gbps = total_bytes / seconds / 1e9``; the ``baseline_*`` fields are the
    C reference's (see ``reference``), over the same provider and pattern, in
    the same run (rounds alternate between them). ``ratio = gbps / baseline_gbps``.
    Latency percentiles are per transfer (ours) and per C call (baseline: one
    call posts a whole round of ``concurrency`` transfers)."""

    mode: str
    provider: str
    pattern: str
    order: str | None
    page_size: int
    pages: int
    pool_pages: int
    bytes: int
    concurrency: int
    warmup: int
    iterations: int
    transfers: int
    total_bytes: int
    seconds: float
    gbps: float
    baseline_seconds: float | None
    baseline_gbps: float | None
    ratio: float | None
    p50_us: float
    p99_us: float
    baseline_p50_us: float | None
    baseline_p99_us: float | None
    memcpy_gbps: float
    nrails: int
    target: str = ""
    rails: list[RailResult] = field(default_factory=list)
    reference: str = ""
    cpu_s_per_gb: float | None = None
    baseline_cpu_s_per_gb: float | None = None
    mooncake_gbps: float | None = None
    mooncake_p50_us: float | None = None
    mooncake_cpu_s_per_gb: float | None = None
    nixl_gbps: float | None = None
    nixl_p50_us: float | None = None
    nixl_cpu_s_per_gb: float | None = None
    #: what ``p2pxfer plan`` predicted for one transfer, from the provider's
    #: calibration profile (None: no profile)
    predicted_us: float | None = None
    memory: str = "private"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> BenchResult:
        """A record written by ``write_json`` (unknown fields are ignored)."""
        known = {f for f in cls.__dataclass_fields__ if f != "rails"}
        fields = {k: v for k, v in obj.items() if k in known}
        rails = [RailResult(**r) for r in obj.get("rails", [])]
        return cls(**fields, rails=rails)


def write_json(results: Sequence[BenchResult], path: str | Path) -> None:
    """A JSON list with one record per result."""
    text = json.dumps([r.to_json() for r in results], indent=2)
    Path(path).write_text(text + "\n")


def write_document(benchmark: str, results: Sequence[dict[str, Any]],
                   path: str | Path | None) -> str:
    """The JSON document of a scenario (``{"benchmark", "machine", "cpus",
    "results"}``, what ``bench/summarize.py`` reads), written to ``path`` if
    given; returns its text."""
    doc = {"benchmark": benchmark, "machine": platform.platform(), "cpus": os.cpu_count(),
           "results": list(results)}
    text = json.dumps(doc, indent=2) + "\n"
    if path:
        Path(path).write_text(text)
    return text


def read_json(path: str | Path) -> list[BenchResult]:
    return [BenchResult.from_json(r) for r in json.loads(Path(path).read_text())]


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cpu(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def summary_table(results: Sequence[BenchResult], memcpy_gbps: float | None = None,
                  title: str = "p2pxfer bench", *, columns: Sequence[str] | None = None,
                  caption: bool = True, keys: bool = True) -> Table:
    """One row per result; the rails and in-flight columns only when some run
    used more than one, the Mooncake column only when some run measured it.
    ``columns``: only these of the measured columns (the row's provider and
    transfer always come first; its rails and in-flight count too, unless
    ``keys`` is false)."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    multi_rail = keys and any(r.nrails > 1 for r in results)
    multi_flight = keys and any(r.concurrency > 1 for r in results)
    key_columns = ["provider", "transfer"] + ["rails"] * multi_rail \
        + ["in flight"] * multi_flight
    mooncake = any(r.mooncake_gbps is not None for r in results)
    nixl = any(r.nixl_gbps is not None for r in results)
    measured = ["GB/s", "C GB/s", "ratio"] + ["NIXL GB/s"] * nixl \
        + ["Mooncake GB/s"] * mooncake
    measured += ["p50 us"] + ["plan us"] * any(r.predicted_us is not None for r in results)
    measured += ["p99 us", "CPU s/GB", "C CPU s/GB", "memcpy%"]
    shown = [c for c in measured if columns is None or c in columns]
    for col in key_columns + shown:
        table.add_column(col, justify="left" if col in ("provider", "transfer") else "right",
                         no_wrap=True)
    for r in results:
        if r.pattern == "contiguous":
            shape = format_size(r.bytes)
        else:
            order = {"random": "rnd", "sequential": "seq"}.get(r.order or "", "")
            shape = f"{r.pages}x{format_size(r.page_size)} {order}".rstrip()
        row = [r.provider, shape] + [str(r.nrails)] * multi_rail
        row += [str(r.concurrency)] * multi_flight
        cells = {"GB/s": _gbps(r.gbps), "C GB/s": _gbps(r.baseline_gbps),
                 "ratio": "-" if r.ratio is None else f"[bold]{r.ratio:.2f}[/bold]",
                 "Mooncake GB/s": _gbps(r.mooncake_gbps), "NIXL GB/s": _gbps(r.nixl_gbps),
                 "p50 us": f"{r.p50_us:.0f}",
                 "plan us": "-" if r.predicted_us is None else f"{r.predicted_us:.0f}",
                 "p99 us": f"{r.p99_us:.0f}", "CPU s/GB": _cpu(r.cpu_s_per_gb),
                 "C CPU s/GB": _cpu(r.baseline_cpu_s_per_gb),
                 "memcpy%": f"{100 * r.gbps / r.memcpy_gbps:.0f}%"}
        table.add_row(*row, *(cells[c] for c in shown))
    if memcpy_gbps is not None and caption:
        table.caption = (f"memcpy, 1 thread: {memcpy_gbps:.2f} GB/s (the ceiling on one node). "
                         f"ratio = ours / C reference (C at both ends where the target runs "
                         f"here), same provider, pattern and run; CPU s/GB = CPU seconds of "
                         f"both ends per GB; rnd/seq = random/sequential pages; plan us = "
                         f"`p2pxfer plan`'s prediction of one transfer")
    return table


def summary_tables(results: Sequence[BenchResult], memcpy_gbps: float | None = None,
                   title: str = "p2pxfer bench", *, width: int = 80) -> list[Table]:
    """The summary as one table where it fits ``width`` columns; otherwise
    as several, each repeating the row's keys, the bandwidth (the headline)
    in the first, so no column is cut at a narrow terminal."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)

    def fits(columns: list[str], first: bool) -> bool:
        table = summary_table(results, None, title, columns=columns, keys=first)
        return Measurement.get(console, console.options, table).maximum <= width

    whole = summary_table(results, memcpy_gbps, title)
    if Measurement.get(console, console.options, whole).maximum <= width:
        return [whole]
    present = [str(c.header) for c in whole.columns]
    groups = [[c for c in group if c in present] for group in _GROUPS]
    packed: list[list[str]] = [[]]
    for group in (g for g in groups if g):
        if packed[-1] and not fits(packed[-1] + group, len(packed) == 1):
            packed.append([])
        packed[-1] += group
    # The tables after the first repeat only provider and transfer: the
    # first has the rails and in-flight counts of each row.
    return [summary_table(results, memcpy_gbps if i == len(packed) - 1 else None,
                          title if i == 0 else f"{title} (continued)", columns=columns,
                          keys=i == 0)
            for i, columns in enumerate(packed)]


#: columns that stay together when the summary is split, headline first
_GROUPS = (("GB/s", "C GB/s", "ratio"), ("NIXL GB/s", "Mooncake GB/s"),
           ("p50 us", "plan us", "p99 us"),
           ("CPU s/GB", "C CPU s/GB"), ("memcpy%",))


# -- plot ---------------------------------------------------------------------


def plot_series(results: Sequence[BenchResult]) -> dict[str, tuple[list[int], list[float]]]:
    """The lines ``plot`` draws: label -> (bytes per transfer, GB/s), sorted by
    size. One "ours" and one "baseline" line per provider and rail; with
    several rails, also a "total" line of each."""
    series: dict[str, list[tuple[int, float]]] = {}

    def add(label: str, x: int, y: float | None) -> None:
        if y is not None and math.isfinite(y):
            series.setdefault(label, []).append((x, y))

    for r in results:
        for rail in r.rails:
            add(f"ours · {r.provider} · {rail.name}", r.bytes, rail.gbps)
            add(f"baseline · {r.provider} · {rail.name}", r.bytes, rail.baseline_gbps)
        if r.nrails > 1 or not r.rails:
            add(f"ours · {r.provider} · total", r.bytes, r.gbps)
            add(f"baseline · {r.provider} · total", r.bytes, r.baseline_gbps)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for label, points in series.items():
        points.sort()
        out[label] = ([x for x, _ in points], [y for _, y in points])
    return out


def require_matplotlib() -> None:
    """Raise ``BenchError`` saying how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install 'matplotlib>=3.8' (or "
                         "install p2pxfer with its dev extra)") from exc


def plot(results: Sequence[BenchResult], path: str | Path, *, title: str = "") -> Any:
    """Bandwidth against transfer size (log2 axis), ours solid and the C
    baseline dashed, one colour per provider and rail; single-thread memcpy
    as a dotted reference; with one size only, bars instead (ours next to
    the C reference per provider and rail). Written as PNG with the Agg
    renderer; returns the matplotlib ``Figure``."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series = plot_series(results)
    if len({r.bytes for r in results}) == 1:  # one size: a line would be one dot
        _bars(ax, series, results, title)
        fig.tight_layout()
        fig.savefig(str(path), format="png")
        return fig
    colours: dict[str, Any] = {}
    cycle = [f"C{i}" for i in range(10)]
    for label, (xs, ys) in series.items():
        kind, key = label.split(" · ", 1)
        colour = colours.setdefault(key, cycle[len(colours) % len(cycle)])
        ax.plot(xs, ys, color=colour, marker="o" if kind == "ours" else "s", markersize=4,
                linestyle="-" if kind == "ours" else "--", label=label)
    memcpy = [r.memcpy_gbps for r in results]
    if memcpy:
        ax.axhline(max(memcpy), color="grey", linestyle=":", label=f"memcpy, 1 thread "
                   f"({max(memcpy):.1f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_size(int(x))
                                               if x >= 1 else ""))
    ax.set_xlabel("bytes per transfer")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    modes = sorted({r.mode for r in results})
    ax.set_title(title or f"p2pxfer bench ({', '.join(modes)}): ours vs raw C loop")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    return fig


def _bars(ax: Any, series: dict[str, tuple[list[int], list[float]]],
          results: Sequence[BenchResult], title: str) -> None:
    """One size measured: GB/s as bars, ours next to the C reference for
    each provider and rail (several points of one: their mean), labelled
    with their values, memcpy as a dotted line."""
    groups: dict[str, dict[str, float]] = {}
    for label, (_xs, ys) in series.items():
        kind, key = label.split(" · ", 1)
        groups.setdefault(key, {})[kind] = sum(ys) / len(ys)
    keys = list(groups)
    width = 0.38
    for offset, kind, colour, hatch in ((-width / 2, "ours", "C0", ""),
                                        (width / 2, "baseline", "C1", "//")):
        xs = [i + offset for i, k in enumerate(keys) if kind in groups[k]]
        ys = [groups[k][kind] for k in keys if kind in groups[k]]
        bars = ax.bar(xs, ys, width, color=colour, hatch=hatch, alpha=0.85,
                      label="ours" if kind == "ours" else "C reference (same run)")
        ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    memcpy = [r.memcpy_gbps for r in results]
    if memcpy:
        ax.axhline(max(memcpy), color="grey", linestyle=":",
                   label=f"memcpy, 1 thread ({max(memcpy):.1f} GB/s)")
    ax.set_xticks(range(len(keys)), [k.replace(" · ", "\n") for k in keys], fontsize=9)
    # Room for at least three groups, so one or two stay bars, not walls.
    middle, span = (len(keys) - 1) / 2, max(len(keys), 3)
    ax.set_xlim(middle - span / 2, middle + span / 2)
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    r = results[0]
    shape = format_size(r.bytes) if r.pattern == "contiguous" else \
        f"{r.pages} x {format_size(r.page_size)} pages"
    modes = sorted({r.mode for r in results})
    ax.set_title(title or f"p2pxfer bench ({', '.join(modes)}): {shape} per transfer, "
                 f"ours vs raw C loop")
    ax.legend(fontsize=8, loc="best")

def with_predictions(results: list[BenchResult]) -> list[BenchResult]:
    """``results``, each with what its provider's profile predicts for one
    of its transfers (where a profile was saved)."""
    profiles: dict[str, Profile | None] = {}
    out = []
    for r in results:
        if r.provider not in profiles:
            profiles[r.provider] = find_profile(r.provider)
        profile = profiles[r.provider]
        out.append(r if profile is None else dataclasses.replace(
            r, predicted_us=profile.seconds(r.pages, r.bytes, r.nrails,
                                            shared=r.memory == "shared") * 1e6))
    return out
