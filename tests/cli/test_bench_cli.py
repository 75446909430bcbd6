"""``p2pxfer bench``: option checks, the server handshake, and short real runs.

Real providers on loopback only: tcp is bound to 127.0.0.1 (the bench does so
for loopback peers) and shm stays in the node. Sizes are tiny and iteration
counts low: these tests check behaviour and the output's shape, not speed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result

from p2pxfer.bench import (
    RESULT_FIELDS,
    BenchConfigError,
    BenchOptions,
    build_cases,
    parse_hostport,
    parse_size,
    plot_series,
    read_json,
    sweep_sizes,
)
from p2pxfer.cli import main

TCP = "tcp;ofi_rxm"
# Keeps real runs short: small buffers, few rounds.
FAST = ["--warmup", "1", "--iterations", "3", "--memcpy-size", "8MiB", "--quiet"]


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_record(rec: dict[str, Any]) -> None:
    for name, kind in RESULT_FIELDS.items():
        assert name in rec, f"missing {name}"
        value = rec[name]
        assert isinstance(value, kind), f"{name}={value!r} is not {kind}"
        if kind is int:
            assert not isinstance(value, bool)
    assert rec["gbps"] > 0 and rec["seconds"] > 0 and rec["memcpy_gbps"] > 0
    assert rec["total_bytes"] == rec["bytes"] * rec["transfers"]
    assert rec["bytes"] == rec["page_size"] * rec["pages"]
    assert rec["gbps"] == pytest.approx(rec["total_bytes"] / rec["seconds"] / 1e9)
    assert rec["p50_us"] <= rec["p99_us"]
    for rail in rec["rails"]:
        assert set(rail) == {"name", "gbps", "baseline_gbps"}


# -- pure option handling -------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("64KiB", 64 << 10),
                                             ("64k", 64 << 10), ("1M", 1 << 20),
                                             ("2GiB", 2 << 30), (" 8 KB ", 8 << 10)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12XB", "0", "-4", "", "1.5MiB", "KiB", "4 K i B"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(BenchConfigError):
        parse_size(text)


def test_sweep_sizes_and_hostport() -> None:
    assert sweep_sizes(4096, 65536) == (4096, 8192, 16384, 32768, 65536)
    assert sweep_sizes(4 << 10, 64 << 20)[-1] == 64 << 20
    assert len(sweep_sizes(4 << 10, 64 << 20)) == 15
    assert sweep_sizes(1000, 3000) == (1000, 2000, 3000)
    assert parse_hostport("10.0.0.1") == ("10.0.0.1", 7790)
    assert parse_hostport("host:81") == ("host", 81)
    assert parse_hostport("[::1]:82") == ("::1", 82)
    for bad in ("host:0", "host:x", ":80", "[::1"):
        with pytest.raises(BenchConfigError):
            parse_hostport(bad)


def test_paged_cases_stay_in_the_pool() -> None:
    opts = BenchOptions(pattern="paged", page_size=4096, pages=64, pages_per_transfer=16,
                        concurrency=3, order="random", iterations=2)
    (case,) = build_cases(opts)
    assert (case.pages, case.page_size, case.bytes) == (16, 4096, 16 * 4096)
    for lists, merged in (case.round(k) for k in range(6)):
        assert len(lists) == 3 and len(merged) == 48
        for sl in lists:
            sl.check_bounds(opts.region_bytes(), opts.region_bytes())
            assert len(set((sl.dst // 4096).tolist())) == 16  # distinct pages
    seq = build_cases(BenchOptions(pattern="paged", page_size=4096, pages=8,
                                   pages_per_transfer=3, order="sequential"))[0]
    first = [sl.dst // 4096 for sl in seq.round(0)[0] + seq.round(1)[0]]
    assert [x.tolist() for x in first] == [[0, 1, 2], [3, 4, 5]]


# -- command line validation ----------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--size", "12XB"], "'12XB' is not a size"),
    (["--size", "0"], "size must be > 0"),
    (["--size", "-4"], "size must be > 0"),
    (["--page-size", "abc"], "is not a size"),
    (["--pattern", "paged", "--page-size", "1MiB", "--region-size", "64KiB"],
     "--page-size 1MiB is larger than the region (64KiB)"),
    (["--pages", "10", "--page-size", "1MiB", "--region-size", "4MiB"], "does not fit"),
    (["--pages", "10", "--pages-per-transfer", "20"], "more than --pages 10"),
    (["--size", "8MiB", "--concurrency", "2", "--region-size", "8MiB"], "need a 16MiB region"),
    (["--client", "127.0.0.1", "--server"], "--server and --client cannot be combined"),
    (["--loopback", "--via-daemon"], "cannot be combined"),
    (["--sweep", "--size", "4KiB"], "--size and --sweep cannot be combined"),
    (["--min-size", "4KiB"], "need --sweep"),
    (["--sweep", "--min-size", "1MiB", "--max-size", "4KiB"], "is larger than --max-size"),
    (["--sweep", "--pattern", "paged"], "cannot be combined with --pattern paged"),
    (["--pattern", "contiguous", "--page-size", "4KiB"], "--page-size is for --pattern paged"),
    (["--pattern", "paged", "--size", "4KiB"], "--size is for --pattern contiguous"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--rails", "2", "--interfaces", "lo"], "--rails 2 but --interfaces names 1"),
    (["--via-daemon"], "needs --socket, --peer and --region"),
    (["--peer", "b"], "--peer is for --via-daemon"),
    (["--client", "host:99999"], "port must be a number"),
    (["--once"], "--once is for --server"),
    (["--hmem"], "--hmem is for --device"),
])
def test_bad_options_are_usage_errors(args: list[str], message: str) -> None:
    r = bench(*args, "--quiet")
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def test_unknown_provider_is_a_clean_error() -> None:
    t0 = time.monotonic()
    r = bench("--provider", "nosuch", "--size", "4KiB", *FAST)
    assert r.exit_code == 1
    assert "no provider 'nosuch'" in r.output and "fi_info -l" in r.output
    assert "Traceback" not in r.output
    assert time.monotonic() - t0 < 10


def test_device_bench_without_a_gpu_is_a_clean_error() -> None:
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here: tests/gpu runs the device bench")
    r = bench("--device", "cuda", "--hmem", "--provider", "shm")
    assert r.exit_code == 1
    assert "libcuda.so.1" in r.output and "NVIDIA driver" in r.output
    assert "Traceback" not in r.output


def test_too_many_rails_on_loopback() -> None:
    r = bench("--rails", "4", "--size", "4KiB", *FAST)
    assert r.exit_code == 1
    assert "4 rails were asked for" in r.output


def test_unreachable_server_fails_fast() -> None:
    port = closed_port()
    t0 = time.monotonic()
    r = bench("--client", f"127.0.0.1:{port}", "--size", "4KiB", *FAST)
    assert time.monotonic() - t0 < 5
    assert r.exit_code == 1
    assert f"cannot reach the bench server at 127.0.0.1:{port}" in r.output
    assert "connection refused" in r.output


def test_silent_server_times_out() -> None:
    """A peer that accepts the connection but never answers: the hello times
    out after --timeout, no hang."""
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        port = lsock.getsockname()[1]
        t0 = time.monotonic()
        r = bench("--client", f"127.0.0.1:{port}", "--size", "4KiB", "--timeout", "1.5", *FAST)
        elapsed = time.monotonic() - t0
    assert r.exit_code == 1
    assert "did not answer hello within 1.5 s" in r.output
    assert elapsed < 8


def test_plot_without_matplotlib_says_so(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    r = bench("--size", "4KiB", "--plot", str(tmp_path / "x.png"), *FAST)
    assert r.exit_code == 1
    assert "--plot needs matplotlib" in r.output


# -- real runs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path, Path]:
    """One short loopback sweep over tcp and shm, with --json and --plot."""
    out = tmp_path_factory.mktemp("bench")
    js, png = out / "r.json", out / "r.png"
    r = bench("--loopback", "--provider", f"{TCP},shm", "--sweep", "--min-size", "4KiB",
              "--max-size", "16KiB", "--json", str(js), "--plot", str(png), *FAST)
    return r, js, png


def test_loopback_sweep_table(sweep_run: tuple[Result, Path, Path]) -> None:
    r, _, _ = sweep_run
    assert r.exit_code == 0, r.output
    for text in ("p2pxfer bench (loopback)", TCP, "shm", "4KiB", "16KiB", "C GB/s", "ratio",
                 "memcpy, 1 thread"):
        assert text in r.output


def test_loopback_json_schema(sweep_run: tuple[Result, Path, Path]) -> None:
    r, js, _ = sweep_run
    assert r.exit_code == 0, r.output
    records = json.loads(js.read_text())
    assert isinstance(records, list) and len(records) == 6
    for rec in records:
        check_record(rec)
        # Every loopback run has its same-run baseline.
        assert rec["baseline_gbps"] > 0 and rec["baseline_seconds"] > 0
        assert rec["ratio"] == pytest.approx(rec["gbps"] / rec["baseline_gbps"])
        assert rec["baseline_p50_us"] <= rec["baseline_p99_us"]
        assert (rec["mode"], rec["pattern"], rec["pages"], rec["concurrency"]) == (
            "loopback", "contiguous", 1, 1)
        assert (rec["iterations"], rec["warmup"], rec["transfers"]) == (3, 1, 3)
        assert rec["nrails"] == len(rec["rails"]) == 1
        # C at both ends; the CPU of both processes of each path is known here.
        assert rec["reference"] == "c-to-c"
        assert rec["cpu_s_per_gb"] > 0 and rec["baseline_cpu_s_per_gb"] > 0
        assert rec["mooncake_gbps"] is None  # not asked for
    assert sorted((r["provider"], r["bytes"]) for r in records) == sorted(
        (p, s) for p in (TCP, "shm") for s in (4096, 8192, 16384))
    assert len({r["memcpy_gbps"] for r in records}) == 1


def test_plot_is_a_png_with_ours_and_baseline_per_rail(
        sweep_run: tuple[Result, Path, Path]) -> None:
    r, js, png = sweep_run
    assert r.exit_code == 0, r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
    series = plot_series(read_json(js))
    assert set(series) == {f"ours · {TCP} · lo", f"baseline · {TCP} · lo",
                           "ours · shm · shm", "baseline · shm · shm"}
    for xs, ys in series.values():
        assert xs == [4096, 8192, 16384]
        assert all(y > 0 for y in ys)


def test_loopback_paged_with_concurrency(tmp_path: Path) -> None:
    js = tmp_path / "paged.json"
    r = bench("--provider", TCP, "--pattern", "paged", "--page-size", "4KiB", "--pages", "64",
              "--pages-per-transfer", "16", "--order", "sequential", "--concurrency", "2",
              "--json", str(js), *FAST)
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(js.read_text())
    check_record(rec)
    assert (rec["pattern"], rec["order"], rec["page_size"], rec["pages"], rec["pool_pages"],
            rec["bytes"], rec["concurrency"], rec["transfers"]) == (
        "paged", "sequential", 4096, 16, 64, 65536, 2, 6)
    assert rec["ratio"] > 0
    assert "16x4KiB seq" in r.output


# -- two "machines": a server process and a client ------------------------------


@pytest.fixture
def server() -> Iterator[int]:
    """`p2pxfer bench --server --once` on 127.0.0.1 in its own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pxfer", "bench", "--server", "--bind", "127.0.0.1",
         "--port", "0", "--once"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        yield int(m[1])
        proc.wait(20)  # --once: gone after the client
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_client_against_server_process(server: int, tmp_path: Path) -> None:
    js = tmp_path / "c.json"
    r = bench("--client", f"127.0.0.1:{server}", "--provider", f"{TCP},shm", "--size", "64KiB",
              "--json", str(js), *FAST)
    assert r.exit_code == 0, r.output
    records = json.loads(js.read_text())
    assert [rec["provider"] for rec in records] == [TCP, "shm"]
    for rec in records:
        check_record(rec)
        assert rec["mode"] == "client" and rec["target"].endswith(f"127.0.0.1:{server}")
        assert rec["baseline_gbps"] > 0
        # No C target runs at a remote server: the C initiator writes into ours,
        # and the remote target's CPU is unknown.
        assert rec["reference"] == "c-initiator"
        assert rec["cpu_s_per_gb"] is None and rec["baseline_cpu_s_per_gb"] is None


def test_server_refuses_bad_requests(server: int) -> None:
    """Garbage and an unknown provider get an error message, not a hang; the
    server keeps serving until the client leaves."""
    from p2pxfer.bench._server import PROTOCOL_VERSION, Wire

    async def talk() -> list[dict[str, Any]]:
        stream = await trio.open_tcp_stream("127.0.0.1", server)
        wire = Wire(stream)
        with trio.fail_after(10):
            await wire.send("hello", v=PROTOCOL_VERSION, provider="nosuch", size=4096, rails=1)
            first = await wire.recv()
        await stream.aclose()
        return [first]

    (reply,) = trio.run(talk)
    assert reply["t"] == "error" and "nosuch" in reply["message"]


# -- through daemons ------------------------------------------------------------


def _start_daemon(tmp: Path, name: str, port: int, peers: dict[str, int]) -> Any:
    lines = [f'node = "{name}"', f'socket = "{tmp}/{name}.sock"',
             f'control = "127.0.0.1:{port}"', f'provider = "{TCP}"',
             'fabric_node = "127.0.0.1"', 'log_level = "WARNING"']
    for peer, pport in peers.items():
        lines += ["[[peers]]", f'name = "{peer}"', f'address = "127.0.0.1:{pport}"']
    (tmp / f"{name}.toml").write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "p2pxfer", "daemon", "--config",
                             str(tmp / f"{name}.toml")])
    deadline = time.monotonic() + 30
    while not (tmp / f"{name}.sock").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"daemon {name} did not start")
        time.sleep(0.05)
    return proc


def test_via_daemon(tmp_path: Path) -> None:
    from p2pxfer import connect

    pa, pb = closed_port(), closed_port()
    procs = [_start_daemon(tmp_path, "b", pb, {})]
    try:
        procs.append(_start_daemon(tmp_path, "a", pa, {"b": pb}))
        js = tmp_path / "d.json"

        sock = str(tmp_path / "a.sock")

        def runs() -> list[Result]:
            return [
                bench("--via-daemon", "--socket", sock, "--peer", "b", "--region", "kv",
                      "--size", "256KiB", "--json", str(js), *FAST),
                # A pattern larger than the peer's region: refused before anything runs.
                bench("--via-daemon", "--socket", sock, "--peer", "b", "--region", "kv",
                      "--size", "4MiB", *FAST),
                bench("--via-daemon", "--socket", sock, "--peer", "zz", "--region", "kv",
                      "--size", "4KiB", *FAST),
            ]

        async def with_region() -> list[Result]:
            async with connect(str(tmp_path / "b.sock")) as cb:
                await cb.export("kv", await cb.alloc(1 << 20))
                return await trio.to_thread.run_sync(runs)

        r, big, unknown = trio.run(with_region)
        assert r.exit_code == 0, r.output
        (rec,) = json.loads(js.read_text())
        check_record(rec)
        assert (rec["mode"], rec["provider"], rec["target"]) == ("via-daemon", TCP, "b:kv")
        assert rec["baseline_gbps"] > 0  # the region's descriptor came from b's control port
        assert rec["reference"] == "c-initiator"
        assert big.exit_code == 2 and "region 'kv' on b is 1MiB" in big.output
        assert unknown.exit_code == 2 and "knows no peer 'zz'" in unknown.output
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# -- two rails between two namespaces --------------------------------------------


def test_open_rails_picks_interfaces_by_name() -> None:
    from p2pxfer.bench import BenchError
    from p2pxfer.bench._reference import close_rails, open_rails

    rails = open_rails(TCP, "127.0.0.1", ("lo",))
    try:
        assert [r.name for r in rails] == ["lo"]
    finally:
        close_rails(rails)
    with pytest.raises(BenchError, match="no interface nosuch0"):
        open_rails(TCP, "127.0.0.1", ("nosuch0",))


@pytest.mark.netns
def test_client_server_two_rails_in_namespaces(tmp_path: Path) -> None:
    """Server in namespace B, client in A, two veth rails: every rail carries
    bytes on both paths (ours and the C loop), and the plot has a line per rail."""
    from netns import two_hosts

    js = tmp_path / "rails.json"
    with two_hosts(2) as (a, b):
        srv = subprocess.Popen(
            b.exec_argv([sys.executable, "-m", "p2pxfer", "bench", "--server", "--bind",
                         b.addresses[0], "--port", "0", "--once", "--interfaces",
                         ",".join(b.interfaces)]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert srv.stdout is not None
            m = re.search(r":(\d+) ", srv.stdout.readline())
            assert m
            r = subprocess.run(
                a.exec_argv([sys.executable, "-m", "p2pxfer", "bench", "--client",
                             f"{b.addresses[0]}:{m[1]}", "--interfaces", ",".join(a.interfaces),
                             "--sweep", "--min-size", "1MiB", "--max-size", "2MiB",
                             "--json", str(js), *FAST]),
                capture_output=True, text=True, timeout=120, check=False)
            assert r.returncode == 0, r.stdout + r.stderr
            srv.wait(20)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()
    records = json.loads(js.read_text())
    assert len(records) == 2
    for rec in records:
        check_record(rec)
        assert rec["nrails"] == 2
        assert [x["name"] for x in rec["rails"]] == list(a.interfaces)
        for rail in rec["rails"]:
            assert rail["gbps"] > 0 and rail["baseline_gbps"] > 0
    series = plot_series(read_json(js))
    assert {f"{kind} · {TCP} · {name}" for kind in ("ours", "baseline")
            for name in (*a.interfaces, "total")} == set(series)
