"""The scenarios of ``python -m p2pxfer.bench`` beyond the scatter write
(dry run, latency and ping-pong, idle, KV push, control round trip) and
``bench/summarize.py``'s checks. Tiny sizes over real providers on loopback:
behaviour and the output's shape, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from p2pxfer.bench import BenchConfigError, run_scenario
from p2pxfer.bench.__main__ import main

TCP = "tcp;ofi_rxm"
ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_costs_per_page() -> None:
    (rec,) = run_scenario("dry-run", provider=TCP, pages=256, page_size=4096, repeat=3)
    assert rec["pages"] == 256 and rec["ns_per_page"] > 0
    assert rec["pages_per_s"] == pytest.approx(256 / rec["seconds"])


@pytest.mark.parametrize("provider", [TCP, "shm"])
def test_latency_against_the_c_write_and_ping_pong(provider: str) -> None:
    recs = run_scenario("latency", provider=provider, sizes=(4096, 65536), iters=20)
    assert [r["bytes"] for r in recs] == [4096, 65536]
    for r in recs:
        assert r["reference"] == "c-to-c"
        assert 0 < r["p50_us"] <= r["p99_us"]
        assert 0 < r["baseline_p50_us"] <= r["baseline_p99_us"]
        assert r["pingpong_rtt_p50_us"] > 0
        assert r["ratio"] == pytest.approx(r["p50_us"] / r["baseline_p50_us"])
        # Ours into the busy-polling C target (which counted every arrival).
        assert r["into_c_target_p50_us"] > 0
        assert r["into_c_target_ratio"] == pytest.approx(r["into_c_target_p50_us"]
                                                         / r["baseline_p50_us"])


@pytest.mark.parametrize("provider", [TCP, "shm"])
def test_latency_after_the_target_idled(provider: str) -> None:
    recs = run_scenario("latency", provider=provider, sizes=(65536,), iters=5,
                        gaps_ms=(2.0,), gap_iters=4)
    gap = [r for r in recs if "gap_ms" in r]
    assert [(r["bytes"], r["gap_ms"], r["iterations"]) for r in gap] == [(65536, 2.0, 4)]
    (r,) = gap
    assert r["pattern"] == "one 64KiB write after 2 ms idle"
    assert 0 < r["p50_us"] <= r["p99_us"] and 0 < r["baseline_p50_us"] <= r["baseline_p99_us"]
    assert r["ratio"] == pytest.approx(r["p50_us"] / r["baseline_p50_us"])


def test_idle_engine_cpu() -> None:
    (rec,) = run_scenario("idle", provider=TCP, seconds=0.3)
    assert 0 <= rec["cpu_fraction_of_core"] < 0.5


def test_kv_push_against_the_reference() -> None:
    push, describe = run_scenario("kv", provider=TCP, layers=2, blocks=16,
                                  block_sizes=(4096,), repeat=2, describe_blocks=50)
    assert push["pages"] > 0 and push["bytes"] == 2 * 16 * 4096
    assert push["gbps"] > 0 and push["baseline_gbps"] > 0 and push["reference"] == "c-to-c"
    assert push["ratio"] == pytest.approx(push["gbps"] / push["baseline_gbps"])
    assert push["time_to_first_layer_ms"] > 0
    assert push["cpu_s_per_gb"] > 0 and push["baseline_cpu_s_per_gb"] > 0
    assert describe["pages"] == 2 * 2 * 50 and describe["cpu_ms"] > 0


def test_control_round_trip_from_every_client(tmp_path: Path) -> None:
    """Trio, asyncio and blocking clients against raw sockets, one run, ratios
    to the raw blocking socket; the command line writes the same document."""
    from p2pxfer.testing import start_daemon

    d = start_daemon(tmp_path, "rtt", log_level="WARNING")
    try:
        recs = run_scenario("control-rtt", socket=d.socket, n=20, rounds=2)
        out = tmp_path / "rtt.json"
        result = CliRunner().invoke(main, ["control-rtt", "--socket", d.socket, "--count",
                                           "5", "--rounds", "1", "--json", str(out)])
    finally:
        d.stop()
    assert [r["client"] for r in recs] == ["raw-blocking", "raw-trio", "raw-asyncio", "trio",
                                           "asyncio", "sync"]
    base = recs[0]
    for r in recs:
        assert r["provider"] == TCP and r["requests"] == 40 and r["rounds"] == 2
        assert 0 < r["p50_us"] <= r["p99_us"] and len(r["round_p50_us"]) == 2
        assert r["baseline"] == "raw-blocking"
        assert r["baseline_p50_us"] == base["p50_us"]
        assert r["ratio"] == pytest.approx(r["p50_us"] / base["p50_us"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "control-rtt" and len(doc["results"]) == 6


def test_unknown_scenario() -> None:
    with pytest.raises(BenchConfigError, match="unknown scenario 'nosuch'"):
        run_scenario("nosuch")


def test_command_line_writes_the_document(tmp_path: Path) -> None:
    js = tmp_path / "d.json"
    r = CliRunner().invoke(main, ["dry-run", "--provider", f"{TCP},shm", "--pages", "64",
                                  "--page-size", "4KiB", "--repeat", "2", "--json", str(js)])
    assert r.exit_code == 0, r.output
    doc = json.loads(js.read_text())
    assert doc["benchmark"] == "dry-run" and doc["cpus"] >= 1
    assert [x["provider"] for x in doc["results"]] == [TCP, "shm"]
    bad = CliRunner().invoke(main, ["dry-run", "--page-size", "12XB"])
    assert bad.exit_code == 2 and "'12XB' is not a size" in bad.output


def test_command_line_write_with_its_reference(tmp_path: Path) -> None:
    js = tmp_path / "w.json"
    r = CliRunner().invoke(main, ["write", "--provider", TCP, "--pages", "32", "--page-size",
                                  "4KiB", "--iterations", "2", "--warmup", "1",
                                  "--memcpy-size", "4MiB", "--json", str(js)])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(js.read_text())
    assert (rec["pattern"], rec["pages"], rec["reference"]) == ("paged", 32, "c-to-c")
    assert rec["ratio"] > 0


@pytest.mark.parametrize("provider", [TCP, "shm"])
def test_write_between_shared_memory_buffers(provider: str, tmp_path: Path) -> None:
    """``--memory shared``: both ends memfd pages, as daemons' pools are
    (what ``p2pxfer plan``'s ``shared_scale`` is calibrated on); the
    target counts every transfer's notification."""
    js = tmp_path / "w.json"
    r = CliRunner().invoke(main, ["write", "--provider", provider, "--pages", "64",
                                  "--page-size", "16KiB", "--pages-per-transfer", "16",
                                  "--concurrency", "4", "--memory", "shared",
                                  "--iterations", "2", "--warmup", "1",
                                  "--memcpy-size", "4MiB", "--json", str(js)])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(js.read_text())
    assert (rec["memory"], rec["pages"], rec["concurrency"]) == ("shared", 16, 4)
    assert rec["ratio"] > 0
    bad = CliRunner().invoke(main, ["write", "--provider", provider, "--memory", "huge"])
    assert bad.exit_code == 2 and "--memory" in bad.output


def test_the_bench_server_checks_the_memory_it_is_asked_for() -> None:
    from p2pxfer.bench._server import (
        PROTOCOL_VERSION,
        ProtocolViolation,
        ServerConfig,
        _hello_fields,
    )

    hello = {"t": "hello", "v": PROTOCOL_VERSION, "provider": TCP, "size": 4096}
    assert _hello_fields(hello, ServerConfig())[4] is False  # a client that predates it
    assert _hello_fields({**hello, "memory": "shared"}, ServerConfig())[4] is True
    with pytest.raises(ProtocolViolation, match="memory"):
        _hello_fields({**hello, "memory": ["shared"]}, ServerConfig())


# -- bench/summarize.py --check: what run_all fails on ---------------------------


def _summarize(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "summarize.py"), *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _record(**over: Any) -> dict[str, Any]:
    rec = {"mode": "loopback", "provider": TCP, "pattern": "paged", "order": "random",
           "page_size": 4096, "pages": 8, "bytes": 32768, "gbps": 1.0, "baseline_gbps": 2.0,
           "ratio": 0.5, "reference": "c-to-c", "p50_us": 10.0, "memcpy_gbps": 5.0,
           "mooncake_gbps": 1.5}
    return {**rec, **over}


def test_summarize_check_fails_on_what_is_missing(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([_record()]))
    assert _summarize("--check", "--expect-mooncake", str(good)).returncode == 0
    table = _summarize(str(good))
    assert table.returncode == 0 and "| 1.50 GB/s |" in table.stdout  # the Mooncake column
    cases = {
        "missing.json": None,
        "broken.json": "[{",
        "empty.json": json.dumps({"benchmark": "x", "results": []}),
        "noratio.json": json.dumps([_record(ratio=None)]),
        "noref.json": json.dumps([_record(reference="")]),
        "nomooncake.json": json.dumps([_record(mooncake_gbps=None)]),
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        r = _summarize("--check", "--expect-mooncake", str(tmp_path / name))
        assert r.returncode == 1, name
        assert name in r.stderr
    # Without Mooncake installed, its row is not expected.
    assert _summarize("--check", str(tmp_path / "nomooncake.json")).returncode == 0


def test_summarize_shows_the_vllm_rows(tmp_path: Path) -> None:
    """The connector's modes against the plain KV API, and push as computed
    against pull (bench/vllm_connector.py, bench/vllm_push.py)."""
    modes = ("staging", "shared+checksum")
    connector = {"benchmark": "vllm_connector", "results": [{
        "provider": TCP, "pattern": "2 requests", "gbps": {"plain": 2.0, **dict.fromkeys(
            modes, 1.8)}, "ratio_vs_plain": dict.fromkeys(modes, 0.9),
        "ratio_vs_plain_paired": dict.fromkeys(modes, 0.92),
        "checksum_cost_ratio": {"shared": 1.25},
        "cpu_ms_per_request": {m: {"describe_and_post": 0.25} for m in modes}}]}
    push = {"benchmark": "vllm_push", "results": [{
        "provider": TCP, "pattern": "2 requests", "overlap_hidden": 0.5,
        "seconds": {"forward": 0.25, "pull": 1.2, "push": 1.0}, "speedup_push_vs_pull": 1.2}]}
    paths = []
    for name, doc in (("c.json", connector), ("p.json", push)):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    r = _summarize(*paths)
    assert r.returncode == 0, r.stderr
    assert "| vllm_connector: 2 requests (shared+checksum) | 1.80 GB/s | 2.00 GB/s (plain KV " \
           "API) | **0.90** |" in r.stdout
    assert "paired ratio 0.92; checksum costs 1.25x" in r.stdout
    assert "| 1.000 s pushed as computed | 1.200 s pulled after the forward | 1.20x |" in r.stdout
    assert _summarize("--check", *paths).returncode == 0
    connector["results"][0]["ratio_vs_plain"]["staging"] = None
    (tmp_path / "c.json").write_text(json.dumps(connector))
    bad = _summarize("--check", *paths)
    assert bad.returncode == 1 and "c.json" in bad.stderr


def test_summarize_says_how_close_the_plan_came(tmp_path: Path) -> None:
    """Every measurement with ``p2pxfer plan``'s prediction beside it (bench
    records, the in-process KV push, the engine's push in kv_daemon) counts
    toward one line: within 25% on how many, and the furthest first."""
    writes = [_record(predicted_us=11.0), _record(pages=16, predicted_us=5.0)]
    kv = {"benchmark": "kv", "results": [{
        "provider": TCP, "pattern": "kv 2x16 of 4KiB blocks", "gbps": 1.0,
        "baseline_gbps": 1.0, "time_to_first_layer_ms": 1.0, "seconds": 0.010,
        "predicted_seconds": 0.012}]}
    daemon = {"benchmark": "kv_daemon", "results": [{
        "provider": "shm", "pattern": "KV push", "daemon_s": 0.02, "engine_s": 0.02,
        "c_s": 0.01, "daemon_GBps": 1.0, "engine_GBps": 1.0, "c_GBps": 2.0,
        "ratio_daemon_over_engine": 1.0, "ratio_daemon_over_c": 0.5, "ttfl_ms_median": 1.0,
        "predicted_s": 0.03}]}
    paths = []
    for name, doc in (("w.json", writes), ("kv.json", kv), ("d.json", daemon)):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    r = _summarize("--summary", *paths)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "plan 11 us (+10%)" in text and "plan 12.0 ms (+20%)" in text
    assert "plan 30.0 ms (+50%) of the engine's push" in text
    assert ("within 25% on 2 of 4 cases; furthest: tcp;ofi_rxm loopback: 16x4KiB-random -50%; "
            "shm kv_daemon: KV push (in-process engine) +50%") in text


def test_summarize_rewrites_only_between_the_readme_markers(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([_record()]))
    readme = tmp_path / "README.md"
    readme.write_text("# x\nbefore\n<!-- bench:begin (bench/summarize.py --readme) -->\nold\n"
                      "<!-- bench:end -->\nafter\n")
    assert _summarize("--readme", str(readme), str(good)).returncode == 0
    text = readme.read_text()
    assert text.startswith("# x\nbefore\n<!-- bench:begin") and text.endswith("end -->\nafter\n")
    assert "old" not in text and "| tcp;ofi_rxm | loopback: 8x4KiB-random |" in text
