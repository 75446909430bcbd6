"""The Mooncake row of ``p2pxfer bench``: Mooncake Transfer Engine (TCP
transport, P2PHANDSHAKE) on the same pages in the same run, or a note saying
why it was left out. Tiny sizes: behaviour, not speed."""

from __future__ import annotations

import sys

import pytest

from p2pxfer.bench import BenchConfigError, BenchOptions, run_bench
from p2pxfer.bench._mooncake import mooncake_missing

TCP = "tcp;ofi_rxm"
FAST = {"warmup": 1, "iterations": 3, "memcpy_size": 8 << 20}


def test_mooncake_row_beside_ours_and_the_reference() -> None:
    pytest.importorskip("mooncake.engine", reason="optional: pip install "
                        "mooncake-transfer-engine-non-cuda")
    opts = BenchOptions(providers=(TCP,), pattern="paged", page_size=16 << 10, pages=64,
                        mooncake=True, **FAST)
    report = run_bench(opts)
    (rec,) = report.results
    assert rec.mooncake_gbps is not None and rec.mooncake_gbps > 0
    assert rec.mooncake_p50_us is not None and rec.mooncake_p50_us > 0
    assert rec.mooncake_cpu_s_per_gb is not None and rec.mooncake_cpu_s_per_gb > 0
    assert rec.gbps > 0 and rec.baseline_gbps is not None and rec.reference == "c-to-c"
    assert report.notes == []


def test_mooncake_row_is_left_out_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    report = run_bench(BenchOptions(providers=("shm",), sizes=(4096,), mooncake=True, **FAST))
    (rec,) = report.results
    assert rec.mooncake_gbps is None and rec.gbps > 0
    assert report.notes == ["no Mooncake row for shm: Mooncake's TCP transport is compared "
                            "with tcp providers only"]
    for name in ("mooncake", "mooncake.engine"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    assert mooncake_missing(TCP) == ("Mooncake Transfer Engine is not installed (pip install "
                                     "mooncake-transfer-engine-non-cuda)")


def test_mooncake_needs_loopback() -> None:
    with pytest.raises(BenchConfigError, match="loopback mode only"):
        BenchOptions(mode="client", mooncake=True).check()
