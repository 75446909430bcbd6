"""The vLLM connector's worker side pushing as computed (``_push``), without
vLLM: two real daemons; the decode's load starts before the prefill has
scheduled the request, each layer is pushed as the prefill's last step
computes it, and the prefill's blocks are released only once the
scheduler finished the request. Every byte of every layer checked.
``test_vllm_connector.py`` drives the same through vLLM's schedulers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from test_vllm_worker import blocks_equal, caches, head_caches, heads_of, options

import p2pxfer
from p2pxfer.errors import RegionWithdrawn, UnknownRegion
from p2pxfer.integrations.vllm._plan import Load, Open, Save, Send, Withdraw, pull_region
from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions
from p2pxfer.scatter import ScatterList
from vllm_worker_helpers import DEADLINE_S, one_to_two, wait_finished

SB = [5, 6, 7, 30, 2, 9]  # the prefill's blocks of the prompt
DB = [11, 40, 41, 42, 3, 0]  # the decode's


def until(cond: Callable[[], bool], what: str, within_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {within_s} s"
        time.sleep(0.01)


def last(request: str, blocks: list[int]) -> list[Save]:
    """The step that computes the prompt's last tokens (here: all of it)."""
    return [Save(request, tuple(blocks), last=True, table=tuple(blocks))]


def compute_all(w: Worker, names: Any, request: str, key: int, tid: str) -> None:
    """The prefill's one step: every layer computed and saved, the step
    ended, then the request finished (as vLLM's scheduler says)."""
    saves = last(request, SB)
    for name in names:
        w.stage_layer(name, saves)
    w.end_step(saves)
    w.hold([Send(request, key, tuple(SB), tid)])


def layer_landed(src: dict[str, Any], dst: dict[str, Any], name: str) -> bool:
    return bool((src[name].view(np.uint16)[:, SB] == dst[name].view(np.uint16)[:, DB]).all())


@contextmanager
def pair(sockets: tuple[str, str], src: dict[str, Any], dst: dict[str, Any],
         **kw: Any) -> Iterator[tuple[Worker, Worker]]:
    """A prefill worker (engine "P", caches ``src``) and a decode worker
    ("D", ``dst``), registered; closed on the way out."""
    prefill = Worker(options(sockets[0], "P", send=True, receive=False, **kw))
    try:
        decode = Worker(options(sockets[1], "D", send=False, receive=True, **kw))
        try:
            prefill.register(src)
            decode.register(dst)
            yield prefill, decode
        finally:
            decode.close()
    finally:
        prefill.close()


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
def test_each_layer_is_pushed_as_it_is_computed(daemon_sockets: tuple[str, str],
                                                checksum: bool) -> None:
    """The decode pulls before the prefill opened the transfer (its pull is
    written again until the slots are there); the first two layers land
    while the rest are not computed yet; the prefill is reported finished
    sending only after the scheduler finished it."""
    src, dst = caches(1), caches(None)
    names = list(src)
    with pair(daemon_sockets, src, dst, checksum=checksum) as (prefill, decode):
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-1", 0, tuple(DB), "t-1")])
        time.sleep(0.2)  # the pull finds no slots and is written again
        prefill.open([Open("req-1", 3, "t-1")])
        saves = last("req-1", SB)
        for name in names[:2]:
            prefill.stage_layer(name, saves)
        until(lambda: all(layer_landed(src, dst, n) for n in names[:2]), "early layers")
        assert decode.finished() == (set(), set())  # the other layers are not computed
        assert not dst[names[2]].any()
        for name in names[2:]:
            prefill.stage_layer(name, saves)
        prefill.end_step(saves)
        wait_finished(decode, received={"dec-1"})
        assert decode.load_errors() == set()
        blocks_equal(src, dst, SB, DB)
        # Pushed, but vLLM still runs the request: its blocks are not let go.
        time.sleep(0.2)
        assert prefill.finished() == (set(), set())
        prefill.hold([Send("req-1", 3, tuple(SB), "t-1")])
        wait_finished(prefill, sent={"req-1"})


def test_a_pull_after_the_prefill_finished_gets_every_layer(
        daemon_sockets: tuple[str, str]) -> None:
    src, dst = caches(2), caches(None)
    with pair(daemon_sockets, src, dst) as (prefill, decode):
        prefill.open([Open("req-1", 1, "t-late")])
        compute_all(prefill, src, "req-1", 1, "t-late")
        time.sleep(0.1)
        assert prefill.finished() == (set(), set())  # held for the pull
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-late", 0, tuple(DB), "t-late")])
        wait_finished(decode, received={"dec-1"})
        wait_finished(prefill, sent={"req-1"})
        assert decode.load_errors() == set()
        blocks_equal(src, dst, SB, DB)
    # Pushed whole: its slots went without a tombstone (a router may use the
    # id again).
    with p2pxfer.SyncClient(daemon_sockets[1]) as c:
        with pytest.raises(UnknownRegion) as gone:
            c.write(prefill.node, pull_region("P", 0, "t-late"), ScatterList.contiguous(8),
                    src=c.alloc(4096))
        assert not isinstance(gone.value, RegionWithdrawn), gone.value


def test_an_aborted_prefill_lets_go_and_its_decode_gets_load_errors_at_once(
        daemon_sockets: tuple[str, str]) -> None:
    """Aborted after its first layer: released at once, nothing more is
    pushed, and the decode is told (``kv_abandon``): its load fails now,
    not at its deadline (120 s)."""
    src, dst = caches(3), caches(None)
    with pair(daemon_sockets, src, dst, load_timeout_s=120.0) as (prefill, decode):
        prefill.open([Open("req-1", 2, "t-abort")])
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-abort", 0, tuple(DB), "t-abort")])
        first = next(iter(src))
        prefill.stage_layer(first, last("req-1", SB))
        until(lambda: layer_landed(src, dst, first), "the first layer")
        prefill.hold([Send("req-1", 2, (), "t-abort")])
        wait_finished(prefill, sent={"req-1"}, within_s=10)
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)


def test_a_prefill_aborted_before_its_decode_pulled_fails_the_load_at_once(
        daemon_sockets: tuple[str, str]) -> None:
    """Aborted before any pull came: a pull within the grace is still taken
    and answered with the abort, so the load fails now, not at its
    deadline; the prefill's request is released once it answered. (A grace
    of 20 s: a starved machine may take more than the default 2 s to pull.)"""
    src, dst = caches(5), caches(None)
    with pair(daemon_sockets, src, dst, load_timeout_s=120.0,
              abort_grace_s=20.0) as (prefill, decode):
        prefill.open([Open("req-1", 4, "t-abort-early")])
        prefill.hold([Send("req-1", 4, (), "t-abort-early")])
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-abort-early", 0, tuple(DB),
                          "t-abort-early")])
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)
        assert not dst[next(iter(dst))].any()
        wait_finished(prefill, sent={"req-1"}, within_s=30)


@pytest.mark.parametrize("how", ["aborted", "lease"])
def test_a_pull_after_the_prefill_let_go_fails_the_load_at_once(
        daemon_sockets: tuple[str, str], how: str) -> None:
    """The decode pulls only after the prefill let the transfer go, aborted
    (past ``abort_grace_s``) or its lease passed with no pull: the slots
    went with a reason (``RegionWithdrawn``), so the load fails now, not
    at its deadline (120 s)."""
    src, dst = caches(6), caches(None)
    with pair(daemon_sockets, src, dst, load_timeout_s=120.0, abort_grace_s=0.0,
              lease_s=120.0 if how == "aborted" else 0.5) as (prefill, decode):
        tid = f"t-gone-{how}"
        prefill.open([Open("req-1", 5, tid)])
        if how == "aborted":
            prefill.hold([Send("req-1", 5, (), tid)])
        else:
            compute_all(prefill, src, "req-1", 5, tid)
        wait_finished(prefill, sent={"req-1"}, within_s=30)
        t0 = time.monotonic()
        decode.load([Load("dec-1", prefill.node, "P", 0, tid, 0, tuple(DB), tid)])
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)
        assert time.monotonic() - t0 < 30
        assert not dst[next(iter(dst))].any()


def test_a_transfer_never_opened_is_a_load_error_at_the_deadline(
        daemon_sockets: tuple[str, str]) -> None:
    with pair(daemon_sockets, caches(4), caches(None), load_timeout_s=2.0) as (prefill, decode):
        t0 = time.monotonic()
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-none", 0, tuple(DB), "t-none")])
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)
        assert time.monotonic() - t0 < 15


def test_a_corrupted_byte_pushed_as_computed_is_a_load_error(
        daemon_sockets: tuple[str, str]) -> None:
    """A load error at once; the load's request number stays taken until
    its deadline and a lease have passed (later pushes of the prefill may
    still ask for it: the daemon refuses them), then is free."""
    src, dst = caches(5), caches(None)
    with pair(daemon_sockets, src, dst, checksum=True, lease_s=3.0, load_timeout_s=10.0) as (
            prefill, decode):

        def corrupt(pool: Any, layout: Any, layer: int, blocks: Any) -> None:
            if layer == 2:
                off = layer * layout.layer_stride + int(blocks[1]) * layout.block_stride + 77
                pool[off] ^= 0x40
        decode.on_landed = corrupt
        prefill.open([Open("req-1", 1, "t-bad")])
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-bad", 0, tuple(DB), "t-bad")])
        compute_all(prefill, src, "req-1", 1, "t-bad")
        wait_finished(decode, received={"dec-1"})
        assert decode.load_errors() == set(DB)
        assert len(decode._slots) == 1  # quarantined
        wait_finished(prefill, sent={"req-1"})
        until(lambda: len(decode._slots) == 0, "the request number back", 60)
        names = list(src)
        assert layer_landed(src, dst, names[1])
        assert not dst[names[2]].any()  # the bad layer never reached the engine


def test_one_prefill_rank_pushes_as_computed_to_two_decode_ranks(
        daemon_sockets: tuple[str, str]) -> None:
    a, b = daemon_sockets
    src = head_caches(6, 4, "NHD")
    dst = [head_caches(None, 2, "NHD") for _ in range(2)]

    def opts(socket: str, engine: str, **kw: Any) -> WorkerOptions:
        return options(socket, engine, head_layout="NHD", **kw)
    with one_to_two(a, b, opts, src, dst) as (prefill, decode):
        for r, w in enumerate(decode):
            w.load([Load(f"d{r}", prefill.node, "P", 0, "t-tp", 0, tuple(DB), "t-tp")])
        prefill.open([Open("req-1", 1, "t-tp")])
        compute_all(prefill, src, "req-1", 1, "t-tp")
        for r, w in enumerate(decode):
            wait_finished(w, received={f"d{r}"})
            assert w.load_errors() == set()
        wait_finished(prefill, sent={"req-1"})
        for name in src:
            for r in range(2):
                assert (dst[r][name][:, DB] ==
                        heads_of(src[name], SB, 2 * r, 2 * r + 2, "NHD")).all(), (name, r)


@pytest.mark.parametrize("mla", [False, True], ids=["heads", "mla"])
def test_two_prefill_ranks_push_as_computed_to_one_decode_rank(
        daemon_sockets: tuple[str, str], mla: bool) -> None:
    """TP 2 -> 1: the decode's pulls go to each prefill rank's slots for the
    transfer; with heads, each rank pushes its half into a head slice (with
    checksums); MLA: whole blocks from rank 0, and rank 1's replica is let
    go by an empty pull."""
    a, b = daemon_sockets
    rng = np.random.default_rng(40)
    if mla:
        one = {f"l{i}": rng.integers(0, 1 << 16, (64, 16, 40), dtype=np.uint16)
               for i in range(4)}
        src = [{n: v.copy() for n, v in one.items()} for _ in range(2)]
        dst = {n: np.zeros_like(v) for n, v in one.items()}
    else:
        src = [head_caches(50 + q, 2, "HND") for q in range(2)]
        dst = head_caches(None, 4, "HND")
    prefill = [Worker(options(a, "P", rank=q, send=True, receive=False, tp_size=2,
                              peer_tp_size=1, head_layout="HND", checksum=not mla))
               for q in range(2)]
    decode = Worker(options(b, "D", send=False, receive=True, tp_size=1, peer_tp_size=2,
                            head_layout="HND", checksum=not mla))
    try:
        for w, mine in zip(prefill, src, strict=True):
            w.register(mine)
        decode.register(dst)
        decode.load([Load("d", prefill[0].node, "P", 0, "t-21", 0, tuple(DB), "t-21")])
        for w, mine in zip(prefill, src, strict=True):
            w.open([Open("r", 4, "t-21")])
            compute_all(w, mine, "r", 4, "t-21")
        wait_finished(decode, received={"d"})
        assert decode.load_errors() == set()
        for w in prefill:
            wait_finished(w, sent={"r"})
        for q in range(2):
            for name, value in src[q].items():
                if mla:
                    assert (dst[name][DB] == value[SB]).all(), name
                else:
                    assert (heads_of(dst[name], DB, 2 * q, 2 * q + 2, "HND") ==
                            value[:, SB]).all(), (q, name)
    finally:
        decode.close()
        for w in prefill:
            w.close()


def out(new: list[Any], cached: list[tuple[str, list[int] | None, int]], tokens: dict[str, int],
        resumed: tuple[str, ...] = ()) -> Any:
    """A scheduler output of these new and cached requests."""
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], num_computed_tokens=[c[2] for c in cached],
            new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
            resumed_req_ids=set(resumed)),
        num_scheduled_tokens=tokens)


def test_the_prefill_scheduler_opens_marks_the_last_step_and_holds_until_pushed() -> None:
    """Chunked 40 + 60 tokens, preempted between the chunks: opened once, at
    its first scheduling; the step that computes the prompt's end is
    ``last``, with the blocks it has after the preemption (replaced, not
    appended); the step after stages nothing; finished: held, no
    parameters."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-a", "P", 16, 8, send=True, receive=False)
    req = SimpleNamespace(request_id="p1", prompt_token_ids=list(range(100)), max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True, "transfer_id": "x-1"})
    side.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), 0)
    new = SimpleNamespace(req_id="p1", block_ids=([7, 8, 9],), num_computed_tokens=0)
    step = side.plan(out([new], [], {"p1": 40}))
    assert step.opens == [Open("p1", 1, "x-1")]
    assert step.saves == [Save("p1", (7, 8, 9))]
    # Preempted, then scheduled again from scratch: all its blocks are new.
    side.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([20, 21, 22],)), 0)
    step = side.plan(out([], [("p1", [20, 21, 22], 0)], {"p1": 40}, resumed=("p1",)))
    assert step.opens == [] and step.saves == [Save("p1", (20, 21, 22))]
    step = side.plan(out([], [("p1", [23, 24, 25, 26], 40)], {"p1": 60}))
    table = (20, 21, 22, 23, 24, 25, 26)
    assert step.saves == [Save("p1", (22, 23, 24, 25, 26), last=True, table=table)]
    # A step past the prompt (asynchronous scheduling runs one before vLLM
    # sees the request finished): not ``last`` again, and nothing staged
    # (its token would write block 26 again while it may be pushed).
    step = side.plan(out([], [("p1", None, 100)], {"p1": 1}))
    assert step.saves == []
    assert side.finished(req, list(table), True) == (True, None)
    assert side.plan(out([], [], {})).sends == [Send("p1", 1, table, "x-1")]
    side.sent({"p1"})
    assert side.held() == 0


def test_a_bad_transfer_is_served_locally_not_raised_out_of_vllm() -> None:
    """A transfer id that cannot name a region, or a prefill asked for more
    than one token: logged; the prefill is not opened nor held, the decode
    computes the prompt itself (told at once where the id names a region)."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    prefill = SchedulerSide("node-a", "P", 16, 8, send=True, receive=False)
    for tid, max_tokens in (("bad id/../x", 1), ("x" * 65, 1), ("fine", 5)):
        req = SimpleNamespace(request_id="p1", prompt_token_ids=list(range(40)),
                              max_tokens=max_tokens,
                              kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        prefill.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 0)
        step = prefill.plan(out([], [], {}))
        assert step.opens == []
        assert step.withdraws == ([Withdraw(tid, "prefill request 'p1' has max_tokens 5, not 1")]
                                  if tid == "fine" else [])
        assert prefill.finished(req, [1, 2, 3], True) == (False, None)
        assert prefill.held() == 0
        assert prefill.plan(out([], [], {})).withdraws == []  # once
    decode = SchedulerSide("node-b", "D", 16, 8, send=False, receive=True)
    params = {"do_remote_prefill": True, "remote_node": "node-a", "remote_engine_id": "P",
              "transfer_id": "no spaces allowed"}
    req = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(40)),
                          kv_transfer_params=params)
    assert decode.matched_tokens(req, 0) == (0, False)
    assert decode.finished(req, [], False) == (False, None)
    assert decode.plan(out([], [], {})).loads == []


def test_a_transfer_that_is_never_opened_is_withdrawn() -> None:
    """Pushed as computed, but aborted before it was ever scheduled, or no
    key free to hold it: its transfer is withdrawn (once), so the decode's
    pull fails at once instead of at its deadline."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-a", "P", 16, 1, send=True, receive=False)

    def req(rid: str) -> Any:
        return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(40)), max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True,
                                                   "transfer_id": f"t-{rid}"})

    waiting = req("p0")
    assert side.finished(waiting, [], False) == (False, None)
    assert side.plan(out([], [], {})).withdraws == [
        Withdraw("t-p0", "prefill request 'p0' ended before it was scheduled (aborted)")]
    held, refused = req("p1"), req("p2")
    for r in (held, refused):
        side.after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 0)
    step = side.plan(out([], [], {}))
    assert step.opens == [Open("p1", 1, "t-p1")]
    assert [w.transfer_id for w in step.withdraws] == ["t-p2"]
    assert "'p2' could not be held" in step.withdraws[0].reason
    # Scheduled again once a key is free: still not opened, nor withdrawn again.
    assert side.finished(held, [1, 2, 3], False) == (True, None)
    side.sent({"p1"})
    side.after_alloc(refused, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],)), 0)
    step = side.plan(out([], [], {}))
    assert step.opens == [] and step.withdraws == []
    assert side.finished(refused, [4, 5, 6], True) == (False, None)
    assert side.plan(out([], [], {})).withdraws == []


def test_a_withdrawn_transfers_pull_fails_the_load_at_once(
        daemon_sockets: tuple[str, str]) -> None:
    """The prefill withdrew a transfer it never opened: the decode's pull
    hears why, and its load fails now, not at its deadline (120 s)."""
    src, dst = caches(7), caches(None)
    with pair(daemon_sockets, src, dst, load_timeout_s=120.0) as (prefill, decode):
        t0 = time.monotonic()
        # (A pull that comes before the withdraw is written again, as for a
        # transfer not opened yet.)
        prefill.withdraw([Withdraw("t-never", "prefill request 'r9' was aborted")])
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-never", 0, tuple(DB), "t-never")])
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)
        assert time.monotonic() - t0 < 30


def test_a_finished_prefill_holds_and_offers_only_its_prompts_blocks() -> None:
    """A block vLLM gave a token past the prompt (96 tokens: 6 whole blocks,
    the 7th holds only a token asynchronous scheduling ran) is neither held
    nor offered: the decode lines the table up with its own 6 prompt
    blocks, so a 7th would shift every block it pulls by one."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-a", "P", 16, 8, send=True, receive=False)
    req = SimpleNamespace(request_id="p1", prompt_token_ids=list(range(96)), max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})
    side.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7],)), 0)
    held, params = side.finished(req, [1, 2, 3, 4, 5, 6, 7], True)
    assert held and params is not None
    assert params["remote_block_ids"] == [1, 2, 3, 4, 5, 6]
    (send,) = side.plan(out([], [], {})).sends
    assert send.blocks == (1, 2, 3, 4, 5, 6)


def test_the_decode_scheduler_loads_a_pushed_request_by_its_prompt_length() -> None:
    """No block table from the prefill: it holds the prompt's length in
    blocks; with 2 blocks cached here, the pull skips them."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-b", "D", 16, 8, send=False, receive=True)
    params = {"do_remote_prefill": True, "remote_node": "node-a", "remote_engine_id": "P",
              "transfer_id": "x-9", "remote_tp_size": 1}
    req = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(100)),
                          kv_transfer_params=params)
    assert side.matched_tokens(req, 32) == (68, True)
    side.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([40, 41, 50, 51, 52, 53,
                                                                   54],)), 68)
    (load,) = side.plan(out([], [], {})).loads
    assert (load.skip, load.blocks, load.transfer_id, load.remote_request) == (
        2, (50, 51, 52, 53, 54), "x-9", "x-9")


def test_no_push_starts_after_the_decode_gave_up(daemon_sockets: tuple[str, str]) -> None:
    """The decode waits 6 s; the prefill computes its later layers after
    that: they are not pushed (they could land in blocks since given to
    another load). The first layer, pushed in time, did land."""
    src, dst = caches(8), caches(None)
    with pair(daemon_sockets, src, dst, load_timeout_s=6.0) as (prefill, decode):
        prefill.open([Open("req-1", 1, "t-slow")])
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-slow", 0, tuple(DB), "t-slow")])
        names = list(src)
        saves = last("req-1", SB)
        prefill.stage_layer(names[0], saves)
        until(lambda: layer_landed(src, dst, names[0]), "the first layer")
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)
        for name in names[1:]:
            prefill.stage_layer(name, saves)
        prefill.end_step(saves)
        prefill.hold([Send("req-1", 1, tuple(SB), "t-slow")])
        wait_finished(prefill, sent={"req-1"})
        pool, lay = decode.pool, decode.layout
        assert pool is not None and lay is not None
        for layer in range(1, len(names)):
            for blk in DB:
                off = layer * lay.layer_stride + blk * lay.block_stride
                assert not pool.array[off:off + lay.block_bytes].any(), (layer, blk)


def test_a_load_vllm_aborted_stops_at_once(daemon_sockets: tuple[str, str]) -> None:
    """The prefill has not computed the request (and may never): a cancel
    ends the load at once as a load error, well before its deadline."""
    with pair(daemon_sockets, caches(9), caches(None), load_timeout_s=120.0) as (prefill,
                                                                                  decode):
        prefill.open([Open("req-1", 1, "t-stop")])
        decode.load([Load("dec-1", prefill.node, "P", 0, "t-stop", 0, tuple(DB), "t-stop")])
        time.sleep(0.5)  # the pull is in; no layer comes
        t0 = time.monotonic()
        decode.cancel(["dec-1"])
        wait_finished(decode, received={"dec-1"}, within_s=30)
        assert decode.load_errors() == set(DB)
        assert time.monotonic() - t0 < 20
        prefill.hold([Send("req-1", 1, (), "t-stop")])
        wait_finished(prefill, sent={"req-1"})


def test_the_decode_scheduler_stops_a_pushed_load_vllm_aborted() -> None:
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-b", "D", 16, 8, send=False, receive=True)

    def req(rid: str) -> Any:
        params = {"do_remote_prefill": True, "remote_node": "node-a", "remote_engine_id": "P",
                  "transfer_id": f"t-{rid}", "remote_tp_size": 1}
        return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(40)),
                               kv_transfer_params=params)

    blocks = SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],))
    reqs = {rid: req(rid) for rid in ("aborted", "done", "loaded")}
    for r in reqs.values():
        assert side.matched_tokens(r, 0) == (40, True)
        side.after_alloc(r, blocks, 40)
    assert len(side.plan(out([], [], {})).loads) == 3
    side.received({"loaded"})  # its load reported back
    assert side.finished(reqs["aborted"], [4, 5, 6], False) == (False, None)
    assert side.finished(reqs["done"], [4, 5, 6], True) == (False, None)
    assert side.finished(reqs["loaded"], [4, 5, 6], False) == (False, None)
    assert side.plan(out([], [], {})).cancels == ["aborted"]
