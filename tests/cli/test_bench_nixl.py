"""The NIXL row of ``p2pxfer bench``: NIXL's UCX backend (loopback tcp, or
shared memory beside shm) on the same pages in the same run, the bytes
checked on its target, or a note saying why it was left out. Tiny sizes:
behaviour, not speed. ``.ci/run`` installs NIXL (no GPU needed)."""

from __future__ import annotations

import sys

import pytest

from p2pxfer.bench import BenchConfigError, BenchOptions, run_bench
from p2pxfer.bench._nixl import INSTALL, nixl_missing

FAST = {"warmup": 1, "iterations": 3, "memcpy_size": 8 << 20}


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm"])
def test_nixl_row_beside_ours_and_the_reference(provider: str) -> None:
    pytest.importorskip("nixl._api", reason=f"optional: {INSTALL}")
    opts = BenchOptions(providers=(provider,), pattern="paged", page_size=16 << 10, pages=64,
                        nixl=True, **FAST)
    report = run_bench(opts)
    (rec,) = report.results
    assert rec.nixl_gbps is not None and rec.nixl_gbps > 0
    assert rec.nixl_p50_us is not None and rec.nixl_p50_us > 0
    assert rec.nixl_cpu_s_per_gb is not None and rec.nixl_cpu_s_per_gb > 0
    assert rec.gbps > 0 and rec.baseline_gbps is not None and rec.reference == "c-to-c"
    assert report.notes == []


def test_nixl_row_is_left_out_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    assert nixl_missing("tcp;ofi_rxm") == f"NIXL is not installed ({INSTALL})"
    report = run_bench(BenchOptions(providers=("shm",), sizes=(4096,), nixl=True, **FAST))
    (rec,) = report.results
    assert rec.nixl_gbps is None and rec.gbps > 0
    assert report.notes == [f"no NIXL row for shm: NIXL is not installed ({INSTALL})"]
    assert nixl_missing("verbs;ofi_rxm") is not None


def test_nixl_needs_loopback() -> None:
    with pytest.raises(BenchConfigError, match="loopback mode only"):
        BenchOptions(mode="client", nixl=True).check()
