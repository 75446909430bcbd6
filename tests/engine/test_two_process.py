"""Two processes, one real provider: B scatters writes into A's exported region.

Each side runs an engine (``BlockingEngine``). A (the target) exports a
256 MiB zeroed region and sends its descriptor to B out of band (a pipe, as
``RegionDescriptor.to_bytes()``). B (the initiator) writes two random scatter
lists carrying immediates. Both sides derive the lists and the source bytes
from the same seed, so A can rebuild the whole expected 256 MiB image and
compare every byte: the pieces, and the zeros between them (nothing outside a
piece was touched).

Phase 1: 10,000 pieces of 1 B..32 KiB. Phase 2 (after A verified phase 1):
1,000 pieces of 64..256 KiB, laid over the phase-1 image.

Children are spawned (never forked: libfabric state must not be inherited),
report failures as strings through a queue, and are always joined, then
terminated or killed, so the test cannot hang.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from p2pxfer.engine import BlockingEngine
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

REGION = 256 << 20
SOURCE = 64 << 20
SEED = 0x5EED_2024
OP_TIMEOUT = 40.0  # inside a child: write / wait_imm / pipe waits
TEST_TIMEOUT = 60.0  # the parent's limit for the whole exchange


@dataclass(frozen=True)
class Phase:
    name: str
    pieces: int
    min_len: int
    max_len: int
    imm: int


PHASES = (
    Phase("small", 10_000, 1, 32 << 10, 0xA11CE),
    # An immediate that needs more than 32 bits, to prove all 64 travel.
    Phase("large", 1_000, 64 << 10, 256 << 10, 0xB0B_0000_0001),
)


# -- the plan both sides derive from the seed ----------------------------------

def make_source(seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng([seed, 0]).integers(0, 256, SOURCE, dtype=np.uint8)


def make_pieces(seed: int, k: int, phase: Phase) -> ScatterList:
    """``phase.pieces`` pieces with random lengths in ``[min_len, max_len]``,
    non-overlapping random destinations in the region, random source offsets,
    listed in random order. The first piece starts at offset 0 of the region,
    the last ends at its very end, and both extreme lengths occur."""
    rng = np.random.default_rng([seed, k + 1])
    n = phase.pieces
    length = rng.integers(phase.min_len, phase.max_len + 1, n, dtype=np.int64)
    length[0], length[-1] = phase.min_len, phase.max_len
    slack = REGION - int(length.sum())
    assert slack > 0, f"phase {phase.name}: pieces do not fit the region"
    # Sorted cumulative gaps lay the pieces out in order without overlap.
    gap = np.sort(rng.integers(0, slack + 1, n, dtype=np.int64))
    gap[0], gap[-1] = 0, slack
    dst = gap + np.cumsum(length) - length
    order = rng.permutation(n)
    length, dst = length[order], dst[order]
    src = rng.integers(0, SOURCE - length + 1, dtype=np.int64)
    return ScatterList(src, dst, length)


def apply_pieces(image: npt.NDArray[np.uint8], source: npt.NDArray[np.uint8],
                 sl: ScatterList) -> None:
    for s, d, n in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(), strict=True):
        image[d:d + n] = source[s:s + n]


def describe_mismatch(got: npt.NDArray[np.uint8], want: npt.NDArray[np.uint8],
                      sl: ScatterList) -> str:
    bad = np.flatnonzero(got != want)
    order = np.argsort(sl.dst)
    starts, ends = sl.dst[order], sl.dst[order] + sl.length[order]
    lines = [f"{len(bad)} bytes differ"]
    for off in bad[:5].tolist():
        i = int(np.searchsorted(starts, off, side="right")) - 1
        where = ("outside every piece" if i < 0 or off >= ends[i]
                 else f"in piece {int(order[i])} (dst {int(starts[i])}+{int(ends[i] - starts[i])})")
        lines.append(f"  offset {off}: got {int(got[off])}, want {int(want[off])}, {where}")
    return "\n".join(lines)


# -- the two children -----------------------------------------------------------

def recv(conn: Connection, what: str) -> Any:
    """Receive one message. (The engine's poller thread progresses our CQ
    meanwhile: on manual-progress providers a peer's operations only complete
    while we call into ours.)"""
    if not conn.poll(OP_TIMEOUT):
        raise TimeoutError(f"no {what} from the peer within {OP_TIMEOUT} s")
    return conn.recv()


def target_main(provider: str, node: str | None, seed: int, conn: Connection,
                results: Any) -> None:
    try:
        with BlockingEngine.open(provider, node=node, node_name="A", incarnation=1) as t:
            region = np.zeros(REGION, np.uint8)
            desc = t.export(region, "kv")
            conn.send(desc.to_bytes())
            source = make_source(seed)
            expected = np.zeros(REGION, np.uint8)
            for k, phase in enumerate(PHASES):
                sl = make_pieces(seed, k, phase)
                t.wait_imm(phase.imm, len(sl), timeout=OP_TIMEOUT)
                reported = recv(conn, f"{phase.name} piece count")
                if reported != len(sl):
                    raise AssertionError(
                        f"{phase.name}: write returned {reported}, list has {len(sl)} pieces")
                apply_pieces(expected, source, sl)
                if not np.array_equal(region, expected):
                    raise AssertionError(f"{provider} {phase.name} (seed {seed:#x}): "
                                         + describe_mismatch(region, expected, sl))
                if t.imm_count(phase.imm):
                    raise AssertionError(f"{phase.name}: {t.imm_count(phase.imm)} extra "
                                         "pieces arrived")
                conn.send(("verified", phase.name))
            if int(np.count_nonzero(expected == 0)) < REGION // 8:
                raise AssertionError("too few untouched bytes to prove writes stay in bounds")
            # B keeps its endpoint open until we are done reading.
            recv(conn, "goodbye")
        results.put(("A", None))
    except BaseException:
        results.put(("A", traceback.format_exc()))
        raise SystemExit(1) from None


def initiator_main(provider: str, node: str | None, seed: int, conn: Connection,
                   results: Any) -> None:
    try:
        with BlockingEngine.open(provider, node=node) as t:
            source = make_source(seed)
            t.register(source)
            desc = RegionDescriptor.from_bytes(recv(conn, "descriptor"))
            if desc.length != REGION or desc.name != "kv" or desc.incarnation != 1:
                raise AssertionError(f"descriptor did not round-trip: {desc}")
            for k, phase in enumerate(PHASES):
                sl = make_pieces(seed, k, phase)
                n = t.write(source, desc, sl, imm=phase.imm, timeout=OP_TIMEOUT)
                conn.send(n)
                if n != len(sl):
                    raise AssertionError(f"{phase.name}: write returned {n}, "
                                         f"expected {len(sl)}")
                ack = recv(conn, f"{phase.name} verification")
                if ack != ("verified", phase.name):
                    raise AssertionError(f"unexpected message from A: {ack!r}")
            posted = [n.pieces for n in t.statistics().nics]
            if sum(posted) != sum(p.pieces for p in PHASES):
                raise AssertionError(f"posted {posted} pieces")
            conn.send("goodbye")
        results.put(("B", None))
    except BaseException:
        results.put(("B", traceback.format_exc()))
        raise SystemExit(1) from None


# -- the parent -----------------------------------------------------------------

def run_pair(provider: str, node: str | None, seed: int) -> None:
    ctx = mp.get_context("spawn")
    a_end, b_end = ctx.Pipe()
    results = ctx.Queue()
    procs = {
        "A": ctx.Process(target=target_main, args=(provider, node, seed, a_end, results),
                         name=f"p2pxfer-target-{provider}"),
        "B": ctx.Process(target=initiator_main, args=(provider, node, seed, b_end, results),
                         name=f"p2pxfer-initiator-{provider}"),
    }
    reports: dict[str, str | None] = {}
    deadline = time.monotonic() + TEST_TIMEOUT
    try:
        for p in procs.values():
            p.start()
        # Drop our ends so a child that dies gives its peer EOF, not a hang.
        a_end.close()
        b_end.close()
        while len(reports) < len(procs) and time.monotonic() < deadline:
            try:
                role, err = results.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode is not None and r not in reports for r, p in procs.items()):
                    # Died without a word (a crash): collect what is left, then stop.
                    try:
                        role, err = results.get(timeout=2)
                    except queue.Empty:
                        break
                else:
                    continue
            reports[role] = err
            if err is not None:
                break
    finally:
        for p in procs.values():
            p.join(timeout=max(1.0, deadline - time.monotonic()) if not any(reports.values())
                   else 5)
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.join_thread()
    errors = {r: e for r, e in reports.items() if e is not None}
    assert not errors, "\n".join(f"--- process {r} failed:\n{e}" for r, e in errors.items())
    missing = [r for r in procs if r not in reports]
    assert not missing, (f"processes {missing} did not report within {TEST_TIMEOUT} s "
                         f"(exit codes {[p.exitcode for p in procs.values()]})")
    assert {r: p.exitcode for r, p in procs.items()} == {"A": 0, "B": 0}


def test_plan_is_deterministic_and_non_overlapping() -> None:
    for k, phase in enumerate(PHASES):
        a, b = make_pieces(SEED, k, phase), make_pieces(SEED, k, phase)
        for col in ("src", "dst", "length"):
            assert np.array_equal(getattr(a, col), getattr(b, col))
        assert len(a) == phase.pieces
        assert int(a.length.min()) == phase.min_len and int(a.length.max()) == phase.max_len
        order = np.argsort(a.dst)
        starts, ends = a.dst[order], a.dst[order] + a.length[order]
        assert starts[0] == 0 and ends[-1] == REGION
        assert (starts[1:] >= ends[:-1]).all(), "destinations overlap"
        assert not (np.diff(a.dst) > 0).all(), "pieces should not be listed in dst order"
        assert int((a.src + a.length).max()) <= SOURCE and int(a.src.min()) >= 0
        a.check_bounds(SOURCE, REGION)


@pytest.mark.slow
def test_scatter_write_between_processes(provider: tuple[str, str | None]) -> None:
    run_pair(*provider, SEED)


def test_child_failures_reach_the_parent() -> None:
    # The harness itself: a child that fails must fail the test, with its traceback.
    with pytest.raises(AssertionError) as exc:
        run_pair("no-such-provider", None, SEED)
    assert "ProviderNotFound" in str(exc.value)
    assert "process A failed" in str(exc.value) or "process B failed" in str(exc.value)
