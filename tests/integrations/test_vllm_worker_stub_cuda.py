"""The connector's GPU path on machines without a GPU: the worker side
(``_worker.Worker``) with its KV tensors taken as CUDA tensors, against a
stub CUDA driver (``stub_cuda.c``, built here) whose "device memory" is
host memory and whose asynchronous copies run only when something waits
for them. Two real daemons move the bytes. What this checks is the order of
things, which a fast GPU hides: a prefill that pushed its staging pool
before its device -> pool copies ran would push zeros; a decode that
reported a load before its pool -> device copies ran would hand vLLM
zeros; either fails the byte check. It also checks that every pinned pool
is unpinned at close. ``tests/gpu`` runs the real thing on a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from p2pxfer import cuda
from p2pxfer.integrations import _tensors
from p2pxfer.integrations.vllm import _device, _worker
from p2pxfer.integrations.vllm._plan import Load, Open, Save, Send
from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions
from vllm_worker_helpers import (
    one_to_two,
    prefill_step,
    pulled_by_each,
    wait_finished,
    worker_options,
)

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD = 4, 64, 16, 4, 32


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (the stub CUDA driver is built with it)")
    out = tmp_path_factory.mktemp("stubcuda") / "libstubcuda.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out),
                    str(Path(__file__).with_name("stub_cuda.c")), "-lpthread"],
                   check=True, capture_output=True, timeout=60)
    return str(out)


@pytest.fixture(params=["batch", "per_run"])
def stub(request: pytest.FixtureRequest, stub_lib: str,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[ctypes.CDLL]:
    """The stub installed as this process's CUDA driver, numpy KV arrays
    taken for CUDA tensors on device 0, vLLM's current stream the legacy
    stream 0; all of it undone after the test. ``per_run``: copies one
    ``cuMemcpyAsync`` per run of pieces (no CUDA 13 batch)."""
    drv = cuda.CudaDriver(stub_lib)
    if request.param == "per_run":
        drv.memcpy_batch = None
    monkeypatch.setattr(cuda, "_driver", [drv])
    real = _tensors.layer_tensor

    def on_device(t: Any, arrangement: str | None = None) -> _tensors.LayerTensor:
        return dataclasses.replace(real(t, arrangement), memory=None, device=0)

    monkeypatch.setattr(_worker, "layer_tensor", on_device)
    monkeypatch.setattr(_device, "current_stream", lambda device: 0)
    lib = ctypes.CDLL(stub_lib)
    lib.stub_copies_queued.restype = lib.stub_copies_run.restype = ctypes.c_long
    yield lib


def options(socket: str, engine: str, **kw: Any) -> WorkerOptions:
    return worker_options(socket, engine, block_size=BLOCK_SIZE, max_blocks=BLOCKS, **kw)


def caches(seed: int | None, heads: int = HEADS) -> dict[str, Any]:
    shape = (2, BLOCKS, BLOCK_SIZE, heads, HEAD)
    rng = np.random.default_rng(seed)
    return {f"l{i}": (rng.integers(1, 1 << 16, shape, dtype=np.uint16) if seed is not None
                      else np.zeros(shape, np.uint16)) for i in range(LAYERS)}


def test_stub_gpu_caches_every_byte_after_the_copies_ran(stub: ctypes.CDLL,
                                                        daemon_sockets: tuple[str, str]) -> None:
    a, b = daemon_sockets
    src, dst = caches(3), caches(None)
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True, checksum=True))
    try:
        prefill.register(src)
        decode.register(dst)
        assert prefill.gpu is not None and decode.gpu is not None
        assert stub.stub_pinned() == 2  # both staging pools
        for step, (sb, db) in enumerate((([5, 6, 7, 30, 2], [11, 40, 41, 42, 3]),
                                         ([1, 63], [0, 62]))):
            saves = [Save(f"r{step}", tuple(sb))]
            queued = stub.stub_copies_queued()
            for name in src:
                prefill.stage_layer(name, saves)
            prefill.end_step(saves)
            # Queued, not run: the forward is not stopped for them.
            assert stub.stub_copies_queued() > queued
            if step == 0:  # nothing has waited for them yet: the pool is as it was
                assert prefill.pool is not None and not prefill.pool.array.any()
            prefill.hold([Send(f"r{step}", 3 + step, tuple(sb))])
            decode.load([Load(f"d{step}", prefill.node, "P", 3 + step, f"r{step}", 0,
                              tuple(db))])
            wait_finished(decode, received={f"d{step}"})
            wait_finished(prefill, sent={f"r{step}"})
            assert decode.load_errors() == set()
            for name, s in src.items():
                assert (dst[name][:, db] == s[:, sb]).all(), (step, name)
        assert stub.stub_copies_run() == stub.stub_copies_queued()
    finally:
        decode.close()
        prefill.close()
    assert stub.stub_pinned() == 0  # unpinned at close, before the pools were unmapped


def test_stub_gpu_pushed_as_computed_after_each_layers_copies(
        stub: ctypes.CDLL, daemon_sockets: tuple[str, str]) -> None:
    """Pushed as computed: each layer goes once the event behind its own
    copies is over (the stub runs the copies only then), not before."""
    a, b = daemon_sockets
    src, dst = caches(4), caches(None)
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True, checksum=True))
    try:
        prefill.register(src)
        decode.register(dst)
        sb, db = [5, 6, 7, 30, 2], [11, 40, 41, 42, 3]
        decode.load([Load("d", prefill.node, "P", 0, "t", 0, tuple(db), "t")])
        prefill.open([Open("r", 2, "t")])
        saves = [Save("r", tuple(sb), last=True, table=tuple(sb))]
        for name in src:
            prefill.stage_layer(name, saves)
        prefill.end_step(saves)
        wait_finished(decode, received={"d"})
        assert decode.load_errors() == set()
        prefill.hold([Send("r", 2, tuple(sb), "t")])
        wait_finished(prefill, sent={"r"})
        for name, s in src.items():
            assert (dst[name][:, db] == s[:, sb]).all(), name
        assert stub.stub_copies_run() == stub.stub_copies_queued()
    finally:
        decode.close()
        prefill.close()
    assert stub.stub_pinned() == 0


def test_stub_gpu_caches_by_head_slices_tp_2_to_1(stub: ctypes.CDLL,
                                                  daemon_sockets: tuple[str, str]) -> None:
    """TP 2 -> 1 in NHD: the decode's block is two prefill ranks' head
    slices, each copied to the device as one piece per token."""
    a, b = daemon_sockets
    src = [caches(10 + r, HEADS // 2) for r in range(2)]
    dst = caches(None)
    prefill = [Worker(options(a, "P", rank=r, send=True, receive=False, tp_size=2,
                              peer_tp_size=1)) for r in range(2)]
    decode = Worker(options(b, "D", send=False, receive=True, tp_size=1, peer_tp_size=2))
    try:
        for w, mine in zip(prefill, src, strict=True):
            w.register(mine)
        decode.register(dst)
        sb, db = [3, 4, 5, 40], [7, 1, 2, 9]
        for w, mine in zip(prefill, src, strict=True):
            for name in mine:
                w.stage_layer(name, [Save("r", tuple(sb))])
            w.end_step([Save("r", tuple(sb))])
            w.hold([Send("r", 2, tuple(sb))])
        decode.load([Load("d0", prefill[0].node, "P", 2, "r", 0, tuple(db))])
        wait_finished(decode, received={"d0"})
        assert decode.load_errors() == set()
        for w in prefill:
            wait_finished(w, sent={"r"})
        half = HEADS // 2
        for r in range(2):
            for name, s in src[r].items():
                assert (dst[name][:, db, :, r * half:(r + 1) * half] == s[:, sb]).all(), (r, name)
    finally:
        decode.close()
        for w in prefill:
            w.close()
    assert stub.stub_pinned() == 0


def test_stub_gpu_close_waits_for_a_step_never_ended(stub: ctypes.CDLL,
                                                    daemon_sockets: tuple[str, str]) -> None:
    """Layers staged, then the worker closed before wait_for_save: the
    queued copies still run (into the still-mapped pool) before it is
    unpinned."""
    prefill = Worker(options(daemon_sockets[0], "P", send=True, receive=False))
    try:
        prefill.register(caches(5))
        for name in prefill.index:
            prefill.stage_layer(name, [Save("r", (1, 2, 3))])
        assert stub.stub_copies_run() < stub.stub_copies_queued()
    finally:
        prefill.close()
    assert stub.stub_copies_run() == stub.stub_copies_queued()
    assert stub.stub_pinned() == 0


def test_stub_gpu_pulled_by_two_decode_ranks(stub: ctypes.CDLL,
                                             daemon_sockets: tuple[str, str]) -> None:
    """TP 1 -> 2: one staged request, two pulls, each rank's slices."""
    src = caches(21)
    dst = [caches(None, HEADS // 2) for _ in range(2)]
    with one_to_two(*daemon_sockets, options, src, dst) as (prefill, decode):
        sb, db = [8, 9, 10], [0, 5, 60]
        prefill_step(prefill, src, "r", sb)
        pulled_by_each(prefill, decode, 2, sb, db)
        half = HEADS // 2
        for r in range(2):
            for name, s in src.items():
                assert (dst[r][name][:, db] == s[:, sb, :, r * half:(r + 1) * half]).all()
    assert stub.stub_pinned() == 0
