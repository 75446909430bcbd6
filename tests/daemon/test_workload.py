"""The path users take, the way they take it: seeded random KV pushes and
plain writes through two daemons, on a quiet machine and beside two CPU hogs.

Each case draws a KV layout (layers, K/V planes, block sizes at the
providers' protocol boundaries: shm's 4 KiB inject size, ofi_rxm's 16 KiB
eager buffer, 64 KiB), scattered block tables of random length, and plain
writes of many small scattered pieces (with and without ``notify``). Every
push and write must complete within its deadline, and every byte that
landed is checked. Pushes of scattered blocks with more pieces in flight
than a peer's bound (``peer_pieces``) stalled until their deadline on a
busy machine: this is the test that would have caught it.

Seeds come from ``P2PXFER_WORKLOAD_SEED`` (default: fixed) so a failure can
be replayed; the seed is in every assertion's message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
from test_kv_daemon import pool_view

import p2pxfer
from daemon_helpers import daemon_pair
from p2pxfer.kv import KVLayout
from p2pxfer.scatter import ScatterList
from p2pxfer.testing import scatter_at_random

U8 = npt.NDArray[np.uint8]
SEED = int(os.environ.get("P2PXFER_WORKLOAD_SEED", "22"))
DEADLINE_S = 30.0  # each push's and write's; the daemons' write_timeout_s too
CASES = 8  # layouts per provider and load
PUSHES = 3  # pushes per layout
BLOCKS = 80  # blocks per pool (and plane, and layer)
# Around shm's inject size, ofi_rxm's eager buffer, and a large page.
BLOCK_BYTES = (4032, 4096, 4160, 16320, 16384, 16448, 65536)
REGION = 4 << 20  # the plain writes' destination


@pytest.fixture(params=["tcp;ofi_rxm", "shm"], scope="module")
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["quiet", "two-hogs"])
def load(request: pytest.FixtureRequest) -> Iterator[str]:
    """Nothing, or two busy loops for the test's whole length (as a busy
    serving host: two cores here, both taken)."""
    hogs = []
    if request.param == "two-hogs":
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2)]
    try:
        yield str(request.param)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


@pytest.fixture(scope="module")
def daemons(provider: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    workdir = tmp_path_factory.mktemp("workload")
    with daemon_pair(workdir, provider=provider, write_timeout_s=DEADLINE_S) as (a, b):
        yield a.socket, b.socket


def draw_layout(rng: np.random.Generator) -> KVLayout:
    bb = int(rng.choice(BLOCK_BYTES))
    layers = int(rng.choice([4, 16, 32] if bb < 65536 else [1, 8, 16]))
    planes = int(rng.integers(1, 3))
    order = str(rng.choice(["layer_major", "block_major", "plane_major"]))
    return KVLayout(layers, BLOCKS, bb, planes, order)


def test_random_pushes_and_writes_complete_and_verify(daemons: tuple[str, str], load: str,
                                                      provider: str) -> None:
    sock_a, sock_b = daemons
    seed = [SEED, ["tcp;ofi_rxm", "shm"].index(provider), ["quiet", "two-hogs"].index(load)]
    rng = np.random.default_rng(seed)
    request = 1
    for case in range(CASES):
        lay = draw_layout(rng)
        what = f"seed {seed}, case {case}, {lay}"
        # Fresh clients per case: their pools and memory go with them.
        with p2pxfer.SyncClient(sock_a) as a, p2pxfer.SyncClient(sock_b) as b:
            dst = b.kv_pool(f"kv-{case}", lay)
            src = a.kv_pool(f"src-{case}", lay, receive=False)
            src.array[:] = rng.integers(0, 256, src.array.size, dtype=np.uint8)
            region = b.alloc(REGION)
            b.export(f"plain-{case}", region)
            source = a.alloc(REGION)
            source.array[:] = rng.integers(0, 256, REGION, dtype=np.uint8)
            for k in range(PUSHES):
                # First the flagship shape (64 pieces a layer, every layer in
                # flight at once: more than a peer's bound when layers > 8),
                # then random lengths up to every block.
                n = (64 // lay.planes if k == 0
                     else int(rng.choice([1, 7, int(rng.integers(8, BLOCKS + 1))])))
                sb = rng.choice(BLOCKS, n, replace=False).astype(np.int64)
                db = rng.choice(BLOCKS, n, replace=False).astype(np.int64)
                t0 = time.monotonic()
                a.kv_push("node-b", f"kv-{case}", src, sb, db, request=request,
                          deadline=DEADLINE_S)
                b.wait_layers(dst, request, lay.num_layers - 1, timeout=DEADLINE_S)
                took = time.monotonic() - t0
                got = pool_view(dst.array, lay)[:, :, db]
                want = pool_view(src.array, lay)[:, :, sb]
                assert np.array_equal(got, want), f"{what}: push {request} ({n} blocks) " \
                    "landed wrong bytes"
                assert took < DEADLINE_S, f"{what}: push {request} took {took:.1f} s"
                request += 1
            for w in range(2):
                pieces = int(rng.integers(1, 600))
                sl = ScatterList(*scatter_at_random(
                    rng, rng.integers(1, 4097, pieces, dtype=np.int64), REGION))
                notify = bool(rng.integers(0, 2))
                imm = 100 + case * 2 + w
                region.array[:] = 0
                n = a.write("node-b", f"plain-{case}", sl, src=source, imm=imm,
                            notify=notify, timeout=DEADLINE_S)
                b.wait_imm(imm, n, timeout=DEADLINE_S)
                expect = np.zeros(REGION, np.uint8)
                for s, d, ln in zip(sl.src.tolist(), sl.dst.tolist(), sl.length.tolist(),
                                    strict=True):
                    expect[d:d + ln] = source.array[s:s + ln]
                assert np.array_equal(region.array, expect), \
                    f"{what}: write {w} ({pieces} pieces, notify={notify}) landed wrong bytes"
