"""Results of a bandwidth test and the ways they are shown.

``BenchResult`` is one measured point; ``to_json`` gives the record written
by ``--json`` (``RESULT_FIELDS`` lists the fields every record has and their
types). ``plot_series`` returns the lines ``--plot`` draws, ``plot`` draws
them with matplotlib (imported only here, so the package works without it),
and ``summary_table`` builds the rich table the terminal shows.
What must not live here: measuring.
"""

from __future__ import annotations

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

from ._options import BenchError, format_size

__all__ = ["RESULT_FIELDS", "BenchResult", "RailResult", "plot", "plot_series",
           "read_json", "require_matplotlib", "summary_table", "write_document", "write_json"]

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
#: pages in the same run, ``null`` unless it was asked for and could run.
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
                  title: str = "p2pxfer bench") -> Table:
    """One row per result; the rails and in-flight columns only when some run
    used more than one, the Mooncake column only when some run measured it."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    multi_rail = any(r.nrails > 1 for r in results)
    multi_flight = any(r.concurrency > 1 for r in results)
    cols = ["provider", "transfer"] + ["rails"] * multi_rail + ["in flight"] * multi_flight
    mooncake = any(r.mooncake_gbps is not None for r in results)
    cols += ["GB/s", "C GB/s", "ratio"] + ["Mooncake GB/s"] * mooncake
    cols += ["p50 us", "p99 us", "CPU s/GB", "C CPU s/GB", "memcpy%"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("provider", "transfer") else "right",
                         no_wrap=True)
    for r in results:
        if r.pattern == "contiguous":
            shape = format_size(r.bytes)
        else:
            order = {"random": "rnd", "sequential": "seq"}.get(r.order or "", "")
            shape = f"{r.pages}x{format_size(r.page_size)} {order}".rstrip()
        ratio = "-" if r.ratio is None else f"[bold]{r.ratio:.2f}[/bold]"
        row = [r.provider, shape] + [str(r.nrails)] * multi_rail
        row += [str(r.concurrency)] * multi_flight
        row += [_gbps(r.gbps), _gbps(r.baseline_gbps), ratio]
        row += [_gbps(r.mooncake_gbps)] * mooncake
        row += [f"{r.p50_us:.0f}", f"{r.p99_us:.0f}", _cpu(r.cpu_s_per_gb),
                _cpu(r.baseline_cpu_s_per_gb), f"{100 * r.gbps / r.memcpy_gbps:.0f}%"]
        table.add_row(*row)
    if memcpy_gbps is not None:
        table.caption = (f"memcpy, 1 thread: {memcpy_gbps:.2f} GB/s (the ceiling on one node). "
                         f"ratio = ours / C reference (C at both ends where the target runs "
                         f"here), same provider, pattern and run; CPU s/GB = CPU seconds of "
                         f"both ends per GB; rnd/seq = random/sequential pages")
    return table


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


def plot(results: Sequence[BenchResult], path: str | Path, *, title: str = "") -> None:
    """Bandwidth against transfer size (log2 axis), ours solid and the C
    baseline dashed, one colour per provider and rail; single-thread memcpy
    as a dotted reference. Written as PNG with the Agg renderer."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series = plot_series(results)
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
