"""The connector's worker side, without vLLM's types: the engine's per-layer
KV tensors, a staging pool shared with the node daemon (the same block ids
as the engine's), the prefill's held requests and the decode's loads.

Prefill: each computed layer's blocks are copied into the staging pool
(``stage_layer``, from vLLM's ``save_kv_layer``: only the blocks the step
touched); a finished request is held under its key until a decode's pull
lands in the mailbox, then its blocks are pushed from the staging pool into
the decode's, all layers, in layer order, by the daemon (``kv_push``).
Decode: a load writes the pull, then waits for each layer as it lands and
copies it into the engine's tensor (checking its checksum first, when
asked); a layer that does not come (the prefill died: membership says so,
or the load's deadline passed) makes the load's blocks load errors.

Threads: vLLM's thread calls the public methods; the transfers run in the
bridge's trio thread (``_bridge``). The fields under ``_lock`` (finished
sets, load errors, slot tables) are the only ones both touch; everything
else is set in ``register`` before any transfer starts, and read after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.client import KVPool, SharedMemory
from p2pxfer.errors import InvalidArgument, P2PXferError, PeerLost, TransferError, WaitTimeout
from p2pxfer.integrations._bridge import Bridge
from p2pxfer.integrations._slots import SlotTable
from p2pxfer.integrations._tensors import (
    LayerTensor,
    checksum_blocks,
    copy_blocks,
    layer_tensor,
    move_into,
    shared_layout,
    staging_layout,
)
from p2pxfer.kv_plan import MAX_REQUEST, KVLayout
from p2pxfer.log import get_logger
from p2pxfer.scatter import ScatterList

from ._plan import Load, Pull, Save, Send, decode_pull, encode_pull, pull_slot_bytes, region_names

__all__ = ["LoadCorrupted", "Worker", "WorkerOptions"]

log = get_logger("p2pxfer.vllm")

SUM_BYTES = 8  # one little-endian uint64 (a CRC-32) per layer
GONE = ("dead", "left")


class LoadCorrupted(TransferError):
    """A layer's bytes landed but their checksum is not the sender's."""


@dataclass(frozen=True)
class WorkerOptions:
    socket: str
    engine: str
    rank: int
    send: bool  # prefill (or both)
    receive: bool  # decode (or both)
    block_size: int  # tokens per block
    max_blocks: int  # blocks of the longest request
    max_held: int = 256  # prefill requests held for a pull at once
    max_loads: int = 256  # decode loads in flight at once
    checksum: bool = False
    lease_s: float = 120.0
    load_timeout_s: float = 120.0
    poll_s: float = 0.5  # how often a waiting load asks membership about its prefill
    arrangement: str | None = None
    #: "staging": the pool mirrors the engine's tensors (a copy per layer per
    #: request on each side); "shared": the engine's torch tensors are moved
    #: into the pool (zero copy)
    memory: str = "staging"


class Worker:
    """See the module docstring."""

    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.bridge = Bridge(opts.socket, f"p2pxfer-vllm-r{opts.rank}")
        self.node = self.bridge.client.node
        self.pool_name, self.pull_name, self.sums_name = region_names(opts.engine, opts.rank)
        self.slot_bytes = pull_slot_bytes(opts.max_blocks)
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._errors: set[int] = set()
        self._slots = SlotTable(0, MAX_REQUEST, "decode request")
        self._msg_slots = SlotTable(0, opts.max_loads - 1, "pull message")
        self.layers: list[LayerTensor] = []
        self.index: dict[str, int] = {}
        self.layout: KVLayout | None = None
        self.pool: KVPool | None = None
        self._mailbox: SharedMemory | None = None
        self._sums: SharedMemory | None = None  # decode: checksums as they land
        self._sums_out: SharedMemory | None = None  # prefill: checksums to send
        self._msgs: SharedMemory | None = None
        #: test hook: ``(staging array, layout, layer, blocks)`` after a layer landed
        #: and before it is checked and copied (tests corrupt a byte with it)
        self.on_landed: Callable[[npt.NDArray[np.uint8], KVLayout, int, Any], None] | None = None
        self._staged_layers: set[int] = set()
        self.shared = False

    # -- set-up ------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """The engine's per-layer KV tensors, in layer order; opens the staging
        pool (and the mailbox or checksum region) with the daemon."""
        if not kv_caches:
            raise InvalidArgument("register_kv_caches got no KV tensors")
        self.layers = [layer_tensor(t, self.opts.arrangement) for t in kv_caches.values()]
        self.index = {name: i for i, name in enumerate(kv_caches)}
        first = self.layers[0].layout
        for name, lt in zip(kv_caches, self.layers, strict=True):
            lay = lt.layout
            if (lay.num_blocks, lay.block_bytes, lay.planes) != \
                    (first.num_blocks, first.block_bytes, first.planes):
                raise InvalidArgument(f"KV layer {name!r} is shaped unlike the first ({lay} vs "
                                      f"{first}): one staging pool needs one block shape")
        if self.opts.memory not in ("staging", "shared"):
            raise InvalidArgument(f"kv memory must be 'staging' or 'shared', got "
                                  f"{self.opts.memory!r}")
        self.shared = self.opts.memory == "shared"
        if self.shared and not all(type(lt.owner).__module__.startswith("torch")
                                   for lt in self.layers):
            raise InvalidArgument("kv_memory 'shared' moves torch tensors into the daemon's "
                                  "memory; these KV tensors are not torch tensors: use staging")
        self.layout = shared_layout(self.layers) if self.shared else \
            staging_layout(self.layers[0], len(self.layers))
        self.bridge.call(self._open)
        if self.shared:
            assert self.pool is not None
            self.layers = [move_into(lt, self.pool.mem.array, i * self.layout.layer_stride)
                           for i, lt in enumerate(self.layers)]
        log.info("vllm.registered", engine=self.opts.engine, rank=self.opts.rank,
                 layers=len(self.layers), blocks=first.num_blocks, block_bytes=first.block_bytes,
                 planes=first.planes, arrangement=self.layers[0].arrangement,
                 memory=self.opts.memory, pool_bytes=self.layout.nbytes, node=self.node)

    async def _open(self) -> None:
        c, o, lay = self.bridge.client, self.opts, self.layout
        assert lay is not None
        self.pool = await c.kv_pool(self.pool_name, lay, receive=o.receive)
        n_layers = lay.num_layers
        if o.send:
            self._mailbox = await c.alloc((o.max_held + 1) * self.slot_bytes, self.pull_name)
            await c.export(self.pull_name, self._mailbox)
            self._sums_out = await c.alloc((o.max_held + 1) * n_layers * SUM_BYTES,
                                           f"{self.pull_name}-sums")
        if o.receive:
            self._msgs = await c.alloc(o.max_loads * self.slot_bytes, f"{self.pool_name}-msg")
        if o.receive and o.checksum:
            # One row of layer checksums per decode request number.
            self._sums = await c.alloc((MAX_REQUEST + 1) * n_layers * SUM_BYTES, self.sums_name)
            await c.export(self.sums_name, self._sums)

    # -- prefill -----------------------------------------------------------------------

    def stage_layer(self, layer_name: str, saves: Iterable[Save]) -> int:
        """Copy this step's blocks of layer ``layer_name`` into the staging
        pool, for every request that will be pulled; the bytes copied."""
        i = self.index.get(layer_name)
        if i is None:
            raise InvalidArgument(f"save_kv_layer for {layer_name!r}, which register_kv_caches "
                                  "did not name")
        assert self.pool is not None and self.layout is not None
        self._staged_layers.add(i)
        if self.shared:
            return 0  # the engine computed the blocks in the pool itself
        n = 0
        for s in saves:  # per request, not per block: one C copy each
            n += copy_blocks(self.layers[i], self.pool.array, self.layout, i, s.blocks,
                             to_staging=True)
        return n

    def end_step(self, saves: list[Save]) -> None:
        """Every layer of a step with requests to stage must have been staged."""
        staged, self._staged_layers = self._staged_layers, set()
        if saves and len(staged) != len(self.layers):
            missing = sorted(set(range(len(self.layers))) - staged)[:8]
            raise TransferError(f"this step staged {len(staged)} of {len(self.layers)} KV "
                                f"layers (not {missing}...): save_kv_layer was not called for "
                                "every layer")

    def hold(self, sends: Iterable[Send]) -> None:
        for s in sends:
            if not 1 <= s.key <= self.opts.max_held:
                raise InvalidArgument(f"key {s.key} is outside 1..{self.opts.max_held}")
            self.bridge.spawn(self._serve, s)

    async def _serve(self, s: Send) -> None:
        """Wait for the pull of ``s`` (at most its lease), then push."""
        c, o = self.bridge.client, self.opts
        assert self._mailbox is not None and self.pool is not None and self.layout is not None
        outcome = "pushed"
        try:
            await c.wait_imm(s.key, 1, region=self.pull_name, timeout=o.lease_s)
            sb = self.slot_bytes
            pull = decode_pull(self._mailbox.array[s.key * sb:(s.key + 1) * sb])
            if pull.prefill_request != s.request:
                raise InvalidArgument(f"a pull for {pull.prefill_request!r} came under key "
                                      f"{s.key}, which holds {s.request!r}")
            src = np.asarray(s.blocks, np.int64)[pull.skip:]
            if not 0 <= pull.skip <= len(s.blocks) or len(src) != len(pull.blocks):
                raise InvalidArgument(f"a pull of {len(pull.blocks)} blocks after {pull.skip} "
                                      f"for a request of {len(s.blocks)}")
            if len(src):
                if pull.sums:
                    await self._send_sums(s.key, pull, src)
                push = await c.kv_push(pull.node, pull.pool, self.pool, src, pull.blocks,
                                       request=pull.request, deadline=o.lease_s)
                result = await push.wait()
                log.debug("vllm.pushed", request=s.request, peer=pull.node, nbytes=result.nbytes,
                          seconds=result.seconds)
        except WaitTimeout:
            outcome = "lease_expired"
            log.warning("vllm.lease_expired", request=s.request, key=s.key, lease_s=o.lease_s)
        except P2PXferError as exc:
            outcome = "failed"
            log.warning("vllm.push_failed", request=s.request, key=s.key, error=str(exc))
        finally:
            with self._lock:
                self._sent.add(s.request)
        log.debug("vllm.released", request=s.request, key=s.key, outcome=outcome)

    async def _send_sums(self, key: int, pull: Pull, src: npt.NDArray[np.int64]) -> None:
        """Each layer's checksum over the blocks about to be pushed, written
        into the decode's checksum region before the push starts."""
        assert self.pool is not None and self.layout is not None
        n = self.layout.num_layers
        sums = np.array([checksum_blocks(self.pool.array, self.layout, layer, src)
                         for layer in range(n)], "<u8")
        out = self._sums_out
        assert out is not None
        off = key * n * SUM_BYTES
        out.array[off:off + n * SUM_BYTES] = sums.view(np.uint8)
        where = ScatterList.contiguous(n * SUM_BYTES, off, pull.request * n * SUM_BYTES)
        await self.bridge.client.write(pull.node, pull.sums, where, src=out)

    # -- decode ------------------------------------------------------------------------

    def load(self, loads: Iterable[Load]) -> None:
        """Start each load (a pull, then per-layer waits) and return. A load
        of no blocks only releases the prefill's hold (its pull asks for
        nothing), and is not reported back."""
        for planned in loads:
            # Rank r of a decode pulls from rank r of the prefill (equal TP).
            job = replace(planned, rank=self.opts.rank)
            with self._lock:
                slot = self._slots.take(job.request)
                msg = self._msg_slots.take(job.request)
            self.bridge.spawn(self._load, job, slot, msg)

    async def _load(self, job: Load, slot: int, msg: int) -> None:
        c, o = self.bridge.client, self.opts
        assert self.pool is not None and self.layout is not None and self._msgs is not None
        dst = np.asarray(job.blocks, np.int64)
        try:
            _, pull_region, _ = region_names(job.engine, job.rank)
            data = encode_pull(Pull(job.remote_request, self.node, self.pool_name,
                                    self.sums_name if o.checksum else "", slot, job.skip, dst),
                               self.slot_bytes)
            off = msg * self.slot_bytes
            self._msgs.array[off:off + len(data)] = np.frombuffer(data, np.uint8)
            deadline = trio.current_time() + o.load_timeout_s
            await c.write(job.node, pull_region, ScatterList.contiguous(len(data), off,
                                                                        job.key * self.slot_bytes),
                          src=self._msgs, imm=job.key, notify=True, timeout=o.load_timeout_s)
            t0 = time.perf_counter()
            if len(dst):
                await self._receive(job, slot, dst, deadline)
            log.debug("vllm.loaded", request=job.request, peer=job.node, blocks=len(dst),
                      seconds=time.perf_counter() - t0)
        except P2PXferError as exc:
            with self._lock:
                self._errors.update(job.blocks)
            log.warning("vllm.load_failed", request=job.request, peer=job.node,
                        blocks=len(job.blocks), error=str(exc))
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.pool.forget(slot)
                except P2PXferError as exc:
                    log.debug("vllm.forget_failed", request=job.request, error=str(exc))
            with self._lock:
                self._slots.release(job.request)
                self._msg_slots.release(job.request)
                if len(dst):
                    self._received.add(job.request)

    async def _receive(self, job: Load, slot: int, dst: npt.NDArray[np.int64],
                       deadline: float) -> None:
        """Each layer as it lands (several per round trip when they landed
        together), checked and copied into the engine's tensor, in layer
        order. A wait lasts at most ``poll_s``; between waits membership is
        asked about the prefill node: dead, left or unknown is ``PeerLost``
        (the daemon fails the wait itself too, once the push has begun)."""
        assert self.pool is not None and self.layout is not None
        o = self.opts
        nxt = 0
        while nxt < self.layout.num_layers:
            left = deadline - trio.current_time()
            if left <= 0:
                raise WaitTimeout(f"layer {nxt} of {job.request!r} from {job.node} did not "
                                  f"land within {o.load_timeout_s:g} s")
            since = trio.current_time()
            try:
                async for layer in self.pool.layers(slot, first=nxt,
                                                    timeout=min(o.poll_s, left)):
                    self._landed(job, slot, layer, dst)
                    nxt = layer + 1
                    since = trio.current_time()
                return
            except WaitTimeout:
                # An answer well before the poll's end is the daemon's: the
                # push's own deadline passed.
                if trio.current_time() - since < o.poll_s / 2 < left:
                    raise
            peer = await self.bridge.client.lookup(job.node)
            state = None if peer is None else peer.get("state")
            if peer is None or state in GONE:
                raise PeerLost(f"prefill node {job.node} is {state or 'unknown'} (layer "
                               f"{nxt} of {job.request!r} never came)")

    def _landed(self, job: Load, slot: int, layer: int, dst: npt.NDArray[np.int64]) -> None:
        """A layer landed in the staging pool: check it, then copy it into
        the engine's tensor (a bad layer never reaches the engine)."""
        assert self.pool is not None and self.layout is not None
        if self.on_landed is not None:
            self.on_landed(self.pool.array, self.layout, layer, dst)
        if self.opts.checksum:
            self._check(job, slot, layer, dst)
        if not self.shared:
            copy_blocks(self.layers[layer], self.pool.array, self.layout, layer, dst,
                        to_staging=False)

    def _check(self, job: Load, slot: int, layer: int, dst: npt.NDArray[np.int64]) -> None:
        assert self.pool is not None and self.layout is not None and self._sums is not None
        n = self.layout.num_layers
        off = (slot * n + layer) * SUM_BYTES
        want = int(self._sums.array[off:off + SUM_BYTES].view("<u8")[0])
        got = checksum_blocks(self.pool.array, self.layout, layer, dst)
        if got != want:
            raise LoadCorrupted(f"layer {layer} of {job.request!r} from {job.node}: checksum "
                                f"{got:#010x} over the bytes landed, {want:#010x} sent, blocks "
                                f"{dst.tolist()[:16]}{'...' if len(dst) > 16 else ''}")

    # -- both --------------------------------------------------------------------------

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests done sending, requests done receiving) since the last call."""
        with self._lock:
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
        return sent, received

    def load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        """Stop every transfer and close the client (its pools go with it)."""
        self.bridge.close()
