"""Turns bench/results/*.json into the Markdown that README's Performance
section and bench/results/SUMMARY.md show, and checks them.

Reads both kinds of JSON the benchmarks write: lists of ``p2pxfer bench``
records (``p2pxfer bench --json``, ``python -m p2pxfer.bench write``,
``bench/daemon.py``'s daemon.json) and scenario documents
(``{"benchmark", "results"}``: latency, dry-run, idle, kv, control round trip,
same-daemon, membership, the vLLM connector against the plain KV API, push as
computed against pull). A size sweep adds a few representative sizes to the main table
and all of them to a sweep table.

    python bench/summarize.py FILES...                  # the main table
    python bench/summarize.py --summary FILES...        # SUMMARY.md (machine, command, tables)
    python bench/summarize.py --check FILES...          # exit 1 naming what is missing
    python bench/summarize.py --readme README.md FILES  # rewrite the table between markers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from p2pxfer.bench import format_size

# Sweep sizes that make it into the main table (the rest go to the sweep table).
TABLE_SIZES = {4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20}
BEGIN, END = "<!-- bench:begin (bench/summarize.py --readme) -->", "<!-- bench:end -->"
Doc = dict[str, Any] | list[dict[str, Any]]


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GB/s"


def _cpu(r: dict[str, Any]) -> str:
    ours, ref = r.get("cpu_s_per_gb"), r.get("baseline_cpu_s_per_gb")
    if ours is None and ref is None:
        return "-"
    return f"{'-' if ours is None else f'{ours:.2f}'} / {'-' if ref is None else f'{ref:.2f}'}"


def shape(r: dict[str, Any]) -> str:
    if r["pattern"] == "contiguous":
        text = format_size(r["bytes"])
    else:
        text = f"{r['pages']}x{format_size(r['page_size'])}-{r['order']}"
    if r.get("concurrency", 1) > 1:
        text += f" x{r['concurrency']} in flight"
    if r.get("nrails", 1) > 1:
        text += f" {r['nrails']} rails"
    return text


def is_sweep(records: list[dict[str, Any]]) -> bool:
    return len({r["bytes"] for r in records if r["pattern"] == "contiguous"}) > 2


def _row(provider: str, name: str, ours: str, ref: str, ratio: str, mooncake: str, cpu: str,
         notes: str, nixl: str = "-") -> str:
    return (f"| {provider} | {name} | {ours} | {ref} | {ratio} | {nixl} | {mooncake} | {cpu} "
            f"| {notes} |")


def bench_rows(records: list[dict[str, Any]]) -> list[str]:
    """Rows for ``p2pxfer bench`` records."""
    out = []
    sweep = is_sweep(records)
    for r in records:
        if sweep and r["pattern"] == "contiguous" and r["bytes"] not in TABLE_SIZES:
            continue
        ratio = "-" if r["ratio"] is None else f"**{r['ratio']:.2f}**"
        ref = _gb(r["baseline_gbps"])
        if r.get("reference") == "c-initiator":
            ref += " (C into our target)"
        notes = f"p50 {r['p50_us']:.0f} us per transfer"
        if r["page_size"] < 1024 and r.get("baseline_seconds"):  # tiny pieces: posting rate
            pieces = r["pages"] * r["transfers"]
            notes += (f"; {pieces / r['seconds'] / 1e6:.2f} M pieces/s vs "
                      f"{pieces / r['baseline_seconds'] / 1e6:.2f} M")
        if r.get("nixl_p50_us") is not None:
            notes += f"; NIXL p50 {r['nixl_p50_us']:.0f} us per round"
        if r.get("mooncake_p50_us") is not None:
            notes += f"; Mooncake p50 {r['mooncake_p50_us']:.0f} us per round"
        if r.get("predicted_us") is not None:
            notes += "; " + _plan_note(r["predicted_us"] / 1e6, r["p50_us"] / 1e6)
        out.append(_row(r["provider"], f"{r['mode']}: {shape(r)}", _gb(r["gbps"]), ref, ratio,
                        _gb(r.get("mooncake_gbps")), _cpu(r), notes,
                        _gb(r.get("nixl_gbps"))))
    return out


def _plan_note(predicted_s: float, measured_s: float) -> str:
    return f"plan {_duration(predicted_s)} ({100 * (predicted_s / measured_s - 1):+.0f}%)"


def _duration(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.1f} ms"


#: how close ``p2pxfer plan`` must come to a measurement (issue 26's goal)
PLAN_TOLERANCE = 0.25


def plan_cases(paths: list[str]) -> list[tuple[str, float, float]]:
    """Every measurement with ``p2pxfer plan``'s prediction beside it:
    (what, predicted seconds, measured seconds)."""
    out = []
    for path in paths:
        doc = load(path)
        if isinstance(doc, list):
            out += [(f"{r['provider']} {r['mode']}: {shape(r)}", r["predicted_us"] / 1e6,
                     r["p50_us"] / 1e6) for r in doc if r.get("predicted_us") is not None]
            continue
        for r in doc["results"]:
            name = f"{r.get('provider', '')} {doc['benchmark']}: {r['pattern']}"
            if r.get("predicted_seconds") is not None:
                out.append((name, r["predicted_seconds"], r["seconds"]))
            if r.get("predicted_s") is not None:
                out.append((f"{name} (in-process engine)", r["predicted_s"], r["engine_s"]))
    return out


def plan_accuracy(paths: list[str]) -> list[str]:
    """One paragraph: how close the plan came, case by case, in this run."""
    cases = plan_cases(paths)
    if not cases:
        return []
    errs = sorted(((p / m - 1, what) for what, p, m in cases), key=lambda e: -abs(e[0]))
    within = sum(abs(e) <= PLAN_TOLERANCE for e, _ in errs)
    worst = "; ".join(f"{what} {100 * e:+.0f}%" for e, what in errs[:3])
    return ["", f"`p2pxfer plan` against each measurement, from profiles calibrated at the "
            f"start of the same run: within {PLAN_TOLERANCE:.0%} on {within} of {len(errs)} "
            f"cases; furthest: {worst}."]


def scenario_rows(doc: dict[str, Any]) -> list[str]:
    out = []
    for r in doc["results"]:
        name = f"{doc['benchmark']}: {r['pattern']}"
        p = r.get("provider", "")
        if "ratio_vs_plain" in r:  # the vLLM connector's modes against the plain KV API
            out += _connector_rows(p, name, r)
        elif "speedup_push_vs_pull" in r:  # vLLM: push as computed against pull after
            s = r["seconds"]
            out.append(_row(p, name, f"{s['push']:.3f} s pushed as computed",
                            f"{s['pull']:.3f} s pulled after the forward",
                            f"{r['speedup_push_vs_pull']:.2f}x", "-", "-",
                            f"forward alone {s['forward']:.3f} s; "
                            f"{100 * r['overlap_hidden']:.0f}% of the overlap hidden"))
        elif "memcpy_gbps" in r:  # same-daemon: ours against memcpy of the same bytes
            out.append(_row(p, name, _gb(r["gbps"]), _gb(r["memcpy_gbps"]) + " (memcpy)",
                            f"**{r['ratio_to_memcpy']:.2f}**", "-", "-",
                            f"{r['pieces']} pieces; p50 {r['p50_us']:.0f} us; engine posted "
                            f"{r['engine_bytes_posted']} bytes"))
        elif "ratio_daemon_over_engine" in r:  # kv push through daemons (kv_daemon.py)
            out.append(_row(p, name, _gb(r["daemon_GBps"]), _gb(r["c_GBps"]),
                            f"**{r['ratio_daemon_over_c']:.2f}**", "-", "-",
                            f"in-process engine {_gb(r['engine_GBps'])} (daemons / engine "
                            f"**{r['ratio_daemon_over_engine']:.2f}**); first layer after "
                            f"{r['ttfl_ms_median']:.1f} ms" + (
                                "" if r.get("predicted_s") is None else
                                "; " + _plan_note(r["predicted_s"], r["engine_s"])
                                + " of the engine's push")))
        elif "gbps" in r:  # kv push
            out.append(_row(p, name, _gb(r["gbps"]), _gb(r["baseline_gbps"]),
                            f"**{r['gbps'] / r['baseline_gbps']:.2f}**", "-", _cpu(r),
                            f"first layer after {r['time_to_first_layer_ms']:.1f} ms" + (
                                "" if r.get("predicted_seconds") is None else
                                "; " + _plan_note(r["predicted_seconds"], r["seconds"]))))
        elif "client" in r:  # control round trip, against a raw socket to the daemon
            rounds = r["round_p50_us"]
            out.append(_row(p, name, f"{r['p50_us']:.0f} us p50",
                            f"{r['baseline_p50_us']:.0f} us p50 ({r['baseline']})",
                            f"{r['ratio']:.1f}x", "-", "-",
                            f"p99 {r['p99_us']:.0f} us; round p50s {min(rounds):.0f}-"
                            f"{max(rounds):.0f} us"))
        elif "gap_ms" in r:  # latency after the target idled
            out.append(_row(p, name, f"{r['p50_us']:.0f} us p50",
                            f"{r['baseline_p50_us']:.0f} us p50", f"{r['ratio']:.1f}x", "-", "-",
                            f"each after {r['gap_ms']:g} ms idle; p99 {r['p99_us']:.0f} us "
                            f"(C {r['baseline_p99_us']:.0f} us)"))
        elif "pingpong_rtt_p50_us" in r:  # latency
            out.append(_row(p, name, f"{r['p50_us']:.0f} us p50",
                            f"{r['baseline_p50_us']:.0f} us p50", f"{r['ratio']:.1f}x", "-", "-",
                            f"C ping-pong RTT {r['pingpong_rtt_p50_us']:.0f} us "
                            f"({r['ratio_to_pingpong']:.1f}x); p99 {r['p99_us']:.0f} us"
                            + (f"; ours into the C target {r['into_c_target_p50_us']:.0f} us"
                               if "into_c_target_p50_us" in r else "")))
        elif "ns_per_page" in r:
            out.append(_row(p, name, f"{r['ns_per_page']:.0f} ns/page", "-", "-", "-", "-",
                            f"{r['pages_per_s'] / 1e6:.1f} M pages/s (no provider calls)"))
        elif "cpu_ms" in r:
            out.append(_row(p, name, f"{r['cpu_ms']:.1f} ms CPU", "-", "-", "-", "-",
                            f"{r['wall_ms']:.1f} ms wall (no provider calls)"))
        elif "cpu_fraction_of_core" in r:
            out.append(_row(p, name, f"{100 * r['cpu_fraction_of_core']:.2f}% of a core", "-",
                            "-", "-", "-", f"over {r['seconds']:.0f} s"))
        elif "p50_us" in r:
            out.append(_row(p, name, f"{r['p50_us']:.0f} us p50", "-", "-", "-", "-",
                            f"p99 {r['p99_us']:.0f} us"))
    return out


def _connector_rows(provider: str, name: str, r: dict[str, Any]) -> list[str]:
    """One row per connector mode: its throughput against the plain KV API's
    on the same pages (medians; the paired median beside it)."""
    out = []
    paired = r.get("ratio_vs_plain_paired", {})
    for mode, ratio in r["ratio_vs_plain"].items():
        post = r["cpu_ms_per_request"][mode]["describe_and_post"]
        notes = f"describe+post {post:.2f} ms CPU per request"
        if mode in paired:
            notes += f"; paired ratio {paired[mode]:.2f}"
        base = mode.split("+")[0]
        if "+checksum" in mode and base in r.get("checksum_cost_ratio", {}):
            notes += f"; checksum costs {r['checksum_cost_ratio'][base]:.2f}x"
        out.append(_row(provider, f"{name} ({mode})", _gb(r["gbps"][mode]),
                        _gb(r["gbps"]["plain"]) + " (plain KV API)", f"**{ratio:.2f}**",
                        "-", "-", notes))
    return out


def rows(doc: Doc) -> list[str]:
    return bench_rows(doc) if isinstance(doc, list) else scenario_rows(doc)


def load(path: str) -> Doc:
    with open(path) as f:
        doc: Doc = json.load(f)
    return doc


def table(paths: list[str]) -> list[str]:
    lines = ["| provider | benchmark | p2pxfer | C reference (same run) | ratio | "
             "NIXL (same run) | Mooncake (same run) | CPU s/GB ours / C | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        lines += rows(load(path))
    return lines


def sweep_table(records: list[dict[str, Any]]) -> list[str]:
    """Every point of a size sweep: one row per size, one column group per provider."""
    providers = sorted({r["provider"] for r in records})
    by = {(r["provider"], r["bytes"]): r for r in records if r["pattern"] == "contiguous"}
    sizes = sorted({b for _, b in by})
    head = "| size | " + " | ".join(f"{p} ours | {p} C ref | {p} ratio | {p} p50 us"
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
        lines.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    return lines


def sweeps(paths: list[str], heading: str, doc_dir: Path | None = None) -> list[str]:
    """The sweep tables; a plot beside a result is linked relative to
    ``doc_dir`` (the directory of the page written; None: the results' own)."""
    lines: list[str] = []
    for path in paths:
        doc = load(path)
        if not (isinstance(doc, list) and doc and is_sweep(doc)):
            continue
        memcpy = max(r["memcpy_gbps"] for r in doc)
        lines += ["", f"{heading} `p2pxfer bench` size sweep ({Path(path).name})", "",
                  "GB/s per transfer size, one transfer in flight; single-thread memcpy on "
                  f"this machine: {memcpy:.2f} GB/s.", "", *sweep_table(doc)]
        png = Path(path).with_suffix(".png")
        if png.exists():
            link = png.name if doc_dir is None else os.path.relpath(png.resolve(),
                                                                    doc_dir.resolve())
            lines += ["", f"![bandwidth vs size]({link})"]
    return lines


def check(paths: list[str], expect_mooncake: bool, expect_nixl: bool = False) -> list[str]:
    """What is wrong with the results: missing or unreadable files, empty
    results, records without their reference, a Mooncake or NIXL row that
    should be there."""
    problems = []
    for path in paths:
        try:
            doc = load(path)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: {exc}")
            continue
        records = doc if isinstance(doc, list) else doc.get("results", [])
        if not records:
            problems.append(f"{path}: no results")
        if isinstance(doc, list):
            for r in doc:
                what = f"{path}: {r.get('provider')} {shape(r)}"
                if not (r.get("gbps") or 0) > 0:
                    problems.append(f"{what}: no bandwidth")
                if r.get("ratio") is None or not r["ratio"] > 0:
                    problems.append(f"{what}: no ratio to the C reference")
                if r.get("reference") not in ("c-to-c", "c-initiator"):
                    problems.append(f"{what}: reference {r.get('reference')!r}")
                if expect_mooncake and r.get("mode") == "loopback" \
                        and r["provider"].startswith("tcp") and r["pattern"] == "paged" \
                        and r.get("mooncake_gbps") is None:
                    problems.append(f"{what}: no Mooncake row")
                if expect_nixl and r.get("mode") == "loopback" and r["pattern"] == "paged" \
                        and r.get("nixl_gbps") is None:
                    problems.append(f"{what}: no NIXL row")
        else:
            for r in records:
                if any(k in r for k in ("baseline_gbps", "baseline_p50_us")) \
                        and not (r.get("ratio") or r.get("baseline_gbps")):
                    problems.append(f"{path}: {r.get('pattern')}: no ratio to the C reference")
                if "memcpy_gbps" in r and not (r.get("ratio_to_memcpy") or 0) > 0:
                    problems.append(f"{path}: {r.get('pattern')}: no ratio to memcpy")
                if "ratio_vs_plain" in r and not all(
                        (v or 0) > 0 for v in r["ratio_vs_plain"].values()):
                    problems.append(f"{path}: {r.get('pattern')}: a mode without its ratio "
                                    "to the plain KV API")
    return problems


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


INTRO = ("Every number stands next to a C reference measured in the same run over the same "
         "provider: a C initiator posting the same pieces into a C target that busy-polls its "
         "CQ in its own process (`native/src/baseline.c`, like fabtests' `fi_rma_bw`), or, "
         "where marked, the C initiator into our own target. NIXL (UCX backend) and "
         "Mooncake Transfer Engine (TCP transport) write the same pages in the same run "
         "where installed. CPU s/GB: CPU "
         "seconds of both processes (initiator and target) per GB moved. These VMs are shared "
         "and noisy, so compare ratios, not runs.")


def summary(paths: list[str], command: str) -> list[str]:
    return ["# p2pxfer benchmark summary", "", f"Machine: {machine()}.", "",
            f"Reproduce: `{command}` (every benchmark once, one after another). {INTRO}", "",
            *table(paths), *plan_accuracy(paths), *sweeps(paths, "##")]


def rewrite_readme(readme: Path, paths: list[str], command: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = [f"Measured with `{command}` on {machine()}. {INTRO}", "", *table(paths),
            *plan_accuracy(paths), *sweeps(paths, "###", readme.parent)]
    readme.write_text(head + BEGIN + "\n" + "\n".join(body) + "\n" + END + tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--summary", action="store_true",
                    help="a whole Markdown page (machine, command, table, sweeps)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 naming every missing or incomplete result")
    ap.add_argument("--expect-nixl", action="store_true",
                    help="paged loopback records must have a NIXL row")
    ap.add_argument("--expect-mooncake", action="store_true",
                    help="with --check: paged tcp loopback records must have a Mooncake row")
    ap.add_argument("--readme", help="rewrite the table between the bench markers of this file")
    ap.add_argument("--command", default="bench/run_all", help="the command named in the text")
    ap.add_argument("paths", nargs="*")
    args = ap.parse_args()
    if args.check:
        problems = check(args.paths, args.expect_mooncake, args.expect_nixl)
        for p in problems:
            print(f"summarize: {p}", file=sys.stderr)
        return 1 if problems else 0
    if args.readme:
        rewrite_readme(Path(args.readme), args.paths, args.command)
        return 0
    lines = summary(args.paths, args.command) if args.summary else table(args.paths)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
