"""An engine's KV cache allocated in daemon-shared memory (``_placement``)
and the worker laying its pool over it (``placed_layout``), with a real
daemon and torch tensors; vLLM's own allocator is driven in
``test_vllm_connector.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch comes with vLLM's extra (.[vllm])")

import torch

import p2pxfer
from daemon_helpers import DaemonProc, start_daemon
from p2pxfer.errors import InvalidArgument, LimitExceeded
from p2pxfer.integrations._placement import Placement
from p2pxfer.integrations._tensors import layer_tensor, placed_layout
from p2pxfer.integrations.vllm._plan import Load, Save, Send
from p2pxfer.integrations.vllm._worker import Worker
from vllm_worker_helpers import wait_finished, worker_options

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD = 3, 64, 16, 2, 32
BLOCK = BLOCK_SIZE * HEADS * HEAD * 2 * 2  # [heads, tokens, K|V] of float16


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "node-a")
    try:
        yield d
    finally:
        d.stop()


def inside(t: Any, mem: Any) -> bool:
    lo = mem.array.ctypes.data
    return bool(lo <= t.data_ptr() < lo + mem.nbytes)


def test_large_host_allocations_land_in_shared_memory(daemon: DaemonProc) -> None:
    with p2pxfer.SyncClient(daemon.socket) as c:
        with Placement(lambda n: c.alloc(n, "placed"), min_bytes=1 << 16) as p:
            big = torch.zeros(1 << 20, dtype=torch.int8)
            big2 = torch.empty((64, 1024), dtype=torch.float16, device="cpu")
            small = torch.zeros(1024, dtype=torch.int8)
            meta = torch.zeros(1 << 20, dtype=torch.int8, device="meta")
            grad = torch.zeros(1 << 20, requires_grad=True)
        after = torch.zeros(1 << 20, dtype=torch.int8)
        assert [m.nbytes >= t.nbytes for m, t in p.placed] == [True, True]
        (m1, t1), (m2, t2) = p.placed
        assert t1 is big and t2 is big2 and big2.shape == (64, 1024)
        assert inside(big, m1) and inside(big2, m2)
        assert not big.any()  # zeros, as asked
        view = big.view(torch.float16).as_strided((4, 8), (8, 1), 16)
        view.fill_(1.5)  # the engine's later views write the shared memory
        assert m1.array[32:40].view(np.float16)[0] == 1.5
        for t in (small, grad, after):
            assert not any(inside(t, m) for m, _ in p.placed)
        assert meta.device.type == "meta"


def test_placed_layout_over_layers_in_one_allocation(daemon: DaemonProc) -> None:
    with p2pxfer.SyncClient(daemon.socket) as c:
        mem = c.alloc(LAYERS * BLOCKS * BLOCK, "layers")
        buf = torch.from_numpy(mem.array).view(torch.float16)
        per = BLOCKS * BLOCK // 2
        layers = [layer_tensor(buf[i * per:(i + 1) * per].view(BLOCKS, HEADS, BLOCK_SIZE,
                                                                 HEAD * 2), "single")
                  for i in range(LAYERS)]
        layout, where = placed_layout(layers, [c.alloc(4096, "other"), mem])  # type: ignore[misc]
        assert where is mem
        assert (layout.num_layers, layout.num_blocks, layout.block_bytes) == \
            (LAYERS, BLOCKS, BLOCK)
        assert layout.layer_stride == BLOCKS * BLOCK and layout.block_stride == BLOCK
        # Layers out of order, or not from the memory's first byte: no pool layout.
        assert "one stride apart" in placed_layout(layers[::-1], [mem])
        assert "one stride apart" in placed_layout(layers[1:], [mem])
        elsewhere = [layer_tensor(torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, HEAD * 2,
                                              dtype=torch.float16), "single")]
        assert "not all in one allocation" in placed_layout(elsewhere, [mem])


def test_workers_on_placed_tensors_move_every_byte_with_no_copy(
        daemon_sockets: tuple[str, str]) -> None:
    """Two workers whose tensors were allocated in their allocation
    contexts (as vLLM does through ``get_mem_pool_context``): each pool is
    laid over the tensors (``memory`` ``placed``), staging copies nothing,
    and the decode's tensors hold the prefill's blocks."""
    a, b = daemon_sockets
    # vLLM's views, [blocks, heads, tokens, K|V], with the spec's heads
    prefill = Worker(worker_options(a, "P", send=True, receive=False, block_size=BLOCK_SIZE,
                                    max_blocks=BLOCKS, view_heads=HEADS))
    decode = Worker(worker_options(b, "D", send=False, receive=True, block_size=BLOCK_SIZE,
                                   max_blocks=BLOCKS, view_heads=HEADS))
    try:
        kv = []
        for w in (prefill, decode):
            ctx = w.allocation_context({LAYERS * BLOCKS * BLOCK})
            assert ctx is not None
            with ctx:
                buf = torch.zeros(LAYERS * BLOCKS * BLOCK, dtype=torch.int8)
                other = torch.zeros(1 << 20, dtype=torch.int8)  # not the KV cache's size
            assert len(ctx.placed) == 1 and not any(inside(other, m) for m, _ in ctx.placed)
            per = BLOCKS * BLOCK
            tensors = {f"l{i}": buf[i * per:(i + 1) * per].view(torch.float16)
                       .view(BLOCKS, HEADS, BLOCK_SIZE, HEAD * 2) for i in range(LAYERS)}
            w.register(tensors)
            assert w.memory == "placed"
            assert w.layers[0].arrangement == "single"  # two heads are not K and V planes
            assert w.layout is not None and w.layout.block_bytes == BLOCK
            assert w.pool is not None and w.pool.mem is ctx.placed[0][0]
            kv.append(tensors)
        src, dst = kv
        rng = np.random.default_rng(3)
        sb, db = [5, 6, 7, 30, 2], [11, 40, 41, 3, 0]
        for name, t in src.items():
            t.view(torch.int16)[sb] = torch.from_numpy(
                rng.integers(-(1 << 15), 1 << 15, t[sb].shape, dtype=np.int16))
            assert prefill.stage_layer(name, [Save("r", tuple(sb))]) == 0
        prefill.end_step([Save("r", tuple(sb))])
        prefill.hold([Send("r", 3, tuple(sb))])
        decode.load([Load("d", prefill.node, "P", 3, "r", 0, tuple(db))])
        wait_finished(decode, received={"d"})
        assert decode.load_errors() == set()
        for name in src:
            assert torch.equal(src[name][sb].view(torch.int16), dst[name][db].view(torch.int16))
    finally:
        decode.close()
        prefill.close()


def test_memory_the_daemon_refuses_is_left_to_torch_unless_required(
        daemon: DaemonProc) -> None:
    """A daemon's limit (or a lost connection) on the KV cache's memory:
    ``auto`` leaves the allocation to torch (and then stages); ``shared``
    raises it."""
    def refuse(n: int) -> Any:
        raise LimitExceeded(f"{n} bytes would pass this client's mapped-memory limit")

    with Placement(refuse) as p:
        t = torch.zeros(1 << 20, dtype=torch.int8)
    assert p.placed == [] and t.shape == (1 << 20,) and not t.any()
    with Placement(refuse, required=True), pytest.raises(LimitExceeded, match="limit"):
        torch.zeros(1 << 20, dtype=torch.int8)


def test_heads_decide_head_slices(daemon_sockets: tuple[str, str]) -> None:
    """With vLLM's views and TP sizes that differ: heads split into head
    slices; fewer heads per rank than slices are replicas on the other
    side (whole blocks, as MLA's: placed, no staging); heads that do not
    split are refused by name."""
    a, _ = daemon_sockets

    def worker(heads: int, name: str) -> Worker:
        return Worker(worker_options(a, name, send=True, receive=False, block_size=BLOCK_SIZE,
                                     max_blocks=BLOCKS, tp_size=1, peer_tp_size=2,
                                     view_heads=heads))

    def views(w: Worker, heads: int) -> dict[str, Any]:
        ctx = w.allocation_context()
        per = BLOCKS * heads * BLOCK_SIZE * HEAD * 2
        with ctx if ctx is not None else contextlib.nullcontext():
            buf = torch.zeros(LAYERS * per, dtype=torch.float16)
        return {f"l{i}": buf[i * per:(i + 1) * per].view(BLOCKS, heads, BLOCK_SIZE, HEAD * 2)
                for i in range(LAYERS)}

    for heads, replicated, memory in ((4, False, "staging"), (1, True, "placed")):
        w = worker(heads, f"P{heads}")
        try:
            assert (w.allocation_context() is None) == (not replicated)
            w.register(views(w, heads))
            assert (w.replicated, w.k, w.memory) == (replicated, 1 if replicated else 2, memory)
        finally:
            w.close()
    w = worker(3, "P3")
    try:
        with pytest.raises(InvalidArgument, match="3 KV heads per rank do not split into 2"):
            w.register(views(w, 3))
    finally:
        w.close()


def test_auto_stages_what_cannot_be_the_pool(daemon_sockets: tuple[str, str]) -> None:
    """``auto`` without an allocation context, or with tensors allocated
    elsewhere: staging, said in the log; ``shared`` then moves them."""
    a, _ = daemon_sockets
    for memory, want in (("auto", "staging"), ("shared", "moved")):
        w = Worker(worker_options(a, f"P-{memory}", send=True, receive=False,
                                  block_size=BLOCK_SIZE, max_blocks=BLOCKS, memory=memory))
        try:
            ctx = w.allocation_context()
            assert ctx is not None
            with ctx:
                pass  # the engine allocated nothing here
            w.register({f"l{i}": torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, HEAD * 2,
                                              dtype=torch.float16) for i in range(LAYERS)})
            assert w.memory == want
        finally:
            w.close()
    w = Worker(worker_options(a, "P-staging", send=True, receive=False, block_size=BLOCK_SIZE,
                              max_blocks=BLOCKS, memory="staging"))
    try:
        assert w.allocation_context() is None
    finally:
        w.close()
