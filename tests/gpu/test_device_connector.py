"""The vLLM connector's worker side on the engine's CUDA KV tensors: a
prefill whose per-layer tensors are on the GPU stages each layer's blocks
into the daemon-shared pool (device -> pinned host, on the stream the
forward runs on), the daemons push them, and the decode copies each layer
that landed into its own GPU tensors (pinned host -> device); every byte
of every layer checked, whole blocks (both arrangements) and head slices
(heterogeneous TP 1 -> 2, NHD: one piece per token).

Skipped, with the reason, where no CUDA device or no torch is at hand
(``gpu`` marker); ``docs/gpu.md`` says how to run them on an accelerator
machine."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from device_arrays import cuda_or_skip

from p2pxfer.errors import InvalidArgument
from p2pxfer.integrations.vllm._plan import Load, Open, Save, Send
from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions
from vllm_worker_helpers import (
    one_to_two,
    prefill_step,
    pulled_by_each,
    wait_finished,
    worker_options,
)

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD = 4, 64, 16, 4, 64


@pytest.fixture
def torch() -> Any:
    cuda_or_skip()
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return importlib.import_module("torch")


def options(socket: str, engine: str, **kw: Any) -> WorkerOptions:
    return worker_options(socket, engine, block_size=BLOCK_SIZE, max_blocks=BLOCKS, **kw)


def caches(torch: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    """Per-layer float16 tensors on the GPU, zeros."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.float16,
                                                            device="cuda")
            for i in range(LAYERS)}


def fill(torch: Any, tensors: dict[str, Any], seed: int) -> None:
    """Random bits into every tensor, as the forward's kernels would write
    them: queued on the current stream, nobody waits for them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors.values():
        bits = torch.randint(-(1 << 15), 1 << 15, t.shape, generator=g, device="cuda",
                             dtype=torch.int16)
        t.view(torch.int16).copy_(bits)


@pytest.mark.parametrize("planes_first", [True, False], ids=["planes_first", "blocks_first"])
def test_gpu_kv_tensors_stage_push_and_load_every_byte(torch: Any, daemon_sockets: tuple[str, str],
                                                       planes_first: bool) -> None:
    a, b = daemon_sockets
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD) if planes_first else \
        (BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD)
    src, dst = caches(torch, shape), caches(torch, shape)
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True, checksum=True))
    try:
        prefill.register(src)
        decode.register(dst)
        assert prefill.device == 0 and decode.device == 0
        fill(torch, src, 7)  # no synchronize: staging must queue behind these writes
        sb, db = [5, 6, 7, 30, 2, 9, 63], [11, 40, 41, 42, 3, 0, 62]
        prefill_step(prefill, src, "req-1", sb)
        prefill.hold([Send("req-1", 3, tuple(sb))])
        decode.load([Load("dec-1", prefill.node, "P", 3, "req-1", 0, tuple(db))])
        wait_finished(decode, received={"dec-1"})
        wait_finished(prefill, sent={"req-1"})
        assert decode.load_errors() == set()
        untouched = sorted(set(range(BLOCKS)) - set(db))
        for name, s in src.items():
            d = dst[name]
            if planes_first:
                assert torch.equal(d[:, db].view(torch.int16), s[:, sb].view(torch.int16)), name
                assert not d[:, untouched].any(), name
            else:
                assert torch.equal(d[db].view(torch.int16), s[sb].view(torch.int16)), name
                assert not d[untouched].any(), name
    finally:
        decode.close()
        prefill.close()


def test_gpu_kv_tensors_by_head_slices_tp_1_to_2(torch: Any,
                                                 daemon_sockets: tuple[str, str]) -> None:
    """TP 1 -> 2 in NHD: each block's heads split by token (one small piece
    per token and slice: many device copies, issued as one batch)."""
    src = caches(torch, (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD))
    dst = [caches(torch, (2, BLOCKS, BLOCK_SIZE, HEADS // 2, HEAD)) for _ in range(2)]
    with one_to_two(*daemon_sockets, options, src, dst) as (prefill, decode):
        fill(torch, src, 11)
        sb, db = [3, 4, 5, 40], [7, 1, 2, 9]
        prefill_step(prefill, src, "r", sb)
        pulled_by_each(prefill, decode, 2, sb, db)
        half = HEADS // 2
        for r in range(2):
            for name, s in src.items():
                want = s[:, sb, :, r * half:(r + 1) * half].view(torch.int16)
                assert torch.equal(dst[r][name][:, db].view(torch.int16), want), (r, name)


def test_gpu_kv_tensors_pushed_as_computed(torch: Any,
                                           daemon_sockets: tuple[str, str]) -> None:
    """The decode pulls first; each layer is written by a kernel nobody
    waits for, saved, and pushed once the event behind its own copies is
    over; every byte checked on the decode's GPU (checksums on)."""
    a, b = daemon_sockets
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD)
    src, dst = caches(torch, shape), caches(torch, shape)
    prefill = Worker(options(a, "P", send=True, receive=False, checksum=True))
    decode = Worker(options(b, "D", send=False, receive=True, checksum=True))
    try:
        prefill.register(src)
        decode.register(dst)
        sb, db = [5, 6, 7, 30, 2, 9, 63], [11, 40, 41, 42, 3, 0, 62]
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-1", 0, tuple(db), "t-1")])
        prefill.open([Open("req-1", 3, "t-1")])
        saves = [Save("req-1", tuple(sb), last=True, table=tuple(sb))]
        for i, name in enumerate(src):
            fill(torch, {name: src[name]}, 20 + i)  # this layer's "forward", not waited for
            prefill.stage_layer(name, saves)
        prefill.end_step(saves)
        wait_finished(decode, received={"dec-1"})
        assert decode.load_errors() == set()
        prefill.hold([Send("req-1", 3, tuple(sb), "t-1")])
        wait_finished(prefill, sent={"req-1"})
        for name, s in src.items():
            assert torch.equal(dst[name][:, db].view(torch.int16),
                               s[:, sb].view(torch.int16)), name
    finally:
        decode.close()
        prefill.close()


def test_gpu_kv_tensors_cannot_be_shared_memory(torch: Any,
                                                daemon_sockets: tuple[str, str]) -> None:
    """The zero-copy mode moves tensors into memory the daemon maps: not
    device memory. Refused by name, at registration."""
    w = Worker(options(daemon_sockets[0], "P", send=True, receive=False, memory="shared"))
    try:
        with pytest.raises(InvalidArgument, match=r"CUDA device.*staging"):
            w.register(caches(torch, (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD)))
    finally:
        w.close()
