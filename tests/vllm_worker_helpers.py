"""Helpers for tests of the vLLM connector's worker side (``_worker.Worker``,
no vLLM needed): its options with small test defaults, a bounded wait for
what it reports finished, a prefill step, a TP 1 -> 2 set of workers, and
one request pulled by several decode ranks. Not a test file."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from p2pxfer.integrations.vllm._plan import Load, Save, Send
from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions

__all__ = ["DEADLINE_S", "one_to_two", "prefill_step", "pulled_by_each", "wait_finished",
           "worker_options"]

DEADLINE_S = 120.0


def worker_options(socket: str, engine: str, *, block_size: int, max_blocks: int,
                   **kw: Any) -> WorkerOptions:
    """Rank 0, 8 holds and 8 loads at once, 60 s leases and load timeouts,
    unless ``kw`` says otherwise."""
    base: dict[str, Any] = {"rank": 0, "block_size": block_size, "max_blocks": max_blocks,
                            "max_held": 8, "max_loads": 8, "lease_s": 60.0,
                            "load_timeout_s": 60.0}
    base.update(kw)
    return WorkerOptions(socket=socket, engine=engine, **base)


def wait_finished(w: Worker, *, sent: set[str] = frozenset(),  # type: ignore[assignment]
                  received: set[str] = frozenset(),  # type: ignore[assignment]
                  within_s: float = DEADLINE_S) -> None:
    """Until ``w`` has reported every request of ``sent`` finished sending
    and every one of ``received`` finished receiving (fails after
    ``within_s``)."""
    want_s, want_r = set(sent), set(received)
    deadline = time.monotonic() + within_s
    while want_s or want_r:
        s, r = w.finished()
        want_s -= s
        want_r -= r
        assert time.monotonic() < deadline, f"still waiting for {want_s} / {want_r}"
        time.sleep(0.02)


def pulled_by_each(prefill: Worker, decode: Sequence[Worker], key: int, src: Sequence[int],
                   dst: Sequence[int]) -> None:
    """The prefill holds request ``"r"`` (blocks ``src``) under ``key``;
    every decode worker loads it into its blocks ``dst`` (``"d<rank>"``).
    Returns once each load ended without a load error and the prefill
    released the request."""
    prefill.hold([Send("r", key, tuple(src))])
    for r, w in enumerate(decode):
        w.load([Load(f"d{r}", prefill.node, "P", key, "r", 0, tuple(dst))])
    for r, w in enumerate(decode):
        wait_finished(w, received={f"d{r}"})
        assert w.load_errors() == set()
    wait_finished(prefill, sent={"r"})


def prefill_step(w: Worker, caches: dict[str, Any], request: str, blocks: Sequence[int]) -> None:
    """What vLLM's forward does on a prefill: each layer computed, then
    saved; the step's end (``wait_for_save``)."""
    saves = [Save(request, tuple(blocks))]
    for name in caches:
        w.stage_layer(name, saves)
    w.end_step(saves)


@contextmanager
def one_to_two(prefill_socket: str, decode_socket: str,
               options: Callable[..., WorkerOptions], src: dict[str, Any],
               dst: Sequence[dict[str, Any]]) -> Iterator[tuple[Worker, list[Worker]]]:
    """A prefill at TP 1 (engine "P", caches ``src``) and decode ranks 0 and
    1 at TP 2 (engine "D", caches ``dst[r]``), registered; closed on the
    way out."""
    prefill = Worker(options(prefill_socket, "P", send=True, receive=False, tp_size=1,
                             peer_tp_size=2))
    decode: list[Worker] = []
    try:
        decode.extend(Worker(options(decode_socket, "D", rank=r, send=False, receive=True,
                                     tp_size=2, peer_tp_size=1)) for r in range(2))
        prefill.register(src)
        for w, mine in zip(decode, dst, strict=True):
            w.register(mine)
        yield prefill, decode
    finally:
        for w in decode:
            w.close()
        prefill.close()
