"""Turns bench/results/*.json into the Markdown table README's Performance
section shows. Usage: python bench/summarize.py bench/results/*.json

Also reads what ``p2pxfer bench --json`` writes (a JSON list of records):
those add one row per record of a fixed pattern, and for a size sweep the
rows of a few representative sizes. ``--summary`` prints a whole Markdown
page instead (machine, command, that table, every sweep point, the plot):
``bench/run_all`` writes it to bench/results/SUMMARY.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# Sweep sizes that make it into the main table (the rest go to the sweep table).
TABLE_SIZES = {4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20}


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def shape(r: dict) -> str:
    if r["pattern"] == "contiguous":
        text = fmt_size(r["bytes"])
    else:
        text = f"{r['pages']}x{fmt_size(r['page_size'])}-{r['order']}"
    if r.get("concurrency", 1) > 1:
        text += f" x{r['concurrency']} in flight"
    if r.get("nrails", 1) > 1:
        text += f" {r['nrails']} rails"
    return text


def is_sweep(records: list[dict]) -> bool:
    contiguous = {r["bytes"] for r in records if r["pattern"] == "contiguous"}
    return len(contiguous) > 2


def bench_rows(records: list[dict], *, every_size: bool = False) -> list[str]:
    """Rows for ``p2pxfer bench --json`` records."""
    out = []
    sweep = is_sweep(records)
    for r in records:
        if sweep and not every_size and r["pattern"] == "contiguous" \
                and r["bytes"] not in TABLE_SIZES:
            continue
        name = f"bench {r['mode']}: {shape(r)}"
        notes = (f"p50 {r['p50_us']:.0f} us per transfer; "
                 f"{100 * r['gbps'] / r['memcpy_gbps']:.0f}% of memcpy")
        if r["baseline_gbps"] is None:
            out.append(f"| {r['provider']} | {name} | {r['gbps']:.2f} GB/s | - | - | {notes} |")
        else:
            out.append(f"| {r['provider']} | {name} | {r['gbps']:.2f} GB/s | "
                       f"{r['baseline_gbps']:.2f} GB/s | **{r['ratio']:.2f}** | {notes} |")
    return out


def rows(doc: dict | list) -> list[str]:
    if isinstance(doc, list):
        return bench_rows(doc)
    out = []
    for r in doc["results"]:
        name = f"{doc['benchmark']}: {r['pattern']}"
        if "gbps" in r and "baseline_gbps" in r:
            extra = ""
            if "python_ms_per_call" in r:
                extra = f"Python {r['python_ms_per_call']:.2f} ms/call"
            elif "pages_per_s" in r and r["bytes"] < 1024 * r["pages"]:
                extra = (f"{r['pages_per_s'] / 1e6:.2f} M pieces/s vs "
                         f"{r['baseline_pages_per_s'] / 1e6:.2f} M")
            out.append(f"| {r['provider']} | {name} | {r['gbps']:.2f} GB/s | "
                       f"{r['baseline_gbps']:.2f} GB/s | **{r['ratio']:.2f}** | {extra} |")
        elif "ns_per_page" in r:
            out.append(f"| {r['provider']} | {name} | {r['ns_per_page']:.0f} ns/page | - | - | "
                       f"{r['pages_per_s'] / 1e6:.1f} M pages/s (no provider calls) |")
        elif "p50_us" in r and "baseline_p50_us" not in r:
            out.append(f"| {r['provider']} | {name} | {r['p50_us']:.0f} us p50 | - | - | "
                       f"p99 {r['p99_us']:.0f} us |")
        elif "p50_us" in r:
            out.append(f"| {r['provider']} | {name} | {r['p50_us']:.0f} us p50 | "
                       f"{r['baseline_p50_us']:.0f} us (C post-to-completion) | "
                       f"{r['ratio']:.1f}x | C ping-pong RTT {r['pingpong_rtt_us']:.0f} us "
                       f"({r['ratio_to_pingpong']:.1f}x) |")
        elif "cpu_fraction_of_core" in r:
            out.append(f"| {r['provider']} | {name} | {100 * r['cpu_fraction_of_core']:.2f}% "
                       f"of a core over {r['seconds']:.0f} s | - | - | |")
    return out


def table(paths: list[str]) -> list[str]:
    lines = ["| provider | benchmark | ours | raw C baseline (same run) | ratio | notes |",
             "|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            lines += rows(json.load(f))
    return lines


def sweep_table(records: list[dict]) -> list[str]:
    """Every point of a size sweep: one row per size, one column group per provider."""
    providers = sorted({r["provider"] for r in records})
    by = {(r["provider"], r["bytes"]): r for r in records if r["pattern"] == "contiguous"}
    sizes = sorted({b for _, b in by})
    head = "| size | " + " | ".join(f"{p} ours | {p} C loop | {p} ratio | {p} p50 us"
                                    for p in providers) + " |"
    lines = [head, "|---" * (1 + 4 * len(providers)) + "|"]
    for size in sizes:
        cells = []
        for p in providers:
            r = by.get((p, size))
            if r is None:
                cells += ["-"] * 4
                continue
            base = "-" if r["baseline_gbps"] is None else f"{r['baseline_gbps']:.2f}"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            cells += [f"{r['gbps']:.2f}", base, ratio, f"{r['p50_us']:.0f}"]
        lines.append(f"| {fmt_size(size)} | " + " | ".join(cells) + " |")
    return lines


def machine() -> str:
    """One line about the machine the numbers came from."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / (1 << 20):.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        fi = subprocess.run(["fi_info", "--version"], capture_output=True, text=True,
                            timeout=10, check=False).stdout
        libfabric = next((ln.split(":", 1)[1].strip() for ln in fi.splitlines()
                          if ln.startswith("libfabric:")), "")
    except (OSError, subprocess.SubprocessError):
        libfabric = ""
    parts = [f"{os.cpu_count()} CPUs" + (f" ({model})" if model else "") + mem,
             platform.platform()]
    if libfabric:
        parts.append(f"libfabric {libfabric}")
    return "; ".join(parts)


def summary(paths: list[str], command: str) -> list[str]:
    lines = ["# p2pxfer benchmark summary", "",
             f"Machine: {machine()}.", "",
             f"Reproduce: `{command}` (every benchmark once, one after another). Every "
             "number stands next to a raw C loop measured in the same run over the same "
             "provider; these VMs are shared and noisy, so compare ratios, not runs.", "",
             *table(paths)]
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if not (isinstance(doc, list) and doc and is_sweep(doc)):
            continue
        memcpy = max(r["memcpy_gbps"] for r in doc)
        lines += ["", f"## `p2pxfer bench` size sweep ({Path(path).name})", "",
                  "GB/s per transfer size, one transfer in flight; single-thread memcpy on "
                  f"this machine: {memcpy:.2f} GB/s.", "", *sweep_table(doc)]
        png = Path(path).with_suffix(".png")
        if png.exists():
            lines += ["", f"![bandwidth vs size]({png.name})"]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", action="store_true",
                    help="a whole Markdown page (machine, command, table, sweeps)")
    ap.add_argument("--command", default="bench/run_all", help="the command named in --summary")
    ap.add_argument("paths", nargs="*")
    args = ap.parse_args()
    lines = summary(args.paths, args.command) if args.summary else table(args.paths)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
