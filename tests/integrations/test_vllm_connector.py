"""The vLLM connector driven by vLLM's own objects (``vllm_harness``): the
connector built by ``KVConnectorFactory`` in both roles, vLLM's scheduler
deciding what is loaded and when a request may run, per-layer CPU torch
tensors pushed through two real daemons; the decode checks every byte of
every layer. Failures: a prefill node killed before it pushes, and a byte
corrupted on the receiving side with checksums on, each become load errors
that vLLM's scheduler turns into a recompute, never a hang.

Skipped only where vLLM is not installed (CI installs it: ``.[vllm]``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: `.venv/bin/pip install -e '.[vllm]'` (vllm==0.33.0; "
    ".ci/run installs it)")

import torch
import vllm_harness as h

from daemon_helpers import LOOPBACK, DaemonProc, daemon_pair, free_port, start_daemon
from p2pxfer.integrations.vllm import P2PXferConnector
from p2pxfer.integrations.vllm._plan import Save

DEADLINE_S = 120.0
PROMPT = list(range(1, 101))  # 100 tokens: 7 blocks of 16, the last one partial


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    with daemon_pair(tmp_path) as (a, b):
        yield a, b


def fill_new(seed: int) -> Any:
    """"Attention": random K and V into the blocks of the step's new
    requests (what a forward computes before the layer is saved)."""
    g = torch.Generator().manual_seed(seed)

    def fill(name: str, t: torch.Tensor, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            ids = new.block_ids[0]
            t[:, ids] = torch.randn(t[:, ids].shape, generator=g).half()
    return fill


def prefill(p: h.Engine, rid: str, prompt: list[int], fill: Any = None) -> dict[str, Any]:
    """One prefill of ``prompt`` to be pulled (its layers written by
    ``fill``, else ``fill_new``); its kv_transfer_params."""
    p.scheduler.add_request(h.request(rid, prompt, 1, {"do_remote_decode": True}))
    p.step(fill or fill_new(len(rid)))
    (done,) = [o for o in p.outputs if o.request_id == rid]
    assert done.kv_transfer_params is not None
    return dict(done.kv_transfer_params)


def fill_slots(p: h.Engine, seed: int, seen: list[int] | None = None) -> Any:
    """"Attention" writing random K and V into exactly the slots each
    step's tokens write; ``seen``: the block ids of the last request filled."""
    g = torch.Generator().manual_seed(seed)

    def fill(name: str, t: torch.Tensor, out: Any) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            ids = p.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            if seen is not None:
                seen[:] = ids
            # schedule() has counted this step's tokens already.
            done = p.scheduler.requests[rid].num_computed_tokens - n
            slots = torch.arange(done, done + n)
            blocks = torch.tensor(ids)[slots // h.BLOCK_SIZE]
            t[:, blocks, slots % h.BLOCK_SIZE] = torch.randn(
                (2, n, h.KV_HEADS, h.HEAD), generator=g).half()
    return fill


def run_until(engines: list[h.Engine], cond: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S} s"
        for e in engines:
            e.step()
        time.sleep(0.02)


def occupy(d: h.Engine, n_tokens: int) -> None:
    """A local request holding the decode's first blocks, so the loaded
    request's block ids differ from the prefill's."""
    d.scheduler.add_request(h.request("local", list(range(500, 500 + n_tokens)), 200, None))
    d.step()


def close(*engines: h.Engine) -> None:
    for e in engines:
        for w in e.workers:
            w.shutdown()



def load_d1(p: Any, d: Any, prompt: list[int], params: dict[str, Any]
            ) -> tuple[list[int], list[int], Any]:
    """The decode takes request "d1" with the prefill's ``params``, runs
    until the load is done (no load error), and vLLM schedules it: the
    prefill's block ids, the decode's, and the scheduled request."""
    d.scheduler.add_request(h.request("d1", prompt, 4, params))
    run_until([p, d], lambda: "d1" in d.finished_recving and "p1" in p.finished_sending,
              "load")
    assert d.load_errors == set()
    new = d.scheduled("d1")
    src_ids = params["remote_block_ids"]
    return src_ids, new.block_ids[0][:len(src_ids)], new


def test_the_factory_makes_both_roles(pair: tuple[DaemonProc, DaemonProc],
                                      tmp_path: Path) -> None:
    a, _ = pair
    p = h.engine(tmp_path, "kv_both", a.socket, "both-engine")
    try:
        assert isinstance(p.worker, P2PXferConnector)
        assert isinstance(p.scheduler.connector, P2PXferConnector)
        assert p.scheduler.connector.scheduler.node == "node-a"
        assert p.worker.worker.layout.num_layers == h.LAYERS
        assert p.worker.worker.layout.planes == 2
    finally:
        close(p)


@pytest.mark.parametrize(("checksum", "memory"), [(False, "staging"), (True, "staging"),
                                                  (False, "shared"), (True, "shared")],
                         ids=["staging", "staging-checksum", "shared", "shared-checksum"])
def test_prefill_to_decode_every_byte_of_every_layer(pair: tuple[DaemonProc, DaemonProc],
                                                     tmp_path: Path, checksum: bool,
                                                     memory: str) -> None:
    """vLLM's prefill scheduler holds the finished request and answers its
    kv_transfer_params; vLLM's decode scheduler parks the request while
    its KV loads, then runs it from the last prompt token; every layer's
    blocks equal the prefill's; the prefill's blocks are freed after the
    push, and its key is free again. ``shared``: the engines' own tensors
    live in the daemon-shared pools (the same tensor objects vLLM holds)."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", checksum=checksum,
                 kv_memory=memory)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", checksum=checksum,
                 kv_memory=memory)
    if memory == "shared":
        for e in (p, d):
            pool = e.worker.worker.pool.mem.array
            t = e.kv[h.layer_names()[1]]
            assert pool.ctypes.data <= t.data_ptr() < pool.ctypes.data + pool.nbytes
    try:
        params = prefill(p, "p1", PROMPT)
        assert params["remote_node"] == "node-a"
        assert p.scheduler.connector.scheduler.held() == 1
        occupy(d, 40)
        src_ids, dst_ids, new = load_d1(p, d, PROMPT, params)
        # vLLM runs it only now, from the last prompt token.
        assert new.num_computed_tokens == len(PROMPT) - 1
        assert src_ids != dst_ids
        for name in h.layer_names():
            assert torch.equal(p.kv[name][:, src_ids].view(torch.int16),
                               d.kv[name][:, dst_ids].view(torch.int16)), name
        assert p.scheduler.connector.scheduler.held() == 0
        assert "p1" not in p.scheduler.requests  # its blocks went back
    finally:
        close(p, d)


def test_a_corrupted_byte_is_a_load_error_and_vllm_recomputes(
        pair: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", checksum=True)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", checksum=True)
    hit: list[int] = []

    def corrupt(pool: Any, layout: Any, layer: int, blocks: Any) -> None:
        if layer == 1:  # one byte of layer 1's third block, after it landed
            pool[layer * layout.layer_stride + int(blocks[2]) * layout.block_stride + 5] ^= 1
            hit.append(layer)

    d.worker.worker.on_landed = corrupt
    try:
        params = prefill(p, "p1", PROMPT)
        d.scheduler.add_request(h.request("d1", PROMPT, 4, params))
        run_until([p, d], lambda: "d1" in d.finished_recving, "load")
        assert hit == [1]
        loaded = d.scheduler.kv_cache_manager.get_block_ids("d1")[0]
        assert d.load_errors == set(loaded[:len(params["remote_block_ids"])])
        # vLLM recomputes (kv_load_failure_policy "recompute") instead of
        # trusting the bad layer: from the first failed block on.
        assert d.scheduled("d1").num_computed_tokens == 0
    finally:
        close(p, d)


def test_a_dead_prefill_node_is_a_load_error_not_a_hang(tmp_path: Path) -> None:
    """With membership: the prefill finished and answered, then its node
    died before any decode pulled; the decode's load ends as load errors
    once membership rules the node dead, and vLLM recomputes."""
    keys = {"membership": "embedded", "cluster_token": "vllm-cluster-token"}
    pa, pb = free_port(), free_port()
    b = start_daemon(tmp_path, "node-b", control_port=pb, **keys)
    a = start_daemon(tmp_path, "node-a", control_port=pa, seeds=[f"{LOOPBACK}:{pb}"], **keys)
    p = d = None
    try:
        deadline = time.monotonic() + DEADLINE_S
        while {x["name"]: x["state"] for x in b.status()["peers"]} != {
                "node-a": "alive", "node-b": "alive"}:
            assert time.monotonic() < deadline, b.status()["peers"]
            time.sleep(0.1)
        p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine")
        d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine",
                     load_timeout_s=600.0, poll_s=0.25)
        params = prefill(p, "p1", PROMPT)
        a.proc.kill()
        a.proc.wait(10)
        d.scheduler.add_request(h.request("d1", PROMPT, 4, params))
        run_until([d], lambda: "d1" in d.finished_recving, "load outcome")  # far below 600 s
        loaded = d.scheduler.kv_cache_manager.get_block_ids("d1")[0]
        assert d.load_errors == set(loaded[:len(params["remote_block_ids"])])
        assert d.scheduled("d1").num_computed_tokens == 0  # recomputed, not stuck
        assert b.status()["transfers_in_flight"] == 0
    finally:
        close(*[e for e in (p, d) if e is not None])
        a.stop()
        b.stop()


def test_a_decode_request_aborted_before_loading_releases_the_prefill(
        pair: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    """Aborted on decode before it was scheduled: the decode still tells
    the prefill (an empty pull), which frees its hold long before its
    lease."""
    from vllm.v1.request import RequestStatus

    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", lease_s=600.0)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine")
    try:
        params = prefill(p, "p1", PROMPT)
        d.scheduler.add_request(h.request("d1", PROMPT, 4, params))
        d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        run_until([p, d], lambda: "p1" in p.finished_sending, "release")  # far below 600 s
        assert p.scheduler.connector.scheduler.held() == 0
        assert "d1" not in d.finished_recving
    finally:
        close(p, d)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_heterogeneous_tp_through_vllm(pair: tuple[DaemonProc, DaemonProc], tmp_path: Path,
                                       prefill_tp: int, decode_tp: int) -> None:
    """A prefill of TP ``p`` into a decode of TP ``d`` (``peer_tp_size`` on
    both): every decode rank ends with its heads of every prefilled block,
    vLLM's scheduler sees the load finished once every rank has it, and
    the prefill's blocks are freed once every rank's pushes are done."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", tp=prefill_tp,
                 peer_tp_size=decode_tp, checksum=True)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", tp=decode_tp,
                 peer_tp_size=prefill_tp, checksum=True)
    try:
        params = prefill(p, "p1", PROMPT)
        assert params["remote_tp_size"] == prefill_tp
        occupy(d, 40)
        src_ids, dst_ids, _ = load_d1(p, d, PROMPT, params)
        # Both sides' heads, rank by rank, side by side (NHD: heads are dim 3).
        for name in h.layer_names():
            whole_p = torch.cat([kv[name][:, src_ids] for kv in p.kvs], dim=3)
            whole_d = torch.cat([kv[name][:, dst_ids] for kv in d.kvs], dim=3)
            assert torch.equal(whole_p.view(torch.int16), whole_d.view(torch.int16)), name
        assert "p1" not in p.scheduler.requests
    finally:
        close(p, d)


def same_heads(p: h.Engine, d: h.Engine, src_ids: list[int], dst_ids: list[int], *,
               heads_dim: int) -> None:
    """Every layer's blocks, every rank's heads side by side (``heads_dim``
    of ``h.blocks``' view), are written and equal on both sides."""
    for name in h.layer_names():
        whole_p = torch.cat([h.blocks(kv[name])[src_ids] for kv in p.kvs], dim=heads_dim)
        whole_d = torch.cat([h.blocks(kv[name])[dst_ids] for kv in d.kvs], dim=heads_dim)
        assert whole_p.abs().sum() > 0, name
        assert torch.equal(whole_p.view(torch.int16), whole_d.view(torch.int16)), name


def fill_blocks(seed: int) -> Any:
    """"Attention" for vLLM's own per-layer views: random bytes into every
    block of the step's new requests, whatever the layout's strides."""
    g = torch.Generator().manual_seed(seed)

    def fill(name: str, t: torch.Tensor, out: Any) -> None:
        b = h.blocks(t)
        for new in out.scheduled_new_reqs:
            ids = new.block_ids[0]
            b[ids] = torch.randn(b[ids].shape, generator=g).half()
    return fill


def in_pool(e: h.Engine, rank: int = 0) -> bool:
    """Every layer's KV tensor (its whole storage) is inside the rank's
    daemon-shared pool memory."""
    pool = e.workers[rank].worker.pool.mem.array
    lo, hi = pool.ctypes.data, pool.ctypes.data + pool.nbytes
    return all(lo <= (s := t.untyped_storage()).data_ptr() and s.data_ptr() + s.nbytes() <= hi
               for t in e.kvs[rank].values())


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_vllms_own_kv_cache_is_the_pool_by_default(pair: tuple[DaemonProc, DaemonProc],
                                                   tmp_path: Path, layout: str) -> None:
    """With no ``kv_memory`` set, vLLM allocates its KV cache (its own
    ``allocate_kv_cache``: one backing allocation, a view per layer, layers
    or blocks outermost) in the connector's ``get_mem_pool_context``: the
    pool is laid over it, nothing is copied on either side (``save_kv_layer``
    stages nothing), and the decode's views hold the prefill's bytes."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", vllm_alloc=layout)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", vllm_alloc=layout)
    try:
        for e in (p, d):
            assert e.worker.worker.memory == "placed"
            assert in_pool(e)
        params = prefill(p, "p1", PROMPT, fill_blocks(7))
        # Nothing to copy for a request's blocks: they are the pool.
        assert p.worker.worker.stage_layer(h.layer_names()[0], [Save("x", tuple(range(8)))]) == 0
        occupy(d, 40)
        src_ids, dst_ids, _ = load_d1(p, d, PROMPT, params)
        assert src_ids != dst_ids
        for name in h.layer_names():
            sent, got = h.blocks(p.kv[name])[src_ids], h.blocks(d.kv[name])[dst_ids]
            assert sent.abs().sum() > 0, name
            assert torch.equal(sent.view(torch.int16), got.view(torch.int16)), name
    finally:
        close(p, d)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "layout"),
                         [(1, 2, "LBNHC"), (2, 1, "LBHNC")], ids=["1to2-NHD", "2to1-HND"])
def test_heterogeneous_tp_on_vllms_own_kv_cache(pair: tuple[DaemonProc, DaemonProc],
                                                tmp_path: Path, prefill_tp: int,
                                                decode_tp: int, layout: str) -> None:
    """vLLM's per-layer views (``[blocks, heads, tokens, K|V]``, K and V in
    one plane): head slices are read from their strides (NHD or HND) and
    the KV cache spec says the plane is not MLA's replicated latent, so each
    decode rank gets its own heads. The side whose ranks hold more heads
    stages (``auto``), the other is zero copy."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", tp=prefill_tp,
                 peer_tp_size=decode_tp, checksum=True, vllm_alloc=layout)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", tp=decode_tp,
                 peer_tp_size=prefill_tp, checksum=True, vllm_alloc=layout)
    try:
        more = p if prefill_tp < decode_tp else d
        fewer = d if more is p else p
        assert {w.worker.memory for w in more.workers} == {"staging"}
        assert {w.worker.memory for w in fewer.workers} == {"placed"}
        params = prefill(p, "p1", PROMPT, fill_blocks(9))
        occupy(d, 40)
        src_ids, dst_ids, _ = load_d1(p, d, PROMPT, params)
        same_heads(p, d, src_ids, dst_ids, heads_dim=1)  # heads are dimension 1 of every view
    finally:
        close(p, d)


@pytest.mark.parametrize("decode_tp", [1, 2], ids=["1to1", "1to2-HND"])
def test_kernel_blocks_smaller_than_vllms_blocks(pair: tuple[DaemonProc, DaemonProc],
                                                 tmp_path: Path, decode_tp: int) -> None:
    """Attention kernels of 8-token blocks under a scheduler of 16: vLLM's
    views hold two kernel blocks per scheduled block. The connector moves
    scheduled blocks (two rows each), whole or as head slices (HND: one
    piece per kernel block), never a kernel block by the scheduler's id."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", peer_tp_size=decode_tp,
                 vllm_alloc="LBHNC", kernel_block=8)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", tp=decode_tp,
                 peer_tp_size=1, vllm_alloc="LBHNC", kernel_block=8)
    try:
        assert next(iter(p.kv.values())).shape[0] == 2 * h.NUM_BLOCKS  # kernel rows
        assert p.worker.worker.layers[0].layout.num_blocks == h.NUM_BLOCKS  # scheduled blocks
        params = prefill(p, "p1", PROMPT, fill_blocks(11))
        occupy(d, 40)
        src_ids, dst_ids, _ = load_d1(p, d, PROMPT, params)
        same_heads(p, d, src_ids, dst_ids, heads_dim=2)  # [block, kernel block, heads, tokens, K|V]
    finally:
        close(p, d)


def test_a_chunked_prefill_stages_each_chunk(pair: tuple[DaemonProc, DaemonProc],
                                             tmp_path: Path) -> None:
    """A 300-token prompt prefilled 64 tokens a step: each step stages the
    blocks its tokens touched; the decode gets every byte of every layer."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", chunk=64)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine")
    fill = fill_slots(p, 3)

    try:
        prompt = list(range(1, 301))
        p.scheduler.add_request(h.request("p1", prompt, 1, {"do_remote_decode": True}))
        steps = 0
        while not [o for o in p.outputs if o.request_id == "p1"]:
            p.step(fill)
            steps += 1
            assert steps < 20
        assert steps == 5  # 64 tokens a step
        (done,) = [o for o in p.outputs if o.request_id == "p1"]
        params = dict(done.kv_transfer_params)
        src_ids, dst_ids, _ = load_d1(p, d, prompt, params)
        for name in h.layer_names():
            assert torch.equal(p.kv[name][:, src_ids].view(torch.int16),
                               d.kv[name][:, dst_ids].view(torch.int16)), name
    finally:
        close(p, d)


def test_a_decode_request_aborted_while_loading_frees_its_blocks_after_the_load(
        pair: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    """Aborted while its load runs: vLLM keeps its blocks until the load
    reports done (it does, however it ends), then frees them; the
    connector's slots go back too."""
    from vllm.v1.request import RequestStatus

    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine")
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine")
    try:
        params = prefill(p, "p1", PROMPT)
        d.scheduler.add_request(h.request("d1", PROMPT, 4, params))
        d.step()  # the load starts
        d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        assert "d1" in d.scheduler.requests  # its blocks still held for the load
        run_until([p, d], lambda: "d1" in d.finished_recving and "p1" in p.finished_sending,
                  "load")
        d.step()
        assert "d1" not in d.scheduler.requests
        assert len(d.worker.worker._slots) == 0
    finally:
        close(p, d)


@pytest.mark.parametrize("chunk", [h.MAX_LEN, 64], ids=["one_step", "chunked"])
def test_pushed_as_computed_through_vllm(pair: tuple[DaemonProc, DaemonProc], tmp_path: Path,
                                         chunk: int) -> None:
    """A proxy sends the request to both engines at once with one
    transfer_id: vLLM's decode scheduler parks it and its load starts
    before the prefill has seen it; the prefill's layers are pushed as its
    last step computes them; vLLM frees the prefill's blocks only after the
    pushes, and the decode runs the request from its last prompt token."""
    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", chunk=chunk)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine")
    src_ids: list[int] = []
    fill = fill_slots(p, 5, src_ids)

    try:
        prompt = list(range(1, 301))
        occupy(d, 40)
        d.scheduler.add_request(h.request("d1", prompt, 4, {
            "do_remote_prefill": True, "remote_node": "node-a",
            "remote_engine_id": "prefill-engine", "transfer_id": "xfer-1",
            "remote_tp_size": 1}))
        d.step()  # parked; its load starts (the prefill has no slots for it yet)
        p.scheduler.add_request(h.request("p1", prompt, 1, {"do_remote_decode": True,
                                                            "transfer_id": "xfer-1"}))
        deadline = time.monotonic() + DEADLINE_S
        steps = 0
        while not ("d1" in d.finished_recving and "p1" in p.finished_sending):
            assert time.monotonic() < deadline, "no push within the deadline"
            p.step(fill)
            d.step()
            steps += 1
            time.sleep(0.02)
        assert d.load_errors == set()
        assert steps >= -(-len(prompt) // chunk)
        new = d.scheduled("d1")
        assert new.num_computed_tokens == len(prompt) - 1
        n = -(-len(prompt) // h.BLOCK_SIZE)
        dst_ids = new.block_ids[0][:n]
        assert src_ids[:n] != dst_ids
        for name in h.layer_names():
            assert torch.equal(p.kv[name][:, src_ids[:n]].view(torch.int16),
                               d.kv[name][:, dst_ids].view(torch.int16)), name
        assert p.scheduler.connector.scheduler.held() == 0
        assert "p1" not in p.scheduler.requests  # its blocks went back
    finally:
        close(p, d)


@pytest.mark.parametrize("when", ["after_its_first_chunk", "while_it_waits"])
def test_an_aborted_prefill_request_fails_the_load_at_once(
        pair: tuple[DaemonProc, DaemonProc], tmp_path: Path, when: str) -> None:
    """Pushed as computed, the prefill request is aborted after its first
    chunk, nothing pushed yet (the prefill tells the decode that pulled:
    ``kv_abandon``), or before vLLM ever scheduled it (the prefill
    withdraws its transfer): vLLM frees its blocks, and the decode's load
    fails now, not at its 600 s deadline; vLLM then computes the prompt
    itself."""
    from vllm.v1.request import RequestStatus

    a, b = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", chunk=64)
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine", load_timeout_s=600.0)
    try:
        prompt = list(range(1, 301))
        d.scheduler.add_request(h.request("d1", prompt, 4, {
            "do_remote_prefill": True, "remote_node": "node-a",
            "remote_engine_id": "prefill-engine", "transfer_id": f"xfer-{when}",
            "remote_tp_size": 1}))
        d.step()  # parked; its load starts
        p.scheduler.add_request(h.request("p1", prompt, 1, {"do_remote_decode": True,
                                                            "transfer_id": f"xfer-{when}"}))
        if when == "after_its_first_chunk":
            p.step()  # open for the decode's pull
        p.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
        t0 = time.monotonic()
        run_until([p, d], lambda: "d1" in d.finished_recving, "load outcome")
        assert time.monotonic() - t0 < 60, "the load waited for its deadline"
        assert d.load_errors
        assert d.scheduled("d1").num_computed_tokens == 0  # computed here, not stuck
        run_until([p, d], lambda: "p1" not in p.scheduler.requests, "prefill blocks freed")
        run_until([p, d], lambda: p.scheduler.connector.scheduler.held() == 0, "key freed")
    finally:
        close(p, d)


def test_asynchronous_scheduling_runs_no_step_after_a_pushed_prompt(
        pair: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    """What pushing as computed from vLLM's own memory relies on: with
    asynchronous scheduling (the next step scheduled before the last one's
    output is in), a prefill of one token gets no step after its prompt's
    last, so nothing writes the prompt's last block while it is pushed. A
    request of two tokens would get one: the connector opens only requests
    of one (``max_tokens`` 1)."""
    a, _ = pair
    p = h.engine(tmp_path, "kv_producer", a.socket, "prefill-engine", async_scheduling=True)
    try:
        prompt = list(range(1, 101))  # the last block is partial
        for rid, n in (("one", 1), ("two", 2)):
            p.scheduler.add_request(h.request(rid, prompt, n, {"do_remote_decode": True,
                                                              "transfer_id": f"x-{rid}"}))
        first = p.scheduler.schedule()
        assert set(first.num_scheduled_tokens) == {"one", "two"}
        after = p.scheduler.schedule()  # before the first step's output
        assert set(after.num_scheduled_tokens) == {"two"}
    finally:
        close(p)


def test_a_decode_request_aborted_while_its_push_is_awaited_frees_its_blocks_soon(
        pair: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    """Pushed as computed, the prefill never gets the request: aborting the
    decode request stops its load at once (not at its 120 s deadline), and
    vLLM then frees its blocks."""
    from vllm.v1.request import RequestStatus

    _, b = pair
    d = h.engine(tmp_path, "kv_consumer", b.socket, "decode-engine")
    try:
        d.scheduler.add_request(h.request("d1", PROMPT, 4, {
            "do_remote_prefill": True, "remote_node": "node-a",
            "remote_engine_id": "prefill-engine", "transfer_id": "xfer-never",
            "remote_tp_size": 1}))
        d.step()  # parked; its pull waits for slots that never come
        d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        t0 = time.monotonic()
        run_until([d], lambda: "d1" not in d.scheduler.requests, "blocks freed")
        assert time.monotonic() - t0 < 30
        assert len(d.worker.worker._msg_slots) == 0
    finally:
        close(d)
