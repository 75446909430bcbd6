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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from daemon_helpers import LOOPBACK, daemon_pair, free_port, start_daemon
from p2pxfer.integrations.vllm._plan import Load, Save, Send
from p2pxfer.integrations.vllm._worker import Worker, WorkerOptions
from vllm_worker_helpers import DEADLINE_S, pulled_by_each, wait_finished, worker_options

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD = 4, 64, 16, 2, 32


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
    return worker_options(socket, engine, block_size=BLOCK_SIZE, max_blocks=BLOCKS, **kw)


def blocks_equal(src: dict[str, Any], dst: dict[str, Any], sb: list[int], db: list[int],
                 planes_first: bool = True) -> None:
    for name, value in src.items():
        s, d = value.view(np.uint16), dst[name].view(np.uint16)
        if planes_first:
            assert (s[:, sb] == d[:, db]).all(), name
        else:
            assert (s[sb] == d[db]).all(), name


@pytest.mark.parametrize("planes_first", [True, False], ids=["planes_first", "blocks_first"])
def test_stage_pull_load_every_byte(daemon_sockets: tuple[str, str], planes_first: bool) -> None:
    a, b = daemon_sockets
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
        decode.load([Load("dec-1", prefill.node, "P", 3, "req-1", 0, tuple(db))])
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


def test_checksum_passes_and_a_corrupted_byte_is_a_load_error(
        daemon_sockets: tuple[str, str]) -> None:
    """With checksums: a clean load passes; a byte flipped on the receiving
    side after it landed (the test hook) makes that load's blocks load
    errors, naming the layer, and the engine's tensor is not written from
    that layer on."""
    a, b = daemon_sockets
    src, dst = caches(2), caches(None)
    prefill = Worker(options(a, "P", send=True, receive=False, checksum=True))
    decode = Worker(options(b, "D", send=False, receive=True, checksum=True))
    try:
        prefill.register(src)
        decode.register(dst)
        sb, db = [1, 2, 3, 4], [8, 9, 10, 20]
        for name in src:
            prefill.stage_layer(name, [Save("r", tuple(sb))])
        prefill.hold([Send("r", 1, tuple(sb)), Send("r2", 2, tuple(sb))])
        decode.load([Load("d1", prefill.node, "P", 1, "r", 0, tuple(db))])
        wait_finished(decode, received={"d1"})
        assert decode.load_errors() == set()
        blocks_equal(src, dst, sb, db)

        hit: list[int] = []

        def corrupt(pool: Any, layout: Any, layer: int, blocks: Any) -> None:
            if layer == 2:
                off = layer * layout.layer_stride + int(blocks[1]) * layout.block_stride + 77
                pool[off] ^= 0x40
                hit.append(layer)

        decode.on_landed = corrupt
        db2 = [30, 31, 32, 33]
        decode.load([Load("d2", prefill.node, "P", 2, "r2", 0, tuple(db2))])
        wait_finished(decode, received={"d2"})
        assert hit == [2]
        assert decode.load_errors() == set(db2)
        names = list(dst)
        assert (dst[names[1]][:, db2].view(np.uint16) ==
                src[names[1]][:, sb].view(np.uint16)).all()
        assert (dst[names[2]][:, db2] == 0).all()  # the bad layer never reached the engine
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_nobody_pulls_is_released_after_its_lease(
        daemon_sockets: tuple[str, str]) -> None:
    a, _ = daemon_sockets
    prefill = Worker(options(a, "P", send=True, receive=False, lease_s=1.0))
    try:
        prefill.register(caches(3))
        prefill.hold([Send("lonely", 4, (1, 2))])
        wait_finished(prefill, sent={"lonely"})
    finally:
        prefill.close()


@pytest.mark.parametrize("gone", ["daemon_killed", "bridge_closed"])
def test_with_its_daemon_gone_a_worker_fails_loads_and_releases_holds(
        tmp_path: Path, gone: str) -> None:
    """The node's daemon dies under running workers (their clients' calls
    fail), or a worker's bridge has ended (its tasks cannot start): the
    next step's holds are released (vLLM frees their blocks) and its loads
    end as load errors with their slots back, never an exception out of
    vLLM's step."""
    with daemon_pair(tmp_path) as (a, b):
        prefill = Worker(options(a.socket, "P", send=True, receive=False))
        decode = Worker(options(b.socket, "D", send=False, receive=True))
        try:
            prefill.register(caches(3))
            decode.register(caches(None))
            for d, w in ((a, prefill), (b, decode)):
                if gone == "daemon_killed":
                    d.proc.kill()
                    d.proc.wait(10)
                else:
                    w.bridge.close()
            prefill.hold([Send("orphan", 4, (1, 2)), Send("widow", 6, (5,))])
            decode.load([Load("stranded", "node-a", "P", 5, "r", 0, (3, 4)),
                         Load("marooned", "node-a", "P", 7, "r", 0, (6,))])
            wait_finished(prefill, sent={"orphan", "widow"})
            wait_finished(decode, received={"stranded", "marooned"})
            assert decode.load_errors() == {3, 4, 6}
            assert len(decode._slots) == len(decode._msg_slots) == 0  # every slot back
        finally:
            decode.close()
            prefill.close()


def test_a_pull_that_does_not_match_its_key_is_refused(daemon_sockets: tuple[str, str]) -> None:
    """A pull naming another request than the key holds (a late pull for a
    key since reused) pushes nothing; the held request is released, and
    the decode's load fails by its deadline, not later."""
    a, b = daemon_sockets
    src, dst = caches(4), caches(None)
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True, load_timeout_s=3.0))
    try:
        prefill.register(src)
        decode.register(dst)
        prefill.hold([Send("now", 5, (1, 2))])
        decode.load([Load("late", prefill.node, "P", 5, "before", 0, (3, 4))])
        wait_finished(prefill, sent={"now"})
        wait_finished(decode, received={"late"})
        assert decode.load_errors() == {3, 4}
        assert (dst[next(iter(dst))][:, [3, 4]] == 0).all()
    finally:
        decode.close()
        prefill.close()


MEMBERS = {"membership": "embedded", "cluster_token": "vllm-cluster-token"}


@contextmanager
def a_load_from_a_stuck_prefill(tmp_path: Path) -> Iterator[tuple[Any, Any, int, Worker,
                                                                   Worker]]:
    """Members node-a (prefill) and node-b (decode), alive to each other; the
    decode loads request "d" from a prefill that never learns its key (as if
    stuck), one second ago. Yields (a, b, a's control port, decode, prefill);
    on the way out the workers close and the daemons stop (a test that
    starts node-a again stops its own)."""
    pa, pb = free_port(), free_port()
    b = start_daemon(tmp_path, "node-b", control_port=pb, **MEMBERS)
    a = start_daemon(tmp_path, "node-a", control_port=pa, seeds=[f"{LOOPBACK}:{pb}"], **MEMBERS)
    decode = Worker(options(b.socket, "D", send=False, receive=True, load_timeout_s=600.0))
    prefill = Worker(options(a.socket, "P", send=True, receive=False))
    try:
        deadline = time.monotonic() + DEADLINE_S
        while {p["name"]: p["state"] for p in b.status()["peers"]} != {
                "node-a": "alive", "node-b": "alive"}:
            assert time.monotonic() < deadline, b.status()["peers"]
            time.sleep(0.1)
        prefill.register(caches(5))
        decode.register(caches(None))
        decode.load([Load("d", "node-a", "P", 6, "r", 0, (1, 2, 3))])
        time.sleep(1.0)
        yield a, b, pa, decode, prefill
    finally:
        decode.close()
        prefill.close()
        a.stop()
        b.stop()


def test_a_dead_prefill_is_a_load_error_not_a_hang(tmp_path: Path) -> None:
    """With membership: the decode's pull lands, then the prefill node's
    daemon is SIGKILLed before it pushes; the load ends as load errors
    (membership rules the node dead), its slots are released (a new load
    of the same request id can start), nothing is left in flight."""
    with a_load_from_a_stuck_prefill(tmp_path) as (a, b, _, decode, _prefill):
        a.proc.kill()
        a.proc.wait(10)
        wait_finished(decode, received={"d"})  # within DEADLINE_S, far below 600 s
        assert decode.load_errors() == {1, 2, 3}
        assert b.status()["transfers_in_flight"] == 0
        assert "d#0" not in decode._slots  # the request number went back


def test_mla_single_plane(daemon_sockets: tuple[str, str]) -> None:
    """MLA's one latent plane per layer (``(blocks, block_size, width)``)
    moves as whole blocks too."""
    a, b = daemon_sockets
    rng = np.random.default_rng(9)
    src = {f"l{i}": rng.integers(0, 1 << 16, (BLOCKS, BLOCK_SIZE, 72), dtype=np.uint16)
           for i in range(LAYERS)}
    dst = {f"l{i}": np.zeros((BLOCKS, BLOCK_SIZE, 72), np.uint16) for i in range(LAYERS)}
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True))
    try:
        prefill.register(src)
        decode.register(dst)
        assert prefill.layout is not None and prefill.layout.planes == 1
        sb, db = [0, 1, 2, 63], [5, 6, 7, 8]
        for name in src:
            prefill.stage_layer(name, [Save("m", tuple(sb))])
        prefill.hold([Send("m", 1, tuple(sb))])
        decode.load([Load("dm", prefill.node, "P", 1, "m", 0, tuple(db))])
        wait_finished(decode, received={"dm"})
        assert decode.load_errors() == set()
        for name, value in src.items():
            assert (dst[name][db] == value[sb]).all(), name
    finally:
        decode.close()
        prefill.close()


def test_shared_memory_needs_torch_tensors(daemon_sockets: tuple[str, str]) -> None:
    from p2pxfer.errors import InvalidArgument

    prefill = Worker(options(daemon_sockets[0], "P", send=True, receive=False, memory="shared"))
    try:
        with pytest.raises(InvalidArgument, match="torch"):
            prefill.register(caches(1))
    finally:
        prefill.close()


def head_caches(seed: int | None, heads: int, layout: str) -> dict[str, Any]:
    """Per-layer ``(2, blocks, block_size, heads, head)`` (NHD) or
    ``(2, blocks, heads, block_size, head)`` (HND) uint16 tensors."""
    shape = (2, BLOCKS, BLOCK_SIZE, heads, HEAD) if layout == "NHD" else \
        (2, BLOCKS, heads, BLOCK_SIZE, HEAD)
    rng = np.random.default_rng(seed)
    return {f"l{i}": (rng.integers(0, 1 << 16, shape, dtype=np.uint16) if seed is not None
                      else np.zeros(shape, np.uint16)) for i in range(LAYERS)}


def heads_of(t: Any, blocks: list[int], lo: int, hi: int, layout: str) -> Any:
    """Heads ``lo..hi-1`` of ``blocks`` of a layer tensor."""
    return t[:, blocks, :, lo:hi] if layout == "NHD" else t[:, blocks, lo:hi]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_heterogeneous_tp_one_prefill_rank_to_two_decode_ranks(daemon_sockets: tuple[str, str],
                                                                layout: str) -> None:
    """TP 1 -> 2: the prefill stages each block as two head slices; decode
    rank r pulls slice r into its (half as wide) blocks. The prefill
    releases the request once both ranks pulled."""
    a, b = daemon_sockets
    src = head_caches(11, 4, layout)
    dst = [head_caches(None, 2, layout) for _ in range(2)]
    prefill = Worker(options(a, "P", send=True, receive=False, tp_size=1, peer_tp_size=2,
                             head_layout=layout))
    decode = [Worker(options(b, "D", rank=r, send=False, receive=True, tp_size=2,
                             peer_tp_size=1, head_layout=layout)) for r in range(2)]
    try:
        prefill.register(src)
        for w, caches_r in zip(decode, dst, strict=True):
            w.register(caches_r)
        sb, db = [3, 4, 5, 40], [7, 1, 2, 9]
        for name in src:
            prefill.stage_layer(name, [Save("r", tuple(sb))])
        pulled_by_each(prefill, decode, 2, sb, db)
        for r in range(2):
            for name, value in src.items():
                assert (dst[r][name][:, db] ==
                        heads_of(value, sb, 2 * r, 2 * r + 2, layout)).all(), (r, name)
    finally:
        for w in decode:
            w.close()
        prefill.close()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_heterogeneous_tp_two_prefill_ranks_to_one_decode_rank(daemon_sockets: tuple[str, str],
                                                                layout: str) -> None:
    """TP 2 -> 1: the decode pulls from both prefill ranks, each pushing its
    whole (half as wide) blocks into one head slice of the decode's staging
    blocks; the decode puts the halves side by side, with checksums."""
    a, b = daemon_sockets
    src = [head_caches(20 + q, 2, layout) for q in range(2)]
    dst = head_caches(None, 4, layout)
    prefill = [Worker(options(a, "P", rank=q, send=True, receive=False, tp_size=2,
                              peer_tp_size=1, head_layout=layout, checksum=True))
               for q in range(2)]
    decode = Worker(options(b, "D", send=False, receive=True, tp_size=1, peer_tp_size=2,
                            head_layout=layout, checksum=True))
    try:
        for w, caches_q in zip(prefill, src, strict=True):
            w.register(caches_q)
        decode.register(dst)
        sb, db = [8, 9, 10], [0, 33, 34]
        for w, caches_q in zip(prefill, src, strict=True):
            for name in caches_q:
                w.stage_layer(name, [Save("r", tuple(sb))])
            w.hold([Send("r", 3, tuple(sb))])
        decode.load([Load("d", prefill[0].node, "P", 3, "r", 0, tuple(db))])
        wait_finished(decode, received={"d"})
        assert decode.load_errors() == set()
        for w in prefill:
            wait_finished(w, sent={"r"})
        for q in range(2):
            for name, value in src[q].items():
                assert (heads_of(dst[name], db, 2 * q, 2 * q + 2, layout) ==
                        value[:, sb]).all(), (q, name)
    finally:
        decode.close()
        for w in prefill:
            w.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_heterogeneous_tp_mla_is_replicated(daemon_sockets: tuple[str, str], prefill_tp: int,
                                            decode_tp: int) -> None:
    """MLA's latent is whole on every rank: each decode rank pulls whole
    blocks from one prefill rank (no head slices), and releases the other
    replicas' holds at once (their lease here is longer than the test)."""
    a, b = daemon_sockets
    rng = np.random.default_rng(31)
    latent = {f"l{i}": rng.integers(0, 1 << 16, (BLOCKS, BLOCK_SIZE, 40), dtype=np.uint16)
              for i in range(LAYERS)}
    prefill = [Worker(options(a, "P", rank=q, send=True, receive=False, tp_size=prefill_tp,
                              peer_tp_size=decode_tp, lease_s=600.0))
               for q in range(prefill_tp)]
    decode = [Worker(options(b, "D", rank=r, send=False, receive=True, tp_size=decode_tp,
                             peer_tp_size=prefill_tp)) for r in range(decode_tp)]
    dst = [{n: np.zeros_like(v) for n, v in latent.items()} for _ in range(decode_tp)]
    try:
        sb, db = [1, 2, 3], [4, 5, 6]
        for w in prefill:
            w.register({n: v.copy() for n, v in latent.items()})  # replicated on each rank
            for name in latent:
                w.stage_layer(name, [Save("r", tuple(sb))])
            w.hold([Send("r", 1, tuple(sb))])
        for w, d in zip(decode, dst, strict=True):
            w.register(d)
            w.load([Load(f"d{w.opts.rank}", prefill[0].node, "P", 1, "r", 0, tuple(db))])
        for w in decode:
            wait_finished(w, received={f"d{w.opts.rank}"})
            assert w.load_errors() == set()
        for w in prefill:  # the replica nobody loads from is released at once too
            wait_finished(w, sent={"r"})
        for d in dst:
            for name, value in latent.items():
                assert (d[name][db] == value[sb]).all(), name
    finally:
        for w in decode + prefill:
            w.close()


def test_importing_p2pxfer_and_the_worker_side_needs_no_vllm() -> None:
    """``import p2pxfer`` (and the connector's vLLM-free halves) load
    neither vLLM nor torch; only ``P2PXferConnector`` does, when asked for."""
    import subprocess
    import sys

    code = ("import sys, p2pxfer, p2pxfer.integrations.vllm, "
            "p2pxfer.integrations.vllm._worker, p2pxfer.integrations.vllm._scheduler\n"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_layers_save_kv_layer_missed_are_staged_at_the_end_of_the_step(
        daemon_sockets: tuple[str, str]) -> None:
    a, b = daemon_sockets
    src, dst = caches(12), caches(None)
    prefill = Worker(options(a, "P", send=True, receive=False))
    decode = Worker(options(b, "D", send=False, receive=True))
    try:
        prefill.register(src)
        decode.register(dst)
        sb, db = [10, 11], [20, 21]
        saves = [Save("r", tuple(sb))]
        prefill.stage_layer(next(iter(src)), saves)  # only the first layer's hook ran
        prefill.end_step(saves)
        prefill.hold([Send("r", 1, tuple(sb))])
        decode.load([Load("d", prefill.node, "P", 1, "r", 0, tuple(db))])
        wait_finished(decode, received={"d"})
        blocks_equal(src, dst, sb, db)
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_out_of_keys_holds_nothing() -> None:
    """With every key held, a finished prefill is not held (its blocks go at
    once, no kv_transfer_params) instead of failing vLLM's scheduler."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-a", "P", BLOCK_SIZE, 1, send=True, receive=False)

    def req(rid: str) -> Any:
        return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_decode": True})

    held, params = side.finished(req("one"), [1, 2], True)
    assert held and params is not None and params["remote_key"] == 1
    assert side.finished(req("two"), [3, 4], True) == (False, None)
    assert side.finished(req("aborted"), [5], False) == (False, None)
    side.sent({"one"})
    held, params = side.finished(req("three"), [6], True)
    assert held and params is not None and params["remote_key"] == 1


@pytest.mark.netns
def test_a_prefill_killed_mid_push_is_a_load_error_not_a_hang(tmp_path: Path) -> None:
    """Two hosts (namespaces), the prefill's link narrowed to 100 Mbit/s so
    that its 32 MiB push takes about 3 s (the kill below has that long to
    come on a starved machine); with membership. The
    prefill's daemon is SIGKILLed the moment the push's first bytes are in
    the decode's pool: the rest never comes. The load ends as load errors
    for all its blocks within the detection bound (not its 600 s deadline),
    its slots and the decode's request number go back, nothing stays in
    flight, and the layer that never came is not in the decode's tensors."""
    import os
    import signal
    import threading

    from netns import slow_link, two_hosts
    from p2pxfer.testing import spawn_daemon

    layers, heads, head = 16, 4, 128  # 16 KiB per block and plane: 2 MiB a layer
    shape = (2, BLOCKS, BLOCK_SIZE, heads, head)
    rng = np.random.default_rng(17)
    src = {f"l{i}": rng.integers(1, 1 << 16, shape, dtype=np.uint16) for i in range(layers)}
    dst = {f"l{i}": np.zeros(shape, np.uint16) for i in range(layers)}
    with two_hosts(rails=1) as (ha, hb):
        def start(host: Any, name: str, seed_host: Any | None) -> Any:
            addr = host.addresses[0]
            keys = {"node": name, "socket": str(tmp_path / f"{name}.sock"),
                    "control": f"{addr}:7720", "provider": "tcp;ofi_rxm",
                    "fabric_node": addr, "log_level": "INFO", **MEMBERS}
            if seed_host is not None:
                keys["seeds"] = [f"{seed_host.addresses[0]}:7720"]
            return spawn_daemon(tmp_path, keys, host.exec_argv)

        b = start(hb, "node-b", None)
        a = start(ha, "node-a", hb)
        decode = prefill = None
        killed = threading.Event()
        try:
            decode = Worker(options(b.socket, "D", send=False, receive=True,
                                    load_timeout_s=600.0))
            prefill = Worker(options(a.socket, "P", send=True, receive=False))
            deadline = time.monotonic() + DEADLINE_S
            while {p["name"]: p["state"] for p in b.status()["peers"]} != {
                    "node-a": "alive", "node-b": "alive"}:
                assert time.monotonic() < deadline, b.status()["peers"]
                time.sleep(0.1)
            prefill.register(src)
            decode.register(dst)
            assert decode.pool is not None
            first_piece = decode.pool.array[:1024]  # layer 0, plane 0, block 0

            def kill_once_bytes_land() -> None:
                end = time.monotonic() + DEADLINE_S
                while not first_piece.any() and time.monotonic() < end:
                    time.sleep(0.0005)
                os.kill(a.proc.pid, signal.SIGKILL)  # mid-push: most of it still to send
                killed.set()

            slow_link(ha, ha.interfaces[0], 100)
            blocks = tuple(range(BLOCKS))
            for name in src:
                prefill.stage_layer(name, [Save("r", blocks)])
            prefill.hold([Send("r", 1, blocks)])
            killer = threading.Thread(target=kill_once_bytes_land, daemon=True)
            killer.start()
            t0 = time.monotonic()
            decode.load([Load("d", "node-a", "P", 1, "r", 0, blocks)])
            wait_finished(decode, received={"d"})
            assert killed.wait(DEADLINE_S)
            assert decode.load_errors() == set(blocks)
            assert time.monotonic() - t0 < 60, "ended by its deadline, not by membership"
            assert "d#0" not in decode._slots  # the request number went back
            assert b.status()["transfers_in_flight"] == 0
            assert not dst[f"l{layers - 1}"].any(), "the last layer never came, yet it is there"
        finally:
            for w in (decode, prefill):
                if w is not None:
                    w.close()
            a.stop()
            b.stop()


def test_a_replaced_prefill_is_a_load_error(tmp_path: Path) -> None:
    """With membership: the prefill node is replaced (killed and started
    again under its name) while a decode waits on a request it held; the
    new life holds nothing of it, so the load ends as load errors (dead, or
    a new incarnation), its slots released, not at the load's deadline."""
    a2 = None
    try:
        with a_load_from_a_stuck_prefill(tmp_path) as (a, b, pa, decode, prefill):
            a.proc.kill()
            a.proc.wait(10)
            prefill.close()
            a2 = start_daemon(tmp_path, "node-a", control_port=pa,
                              seeds=[b.control], **MEMBERS)
            wait_finished(decode, received={"d"})  # within DEADLINE_S, far below 600 s
            assert decode.load_errors() == {1, 2, 3}
            assert "d#0" not in decode._slots
    finally:
        if a2 is not None:
            a2.stop()


def test_a_decode_prefix_hit_skips_the_blocks_it_has() -> None:
    """The decode already holds the prompt's first 2 blocks (a local prefix
    hit): it loads only the other 5, into its new blocks, and the pull asks
    the prefill to skip its first 2."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-b", "D", BLOCK_SIZE, 8, send=False, receive=True)
    params = {"do_remote_prefill": True, "remote_node": "node-a", "remote_engine_id": "P",
              "remote_key": 3, "remote_request_id": "p1", "remote_tp_size": 1,
              "remote_block_ids": [10, 11, 12, 13, 14, 15, 16]}
    request = SimpleNamespace(request_id="d1", kv_transfer_params=params,
                              prompt_token_ids=list(range(100)))
    assert side.matched_tokens(request, 32) == (68, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([40, 41, 50, 51, 52, 53, 54],))
    side.after_alloc(request, blocks, 68)
    (load,) = side.plan(SimpleNamespace()).loads
    assert (load.skip, load.blocks, load.key, load.remote_request) == (
        2, (50, 51, 52, 53, 54), 3, "p1")
    assert params["do_remote_prefill"] is False  # once: a preempted request computes
    assert side.matched_tokens(request, 32) == (0, False)


def test_a_prefill_stages_its_cached_prefix_first_then_each_chunk() -> None:
    """A prefill with a local prefix hit (32 tokens cached) stages from its
    first block on its first step (the cached blocks are pushed too, though
    not computed again); a later chunk stages only the blocks it touched."""
    from types import SimpleNamespace

    from p2pxfer.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide("node-a", "P", BLOCK_SIZE, 8, send=True, receive=False)
    request = SimpleNamespace(request_id="p1", kv_transfer_params={"do_remote_decode": True},
                              prompt_token_ids=list(range(100)))
    side.after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],)), 0)
    first = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="p1", block_ids=([7, 8, 9, 10],),
                                            num_computed_tokens=32)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={"p1": 32})
    assert side.plan(first).saves == [Save("p1", (7, 8, 9, 10))]
    second = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["p1"], new_block_ids=[([11, 12],)],
                                              num_computed_tokens=[64]),
        num_scheduled_tokens={"p1": 36})
    assert side.plan(second).saves == [Save("p1", (11, 12))]  # tokens 64..99
    third = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["p1"], new_block_ids=[None],
                                              num_computed_tokens=[100]),
        num_scheduled_tokens={"p1": 1})
    assert side.plan(third).saves == []  # past the prompt: never sent, never staged


def test_a_lease_longer_than_a_push_may_wait_is_refused_at_start() -> None:
    """``lease_s`` is the deadline of the prefill's push; a receiving daemon
    holds a slot at most ten minutes for a push, so a longer lease would fail
    every request later: it fails the connector's start instead."""
    from p2pxfer.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"lease_s must be within 0\.\.600 seconds"):
        WorkerOptions(socket="/nonexistent", engine="e", rank=0, send=True, receive=False,
                      block_size=16, max_blocks=4, lease_s=3600.0)
