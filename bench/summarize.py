"""Turns bench/results/*.json into the Markdown table README's Performance
section shows. Usage: python bench/summarize.py bench/results/*.json"""

from __future__ import annotations

import json
import sys


def rows(doc: dict) -> list[str]:
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
        elif "p50_us" in r:
            out.append(f"| {r['provider']} | {name} | {r['p50_us']:.0f} us p50 | "
                       f"{r['baseline_p50_us']:.0f} us (C post-to-completion) | "
                       f"{r['ratio']:.1f}x | C ping-pong RTT {r['pingpong_rtt_us']:.0f} us "
                       f"({r['ratio_to_pingpong']:.1f}x) |")
        elif "cpu_fraction_of_core" in r:
            out.append(f"| {r['provider']} | {name} | {100 * r['cpu_fraction_of_core']:.2f}% "
                       f"of a core over {r['seconds']:.0f} s | - | - | |")
    return out


def main() -> int:
    lines = ["| provider | benchmark | ours | raw C baseline (same run) | ratio | notes |",
             "|---|---|---|---|---|---|"]
    for path in sys.argv[1:]:
        with open(path) as f:
            lines += rows(json.load(f))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
