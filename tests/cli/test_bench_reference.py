"""The C-to-C reference (``native/src/baseline.c`` through
``p2pxfer.bench._reference``): a C target in a second process that busy-polls
its CQ, and a C initiator here. Tiny sizes over real providers on loopback."""

from __future__ import annotations

import time

import numpy as np
import pytest

from p2pxfer.bench import BenchError
from p2pxfer.bench._reference import (
    ReferenceInitiator,
    ReferenceTarget,
    close_rails,
    open_rails,
    process_cpu_seconds,
)
from p2pxfer.errors import FabricError
from p2pxfer.scatter import ScatterList

TCP = "tcp;ofi_rxm"
MIB = 1 << 20


def _where(provider: str) -> tuple[str | None, tuple[str, ...]]:
    return ("127.0.0.1", ("lo",)) if provider == TCP else (None, ("shm",))


@pytest.mark.parametrize("provider", [TCP, "shm"])
def test_writes_land_on_the_c_target_and_are_counted(provider: str) -> None:
    node, names = _where(provider)
    with ReferenceTarget(provider, node, names, 4 * MIB) as target:
        rails = open_rails(provider, node, names)
        try:
            ini = ReferenceInitiator(rails, np.ones(4 * MIB, np.uint8), target.descriptor)
            rng = np.random.default_rng(3)
            pages = rng.permutation(64).astype(np.int64) * 65536
            sl = ScatterList(pages, pages[::-1].copy(), np.full(64, 65536, np.int64))
            plan = ini.plan(sl)
            assert sum(len(s.length) for s in plan) == 64
            # As the engine writes: up to 4 pieces per write on tcp;ofi_rxm,
            # one on shm, each write with the immediate the target counts.
            writes = ini.writes(0, 64)
            assert writes == (64 if provider == "shm" else 16)
            for _ in range(2):
                target.expect([writes], 10.0)
                assert ini.round(plan, 5, 10.0) == writes
                assert target.collect(10.0) > 0  # CPU seconds of a busy-polling target
            # Expecting more than arrives: the target gives up at its deadline
            # and the harness says how many landed.
            target.expect([writes + 1], 0.5)
            ini.round(plan, 5, 10.0)
            with pytest.raises(BenchError,
                               match=rf"saw \[{writes}\] writes land, expected \[{writes + 1}\]"):
                target.collect(5.0)
            # Ping-pong: both ends in C, one round trip per sample.
            target.pong(4096, 20, ini.descriptor(), 10.0)
            rtt = ini.pingpong(4096, 20, 10.0)
            target.pong_done(10.0)
            assert len(rtt) == 20 and (rtt > 0).all()
            ini.close()
        finally:
            close_rails(rails)


def test_initiator_times_out_without_a_target() -> None:
    """A C initiator whose writes never complete (nobody progresses the
    target) returns -FI_ETIMEDOUT instead of spinning forever."""
    node, names = _where(TCP)
    target = ReferenceTarget(TCP, node, names, MIB)
    rails = open_rails(TCP, node, names)
    try:
        ini = ReferenceInitiator(rails, np.ones(MIB, np.uint8), target.descriptor)
        big = ScatterList.contiguous(MIB)
        # Connection setup needs the target's progress: with the target idle
        # (no expect), the write cannot complete.
        t0 = time.monotonic()
        with pytest.raises(FabricError):
            ini.round(ini.plan(big), 1, 0.5)
        assert time.monotonic() - t0 < 5
    finally:
        target.close()
        close_rails(rails)


def test_cpu_seconds_of_this_and_another_process() -> None:
    import os
    import subprocess
    import sys

    assert process_cpu_seconds() == pytest.approx(time.process_time(), abs=0.05)
    # The child burns 0.5 s of its own CPU time (however long a busy host
    # takes to give it that), says so, then waits.
    proc = subprocess.Popen([sys.executable, "-c", "import time\n"
                             "while time.process_time() < 0.5: pass\nprint('spent', flush=True)\n"
                             "input()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "spent"
        assert process_cpu_seconds(proc.pid) >= 0.45
        assert process_cpu_seconds(os.getpid()) >= 0
    finally:
        proc.kill()
        proc.wait()
