"""``p2pxfer plan``: the cost model, its profile file, and the calibration
that fits it on a real loopback transfer (issue 26).

The model's arithmetic is checked on made-up measurements it must recover;
the calibration runs ``p2pxfer bench --calibrate --quick`` for real
(tcp;ofi_rxm on loopback) and the plan and the bench read what it saved.
How close the predictions come on this machine is a benchmark's business
(``bench/run_all``), not a test's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from p2pxfer.cli import main
from p2pxfer.errors import InvalidArgument
from p2pxfer.kv_plan import KVLayout
from p2pxfer.plan import (
    Point,
    Profile,
    ProfileMissing,
    fit,
    load_profile,
    predict,
    predict_kv,
    profile_path,
    save_profile,
)
from p2pxfer.scatter import ScatterList

TCP = "tcp;ofi_rxm"
KIB, MIB = 1 << 10, 1 << 20
TRUE = Profile(TCP, 20e-6, 2e-6, 1 / 3e9)


def shapes(profile: Profile, noise: float = 0.0, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    out = []
    for pieces, size in ((1, 4 * KIB), (1, MIB), (1, 32 * MIB), (2048, 4 * KIB),
                         (2048, 16 * KIB), (512, 64 * KIB)):
        t = profile.seconds(pieces, pieces * size) * (1 + noise * rng.standard_normal())
        out.append(Point(pieces, pieces * size, t))
    return out


def test_fit_recovers_the_costs() -> None:
    got = fit(TCP, shapes(TRUE))
    assert got.latency_s == pytest.approx(TRUE.latency_s, rel=1e-6)
    assert got.per_piece_s == pytest.approx(TRUE.per_piece_s, rel=1e-6)
    assert got.per_byte_s == pytest.approx(TRUE.per_byte_s, rel=1e-6)
    assert all(p["model_s"] == pytest.approx(p["seconds"]) for p in got.points)
    noisy = fit(TCP, shapes(TRUE, noise=0.05, seed=3))
    assert noisy.gbps == pytest.approx(3.0, rel=0.15)


def test_a_negative_cost_is_dropped_not_kept() -> None:
    """Measurements a free per-piece cost fits best (here: it costs
    nothing) never give a negative cost."""
    free = Profile(TCP, 30e-6, 0.0, 1 / 2e9)
    pts = shapes(free, noise=0.02, seed=5)
    got = fit(TCP, pts)
    assert min(got.latency_s, got.per_piece_s, got.per_byte_s) >= 0
    with pytest.raises(InvalidArgument, match="at least 3"):
        fit(TCP, pts[:2])


def test_predictions_name_pieces_rails_and_bound() -> None:
    one = predict(TRUE, ScatterList.contiguous(4 * KIB))
    assert (one.pieces, one.bound) == (1, "latency")
    big = predict(TRUE, ScatterList.contiguous(256 * MIB))
    assert big.bound == "bandwidth" and big.gbps == pytest.approx(3.0, rel=0.01)
    off = np.arange(4096, dtype=np.int64) * 4 * KIB
    small = predict(TRUE, ScatterList(off, off[::-1].copy(), np.full(4096, 4 * KIB, np.int64)))
    assert small.pieces == 4096 and small.bound == "pieces"
    two = predict(TRUE, ScatterList.contiguous(256 * MIB), rails=2)
    assert two.rails == 2 and two.pieces >= 2
    assert two.seconds == pytest.approx(TRUE.latency_s + big.terms["bandwidth"] / 2
                                        + two.pieces / 2 * TRUE.per_piece_s)
    with pytest.raises(InvalidArgument, match="rails"):
        predict(TRUE, ScatterList.contiguous(4 * KIB), rails=0)


def test_kv_predictions_count_pieces_after_coalescing() -> None:
    lay = KVLayout(8, 256, 16 * KIB, planes=2)
    run = np.arange(64)
    seq = predict_kv(TRUE, lay, run, run)
    assert seq.pieces == 8 * 2 and seq.transfers == 8  # a run per plane per layer
    rng = np.random.default_rng(1)
    scattered = predict_kv(TRUE, lay, rng.permutation(256)[:64], rng.permutation(256)[:64],
                           layers=[0, 3])
    assert scattered.pieces >= 2 * 2 * 60 and scattered.transfers == 2
    assert scattered.nbytes == 2 * 2 * 64 * 16 * KIB
    with pytest.raises(InvalidArgument, match="dst_blocks"):
        predict_kv(TRUE, lay, run, np.zeros(64, np.int64))


def test_profiles_round_trip_and_say_what_is_missing(tmp_path: Path) -> None:
    path = save_profile(fit(TCP, shapes(TRUE)), profile_path(TCP, tmp_path))
    assert path.parent == tmp_path and "tcp_ofi_rxm" in path.name
    again = load_profile(TCP, path)
    assert again.per_piece_s == pytest.approx(TRUE.per_piece_s)
    with pytest.raises(ProfileMissing, match="p2pxfer bench --calibrate"):
        load_profile("shm", profile_path("shm", tmp_path))
    with pytest.raises(InvalidArgument, match="not 'shm'"):
        load_profile("shm", path)
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "provider": TCP}))
    with pytest.raises(InvalidArgument, match="not a calibration profile"):
        load_profile(TCP, tmp_path / "bad.json")


def test_calibrate_then_plan_then_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """The CLI end to end on a real loopback transfer: calibrate (quick),
    plan a write and a KV push from what it saved, and a bench run shows the
    plan's prediction next to its measurement."""
    monkeypatch.setenv("P2PXFER_PROFILE_DIR", str(tmp_path))
    runner = CliRunner()
    missing = runner.invoke(main, ["plan", "--size", "1MiB"])
    assert missing.exit_code == 1 and "--calibrate" in missing.output
    cal = runner.invoke(main, ["bench", "--calibrate", "--quick", "--provider", TCP])
    assert cal.exit_code == 0, cal.output
    profile = load_profile(TCP)
    assert len(profile.points) == 5 and profile.latency_s + profile.per_byte_s > 0
    out = runner.invoke(main, ["plan", "--pages", "512", "--page-size", "16KiB", "--json"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["pieces"] == 512 and got["seconds"] > 0 and got["bound"] in (
        "latency", "pieces", "bandwidth")
    kv = runner.invoke(main, ["plan", "--kv", "4,128,16KiB,2", "--blocks", "16"])
    assert kv.exit_code == 0, kv.output
    assert "KV push of 16 random blocks x 4 layers" in " ".join(kv.output.split())
    assert runner.invoke(main, ["plan", "--blocks", "3", "--size", "1MiB"]).exit_code == 2
    report = tmp_path / "bench.json"
    run = runner.invoke(main, ["bench", "--loopback", "--size", "256KiB", "--iterations", "5",
                               "--memcpy-size", "1MiB", "--quiet", "--json", str(report)])
    assert run.exit_code == 0, run.output
    rec = json.loads(report.read_text())[0]
    assert rec["predicted_us"] == pytest.approx(profile.seconds(1, 256 * KIB) * 1e6)
    assert "plan us" in run.output
