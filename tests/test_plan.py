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

from p2pxfer.bench import run_scenario
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
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
EAGER = 16 * KIB  # where the made-up provider below changes protocol


def linear(latency: float, per_piece: float, gbps: float) -> Profile:
    """The three-constant model as curves: a lone piece costs ``latency +
    per_piece + bytes / rate``, each further one ``per_piece + bytes / rate``."""
    per_byte = 1 / (gbps * 1e9)
    return Profile(TCP, ((1, latency + per_piece + per_byte), (GIB, latency + per_piece
                                                               + GIB * per_byte)),
                   ((1, per_piece + per_byte), (GIB, per_piece + GIB * per_byte)))


TRUE = linear(20e-6, 2e-6, 3.0)


def stepped(pieces: int, size: int) -> float:
    """A made-up provider whose pieces past ``EAGER`` take a rendezvous
    (a round trip more when alone, 4 us more each in a stream)."""
    lone = 20e-6 + size / 3e9 + (15e-6 if size > EAGER else 0.0)
    each = 1e-6 + size / 6e9 + (4e-6 if size > EAGER else 0.0)
    return lone + (pieces - 1) * each


SHAPES = [(1, s) for s in (4 * KIB, EAGER, EAGER + 1, MIB, 64 * MIB)] + [
    (16384, 8), (2048, 4 * KIB), (2048, EAGER), (1024, EAGER + 1), (64, MIB), (16, 4 * MIB)]


def shapes(truth=stepped, noise: float = 0.0, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    return [Point(n, n * size, truth(n, size) * (1 + noise * rng.standard_normal()))
            for n, size in SHAPES]


def test_fit_follows_the_provider_across_its_protocol_change() -> None:
    """Measured at a few sizes, the curves predict shapes never measured,
    on either side of a protocol change a single line would blur."""
    got = fit(TCP, shapes())
    assert all(p["model_s"] == pytest.approx(p["seconds"], rel=1e-9) for p in got.points)
    for pieces, size in ((1, 8 * KIB), (4096, 8 * KIB), (4096, 256 * KIB), (1, 16 * MIB),
                         (3, 128 * MIB), (65536, 8)):
        assert got.seconds(pieces, pieces * size) == pytest.approx(stepped(pieces, size),
                                                                  rel=1e-4), (pieces, size)
    assert got.gbps == pytest.approx(6.0, rel=1e-6)
    # one line through the same shapes misses one side or the other by far
    a = np.array([[1.0, n, n * size] for n, size in SHAPES])
    t = np.array([stepped(n, size) for n, size in SHAPES])
    line, *_ = np.linalg.lstsq(a / t[:, None], np.ones(len(t)), rcond=None)
    assert max(abs(a @ line / t - 1)) > 0.25


def test_noise_never_makes_a_larger_piece_cheaper() -> None:
    """A measurement that makes a larger piece cheaper (here a 16 KiB
    stream faster than the 4 KiB one) lowers the smaller sizes' cost, never
    stays a dip; one far slower than a larger piece's (a lone 16 KiB piece
    10x slow, a disturbed measurement) is lowered to that, never raises its
    neighbours."""
    pts = shapes(noise=0.05, seed=7)
    pts[SHAPES.index((2048, EAGER))] = Point(2048, 2048 * EAGER, 1e-3)
    pts[SHAPES.index((1, EAGER))] = Point(1, EAGER, 10 * stepped(1, EAGER))
    got = fit(TCP, pts)
    for curve in (got.single, got.stream):
        costs = [c for _, c in curve]
        assert costs == sorted(costs) and min(costs) > 0
    single = dict(got.single)
    assert single[4 * KIB] == pytest.approx(stepped(1, 4 * KIB), rel=0.2)
    assert single[EAGER] <= single[EAGER + 1] < 2 * stepped(1, EAGER + 1)
    mixed = ScatterList(np.arange(3, dtype=np.int64) * MIB, np.arange(3, dtype=np.int64) * MIB,
                        np.array([4 * KIB, EAGER, MIB], np.int64))
    assert predict(got, mixed).seconds >= got.seconds(1, MIB)
    with pytest.raises(InvalidArgument, match="one piece and of many"):
        fit(TCP, [p for p in pts if p.pieces > 1])
    with pytest.raises(InvalidArgument, match="taken > 0 s"):
        fit(TCP, [*pts, Point(1, 4096, 0.0)])


def test_predictions_name_pieces_rails_and_bound() -> None:
    one = predict(TRUE, ScatterList.contiguous(4 * KIB))
    assert (one.pieces, one.bound) == (1, "latency")
    big = predict(TRUE, ScatterList.contiguous(256 * MIB))
    assert big.bound == "bandwidth" and big.gbps == pytest.approx(3.0, rel=0.01)
    off = np.arange(4096, dtype=np.int64) * 4 * KIB
    small = predict(TRUE, ScatterList(off, off[::-1].copy(), np.full(4096, 4 * KIB, np.int64)))
    assert small.pieces == 4096 and small.bound == "pieces"
    assert small.seconds == pytest.approx(20e-6 + 4096 * 2e-6 + 4096 * 4 * KIB / 3e9)
    for p in (one, big, small):
        assert sum(p.terms.values()) == pytest.approx(p.seconds)
    two = predict(TRUE, ScatterList.contiguous(256 * MIB), rails=2)
    assert two.rails == 2 and two.pieces >= 2
    assert two.seconds < big.seconds * 0.6
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


def test_fit_measures_further_transfers_and_shared_memory() -> None:
    """What a KV push's further layers cost and how much slower shared
    memory moves, each recovered from one measurement of its own on top of
    the curves; a push is predicted with both, and named bound by its
    transfers where those dominate."""
    per_transfer, scale = 50e-6, 1.4
    n, size = 2048, EAGER
    lone = stepped(1, size)
    extra = [Point(n, n * size, stepped(n, size) + 31 * per_transfer, transfers=32),
             Point(n, n * size, lone + scale * (stepped(n, size) - lone), memory="shared")]
    got = fit(TCP, shapes() + extra)
    assert got.per_transfer_s == pytest.approx(per_transfer, rel=1e-6)
    assert got.shared_scale == pytest.approx(scale, rel=1e-6)
    assert all(p["model_s"] == pytest.approx(p["seconds"], rel=1e-6) for p in got.points)
    plain = fit(TCP, shapes())  # the curves are the same with or without them
    assert (plain.single, plain.stream) == (got.single, got.stream)
    assert (plain.per_transfer_s, plain.shared_scale) == (0.0, 1.0)

    lay = KVLayout(32, 1024, size)
    rng = np.random.default_rng(2)
    sb, db = rng.permutation(1024)[:64], rng.permutation(1024)[:64]
    push = predict_kv(got, lay, sb, db)
    assert push.terms["transfers"] == pytest.approx(31 * per_transfer)
    assert push.seconds == pytest.approx(plain.transfer_seconds(
        np.full(push.pieces, size)) + 31 * per_transfer)
    assert sum(push.terms.values()) == pytest.approx(push.seconds)
    shared = predict_kv(got, lay, sb, db, shared=True)
    assert shared.seconds - shared.terms["transfers"] == pytest.approx(
        lone + scale * (push.seconds - push.terms["transfers"] - lone))
    assert shared.terms["latency"] == push.terms["latency"]
    one_block = predict_kv(got, lay, sb[:1], db[:1])  # 32 layers of one piece each
    assert one_block.bound == "transfers"
    # a shared measurement faster than a lone piece is noise: it is left out
    quick = Point(n, n * size, lone / 2, memory="shared")
    assert fit(TCP, shapes() + extra + [quick]).shared_scale == pytest.approx(scale, rel=1e-6)
    assert fit(TCP, [*shapes(), quick]).shared_scale == 1.0
    for bad in (Point(4, 4 * size, 1e-3, transfers=5), Point(4, 4 * size, 1e-3, memory="gpu")):
        with pytest.raises(InvalidArgument, match="transfers, between private or shared"):
            fit(TCP, [*shapes(), bad])


def test_profiles_round_trip_and_say_what_is_missing(tmp_path: Path) -> None:
    fitted = fit(TCP, shapes())
    path = save_profile(fitted, profile_path(TCP, tmp_path))
    assert path.parent == tmp_path and "tcp_ofi_rxm" in path.name
    again = load_profile(TCP, path)
    assert (again.single, again.stream) == (fitted.single, fitted.stream)
    # saved before further transfers and shared memory were measured: neither counts
    old = {k: v for k, v in fitted.to_json().items()
           if k not in ("per_transfer_s", "shared_scale")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = load_profile(TCP, tmp_path / "old.json")
    assert (older.per_transfer_s, older.shared_scale) == (0.0, 1.0)
    with pytest.raises(ProfileMissing, match="p2pxfer bench --calibrate"):
        load_profile("shm", profile_path("shm", tmp_path))
    with pytest.raises(InvalidArgument, match="not 'shm'"):
        load_profile("shm", path)
    for bad, why in (({"version": 1, "provider": TCP, "latency_s": 1e-5}, "calibrate again"),
                     ({"version": 2, "provider": TCP}, "not a calibration profile"),
                     ({**fitted.to_json(), "stream": [[4096, 1e-6], [4096, 2e-6]]},
                      "increasing"),
                     ({**fitted.to_json(), "single": [[4096, -1.0]]}, "<= 0"),
                     ({**fitted.to_json(), "shared_scale": 0}, "shared_scale"),
                     ({**fitted.to_json(), "per_transfer_s": float("inf")}, "finite")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(InvalidArgument, match=why):
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
    assert len(profile.points) == 7 and len(profile.single) == 3 and len(profile.stream) == 2
    assert profile.per_transfer_s >= 0 and profile.shared_scale > 0
    assert [(p["transfers"], p["memory"]) for p in profile.points[-2:]] == [
        (8, "private"), (1, "shared")]
    out = runner.invoke(main, ["plan", "--pages", "512", "--page-size", "16KiB", "--json"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["pieces"] == 512 and got["seconds"] > 0 and got["bound"] in (
        "latency", "pieces", "bandwidth")
    kv = runner.invoke(main, ["plan", "--kv", "4,128,16KiB,2", "--blocks", "16"])
    assert kv.exit_code == 0, kv.output
    assert "KV push of 16 random blocks x 4 layers" in " ".join(kv.output.split())
    through = runner.invoke(main, ["plan", "--kv", "4,128,16KiB,2", "--blocks", "16",
                                   "--shared", "--json"])
    assert through.exit_code == 0, through.output
    got = json.loads(through.output)
    assert got["shared"] is True and got["transfers"] == 4
    assert got["terms"]["transfers"] == pytest.approx(3 * profile.per_transfer_s)
    assert runner.invoke(main, ["plan", "--blocks", "3", "--size", "1MiB"]).exit_code == 2
    report = tmp_path / "bench.json"
    run = runner.invoke(main, ["bench", "--loopback", "--size", "256KiB", "--iterations", "5",
                               "--memcpy-size", "1MiB", "--quiet", "--json", str(report)])
    assert run.exit_code == 0, run.output
    rec = json.loads(report.read_text())[0]
    assert rec["predicted_us"] == pytest.approx(profile.seconds(1, 256 * KIB) * 1e6)
    assert "plan us" in run.output
    # the in-process KV push bench reports its push's prediction too
    push, _ = run_scenario("kv", provider=TCP, layers=2, blocks=16, block_sizes=(4096,),
                           repeat=2, describe_blocks=50)
    assert push["predicted_seconds"] > 0
