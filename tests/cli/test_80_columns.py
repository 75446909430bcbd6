"""CLI output fits 80 columns with nothing cut (``status`` and the bench
summary), and a bench plot of one size is a bar chart, not a dot."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from p2pxfer._views import print_status
from p2pxfer.bench import summary_tables
from p2pxfer.bench._report import BenchResult, RailResult, plot

WIDTH = 80


def rendered(draw: object) -> list[str]:
    out = io.StringIO()
    console = Console(width=WIDTH, file=out, color_system=None, force_terminal=False)
    draw(console)  # type: ignore[operator]
    return out.getvalue().splitlines()


def fits(lines: list[str]) -> None:
    for line in lines:
        assert len(line) <= WIDTH, f"{len(line)} columns: {line}"
        assert "…" not in line, f"cut: {line}"


STATUS = {
    "node": "prefill-node-17", "incarnation": 1795802042000745293, "provider": "tcp;ofi_rxm",
    "control": "10.200.100.17:7700", "clients": 12, "transfers_in_flight": 3,
    "membership": "embedded",
    "regions": [{"name": "kv-cache-layer-pool-0", "length": 17179869184,
                 "client": "pid:123456 uid:1000"}],
    "peers": [{"name": "decode-node-42", "address": "10.200.100.42:7700",
               "state": "unreachable", "last_heard_s": 12.5,
               "error": "peer decode-node-42 at 10.200.100.42:7700: all attempts to connect "
                        "failed (connection refused)"}],
    "links": [],
    "rails": [{"shard": s, "nic": f"enp{s}s0f1", "provider": "tcp;ofi_rxm",
               "address": f"fi_sockaddr_in://10.200.{s}.17:7501", "numa_node": s}
              for s in range(2)],
    "nics": [{"shard": s, "name": f"enp{s}s0f1", "provider": "tcp;ofi_rxm",
              "bytes": 123456789012345, "pieces": 9876543210, "inflight": 512,
              "received": 8765432109, "errors": 3} for s in range(2)],
    "notes": ["provider tcp;ofi_rxm copies through sockets while a faster one is here"],
}


def test_status_fits_80_columns() -> None:
    lines = rendered(lambda c: print_status(c, STATUS))
    fits(lines)
    text = "\n".join(lines)
    for word in ("112.3 TiB", "10.200.1.17:7501", "8765432109", "decode-node-42",
                 "17179869184", "traffic per NIC"):
        assert word in text, word


def result(provider: str, size: int, gbps: float, rails: int = 2) -> BenchResult:
    return BenchResult(
        mode="loopback", provider=provider, pattern="paged", order="random",
        page_size=65536, pages=4096, pool_pages=4096, bytes=size, concurrency=4, warmup=2,
        iterations=10, transfers=40, total_bytes=40 * size, seconds=1.0, gbps=gbps,
        baseline_seconds=1.1, baseline_gbps=gbps * 1.1, ratio=1 / 1.1, p50_us=123456.0,
        p99_us=234567.0, baseline_p50_us=100000.0, baseline_p99_us=200000.0,
        memcpy_gbps=12.46, nrails=rails,
        rails=[RailResult(name=f"veth{i}", gbps=gbps / rails, baseline_gbps=gbps / rails)
               for i in range(rails)],
        cpu_s_per_gb=0.944, baseline_cpu_s_per_gb=1.043, mooncake_gbps=2.21)


def test_bench_summary_fits_80_columns() -> None:
    results = [result("tcp;ofi_rxm", 4096 * 65536, 2.03), result("shm", 4096 * 65536, 5.39)]
    tables = summary_tables(results, 12.46, "p2pxfer bench (loopback)", width=WIDTH)
    assert len(tables) >= 2  # the whole one is wider than 80: headline first
    assert "ratio" in str([c.header for c in tables[0].columns])
    lines = rendered(lambda c: [c.print(t) for t in tables])
    fits(lines)
    text = "\n".join(lines)
    for word in ("GB/s", "C GB/s", "ratio", "Mooncake GB/s", "2.03", "5.39", "0.91",
                 "p50 us", "123456", "memcpy%"):
        assert word in text, word
    wide = summary_tables(results, 12.46, width=400)
    assert len(wide) == 1


def test_one_size_plots_bars(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "one.png"
    fig = plot([result("tcp;ofi_rxm", 1 << 20, 2.5), result("shm", 1 << 20, 5.0)], path)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear"
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    # ours and the C reference, per provider and rail (2 rails each, and their total)
    assert len(heights) == 12 and heights[-1] == round(5.0 * 1.1, 3), heights
    assert path.stat().st_size > 10_000
    sweep = plot([result("shm", s, 5.0) for s in (1 << 20, 2 << 20)], tmp_path / "two.png")
    assert sweep.axes[0].get_xscale() == "log"
