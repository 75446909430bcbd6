"""The vLLM connector's worker side without vLLM (``_worker.Worker``, which
takes plain tensors and plans): two real daemons, a prefill worker that
stages numpy per-layer KV tensors and is pulled, a decode worker that loads
them into its own tensors; every byte of every layer checked. These run
wherever p2pxfer runs (no vLLM needed); ``test_vllm_connector.py`` drives
the same through vLLM's own objects.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from daemon_helpers import daemon_pair
from p2pxfer.integrations.vllm._plan import Load, Save, Send
from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD = 4, 64, 16, 2, 32
DEADLINE_S = 120.0


def caches(seed: int | None, planes_first: bool = True) -> dict[str, npt.NDArray[np.float16]]:
    """Per-layer tensors as vLLM allocates them: ``(2, blocks, block_size,
    heads, head)`` (random when ``seed`` is given, else zeros)."""
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD) if planes_first else \
        (BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD)
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        a = np.zeros(shape, np.float16)
        if seed is not None:
            a.view(np.uint16)[...] = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
        out[f"model.layers.{i}.self_attn.attn"] = a
    return out


def options(socket: str, engine: str, **kw: Any) -> WorkerOptions:
    base: dict[str, Any] = {"rank": 0, "block_size": BLOCK_SIZE, "max_blocks": BLOCKS,
                            "max_held": 8, "max_loads": 8, "lease_s": 60.0,
                            "load_timeout_s": 60.0}
    base.update(kw)
    return WorkerOptions(socket=socket, engine=engine, **base)


def wait_finished(w: Worker, *, sent: set[str] = frozenset(),  # type: ignore[assignment]
                  received: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    want_s, want_r = set(sent), set(received)
    deadline = time.monotonic() + DEADLINE_S
    while want_s or want_r:
        s, r = w.finished()
        want_s -= s
        want_r -= r
        assert time.monotonic() < deadline, f"still waiting for {want_s} / {want_r}"
        time.sleep(0.02)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[str, str]]:
    with daemon_pair(tmp_path) as (a, b):
        yield a.socket, b.socket


def blocks_equal(src: dict[str, Any], dst: dict[str, Any], sb: list[int], db: list[int],
                 planes_first: bool = True) -> None:
    for name in src:
        if planes_first:
            assert (src[name][:, sb].view(np.uint16) == dst[name][:, db].view(np.uint16)).all(), name
        else:
            assert (src[name][sb].view(np.uint16) == dst[name][db].view(np.uint16)).all(), name


@pytest.mark.parametrize("planes_first", [True, False], ids=["planes_first", "blocks_first"])
def test_stage_pull_load_every_byte(pair: tuple[str, str], planes_first: bool) -> None:
    a, b = pair
    src, dst = caches(1, planes_first), caches(None, planes_first)
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True))
    try:
        prefill.register(src)
        decode.register(dst)
        sb = [5, 6, 7, 30, 2, 9]
        db = [11, 40, 41, 42, 3, 0]
        for name in src:  # a prefill step: every layer's blocks staged
            prefill.stage_layer(name, [Save("req-1", tuple(sb))])
        prefill.end_step([Save("req-1", tuple(sb))])
        prefill.hold([Send("req-1", 3, tuple(sb))])
        decode.load([Load("dec-1", prefill.node, "P", 0, 3, "req-1", 0, tuple(db))])
        wait_finished(decode, received={"dec-1"})
        wait_finished(prefill, sent={"req-1"})
        assert decode.load_errors() == set()
        blocks_equal(src, dst, sb, db, planes_first)
        untouched = sorted(set(range(BLOCKS)) - set(db))
        assert all((dst[n][:, untouched] == 0).all() if planes_first else
                   (dst[n][untouched] == 0).all() for n in dst)
    finally:
        decode.close()
        prefill.close()
