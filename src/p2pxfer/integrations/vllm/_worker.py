"""The connector's worker side, without vLLM's types: the engine's per-layer
KV tensors, a pool shared with the node daemon (a staging mirror of the
tensors with the same block ids, or the tensors themselves, moved into
it), the prefill's held requests (``_prefill``) and the decode's loads
(``_decode``).

Prefill: each computed layer's blocks are copied into the staging pool
(``stage_layer``, from vLLM's ``save_kv_layer``: only the blocks the step
touched; nothing to copy when the tensors live in the pool); a finished
request is held under its key until a decode's pull lands in the mailbox,
then its blocks are pushed into the decode's pool, all layers, in layer
order, by the daemon (``kv_push``); a request pushed as computed is pushed
layer by layer as its last step computes them (``_push``). Decode: see
``_decode``.

Heterogeneous tensor parallelism (``tp_size`` != ``peer_tp_size``, one
dividing the other): the side whose ranks hold ``k`` times the heads keeps
``k`` head slices of each block as ``k`` staging blocks (``b*k + j``), so
every push moves whole staging blocks of equal size on both sides. HND
slices are one piece per block plane, NHD slices one per token; the
shared (zero-copy) memory mode needs equal sizes. Threads: see ``_state``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from contextlib import nullcontext
from typing import Any

from p2pxfer.client import SharedMemory
from p2pxfer.errors import ConnectionLost, InvalidArgument
from p2pxfer.integrations._placement import Placement
from p2pxfer.integrations._tensors import (
    HeadSlices,
    copy_blocks,
    head_layout_of,
    kernel_regrouped,
    layer_tensor,
    move_into,
    placed_layout,
    shared_layout,
    staging_layout,
)
from p2pxfer.kv_plan import MAX_REQUEST, KVLayout
from p2pxfer.log import get_logger

from ._decode import DecodeSide, LoadCorrupted
from ._device import DeviceSide
from ._plan import Save, Send
from ._push import PushSide
from ._state import MEMORY_MODES, SUM_BYTES, WorkerOptions

__all__ = ["LoadCorrupted", "Worker", "WorkerOptions"]

log = get_logger("p2pxfer.vllm")


class Worker(PushSide, DecodeSide):
    """See the module docstring."""

    def __init__(self, opts: WorkerOptions) -> None:
        super().__init__(opts)
        self._staged_layers: set[int] = set()
        #: the engine's KV allocation, if it ran in ``allocation_context``
        self.placement: Placement | None = None
        self.memory = opts.memory  # then where the pool went: placed, moved or staging

    # -- set-up ------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """The engine's per-layer KV tensors, in layer order; opens the pool
        (and the mailbox or checksum region) with the daemon."""
        o = self.opts
        if not kv_caches:
            raise InvalidArgument("register_kv_caches got no KV tensors")
        arrangement, heads = o.arrangement, None
        if arrangement is None and o.view_heads is not None and all(
                len(t.shape) == 4 and t.shape[1] == o.view_heads for t in kv_caches.values()):
            arrangement, heads = "single", o.view_heads
        self.layers = [layer_tensor(t, arrangement) for t in kv_caches.values()]
        kernel_blocks = 1
        if o.num_blocks is not None:  # rows may be kernel blocks, several to a block
            kernel_blocks = self.layers[0].layout.num_blocks // o.num_blocks
            self.layers = [kernel_regrouped(lt, o.num_blocks) for lt in self.layers]
        self.index = {name: i for i, name in enumerate(kv_caches)}
        first = self.layers[0].layout
        for name, lt in zip(kv_caches, self.layers, strict=True):
            lay = lt.layout
            if (lay.num_blocks, lay.block_bytes, lay.planes) != \
                    (first.num_blocks, first.block_bytes, first.planes):
                raise InvalidArgument(f"KV layer {name!r} is shaped unlike the first ({lay} vs "
                                      f"{first}): one staging pool needs one block shape")
        if o.memory not in MEMORY_MODES:
            raise InvalidArgument(f"kv_memory must be one of {MEMORY_MODES}, got {o.memory!r}")
        # One plane is MLA's latent, unless the views are an attention cache's.
        self.replicated = o.replicated if o.replicated is not None else \
            heads is None and self.layers[0].arrangement == "single"
        if not self.replicated and heads is not None and self.k > 1:
            if heads < self.k:
                self.replicated = True  # the other side's ranks hold replicas of ours
            elif heads % self.k:
                raise InvalidArgument(f"{heads} KV heads per rank do not split into {self.k} "
                                      f"head slices (TP {o.tp_size} here, {o.peer_tp} there)")
        if self.replicated:
            self.k = 1  # MLA: the latent is whole on every rank
        head_layout = o.head_layout or head_layout_of(self.layers[0]) or "NHD"
        self.slices = HeadSlices.of(first.block_bytes, self.k, head_layout, o.block_size,
                                    kernel_blocks)
        devices = {lt.device for lt in self.layers}
        if len(devices) > 1:
            raise InvalidArgument(f"the KV tensors are on different devices ({devices}): one "
                                  "worker moves one device's (or host memory's)")
        self.device = devices.pop()
        memory, layout, placed = self._memory()
        self.layout, self.shared, self.memory = layout, memory != "staging", memory
        self.bridge.call(self._open, placed)
        if self.device is not None:
            assert self.pool is not None
            gpu = DeviceSide(self.device, self.pool.array, o.receive)
            if not self.bridge.on_close(gpu.close):
                gpu.close()  # the bridge is ending: nobody else would unpin
                raise ConnectionLost(f"the client to the p2pxfer daemon at {o.socket} "
                                     "closed while the KV caches were registered")
            self.gpu = gpu
        if memory == "moved":
            assert self.pool is not None and isinstance(self.pool.mem, SharedMemory)
            self.layers = [move_into(lt, self.pool.mem.array, i * layout.layer_stride)
                           for i, lt in enumerate(self.layers)]
        log.info("vllm.registered", engine=o.engine, rank=o.rank, layers=len(self.layers),
                 blocks=first.num_blocks, block_bytes=first.block_bytes, planes=first.planes,
                 arrangement=self.layers[0].arrangement, memory=self.memory, head_slices=self.k,
                 head_layout=head_layout, replicated=self.replicated,
                 pool_bytes=layout.nbytes, node=self.node,
                 device="host" if self.device is None else f"cuda:{self.device}")

    def _memory(self) -> tuple[str, KVLayout, SharedMemory | None]:
        """Where the pool lives, and its layout: ``"placed"`` (the
        engine allocated its tensors in shared memory through
        :meth:`allocation_context`: the pool is laid over them),
        ``"moved"`` (``kv_memory`` ``shared`` without that: the tensors are
        moved into the pool) or ``"staging"`` (a mirror, copied per layer):
        ``auto`` is placed or else staging, ``shared`` placed or else
        moved. The third item is the pool's shared memory, if placed."""
        o = self.opts
        why = self._no_zero_copy()
        if o.memory == "shared" and why is not None:
            raise InvalidArgument(f"kv_memory 'shared': {why}: use staging")
        if why is None and self.placement is not None:
            placed = placed_layout(self.layers, [m for m, _ in self.placement.placed])
            if not isinstance(placed, str):
                return "placed", *placed
            why = placed
        if o.memory == "shared":  # the tensors move into a pool of their own
            return "moved", shared_layout(self.layers), None
        if o.memory == "auto":
            log.info("vllm.staging", engine=o.engine, rank=o.rank,
                     why=why or "the engine did not allocate its KV cache in the "
                     "connector's allocation context")
        return "staging", staging_layout(self.layers[0], len(self.layers), self.k), None

    def _no_zero_copy(self) -> str | None:
        """Why the engine's tensors cannot be the pool (None: they can)."""
        if self.device is not None:
            return f"the KV tensors are on CUDA device {self.device}"
        if self.k > 1:
            return (f"tensor parallel sizes differ ({self.opts.tp_size} here, "
                    f"{self.opts.peer_tp} there): blocks move as head slices")
        if not all(type(lt.owner).__module__.startswith("torch") for lt in self.layers):
            return "the KV tensors are not torch tensors"
        return None

    def allocation_context(self, sizes: Collection[int] = ()) -> Placement | None:
        """The context the engine allocates its KV cache in (vLLM's
        ``get_mem_pool_context``): host allocations of ``sizes`` (the KV
        cache's backing allocations; none given: any large one) land in
        memory the daemon shares, so the tensors need no copy and no move.
        None for ``kv_memory`` ``staging``, or where blocks will move as
        head slices (staged: placing them would map the cache twice)."""
        o = self.opts
        whole = o.replicated or (o.view_heads is not None and o.view_heads < self.k)
        if o.memory == "staging" or (self.k > 1 and not whole):
            return None
        self.placement = Placement(lambda n: self.bridge.call(self._alloc_placed, n),
                                   sizes=sizes, required=o.memory == "shared")
        return self.placement

    async def _alloc_placed(self, nbytes: int) -> SharedMemory:
        return await self.bridge.client.alloc(nbytes, f"{self.pool_name}-kv")

    async def _open(self, placed: SharedMemory | None) -> None:
        c, o, lay = self.bridge.client, self.opts, self.layout
        assert lay is not None
        self.pool = await c.kv_pool(self.pool_name, lay, receive=o.receive, memory=placed)
        n_layers = lay.num_layers
        if o.send:
            slots = (o.max_held + 1) * self.fanout  # a slot per key and decode rank
            self._mailbox = await c.alloc(slots * self.slot_bytes, self.pull_name)
            await c.export(self.pull_name, self._mailbox)
            self._sums_out = await c.alloc(slots * n_layers * SUM_BYTES, f"{self.pull_name}-sums")
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
            self.computed(i, saves, None)
            return 0  # the engine computed the blocks in the pool itself
        # On a GPU: behind the kernels that wrote this layer, on vLLM's stream.
        with nullcontext(None) if self.gpu is None else self.gpu.staging() as on:
            if self.gpu is not None and on is None:
                return 0  # the bridge ended: nothing will be pushed from the pool
            n = 0
            for s in saves:  # per request, not per block: one C copy each
                n += copy_blocks(self.layers[i], self.pool.array, self.layout, i, s.blocks,
                                 to_staging=True, slices=self.slices, on=on)
            self.computed(i, saves, on)
            return n

    def end_step(self, saves: list[Save]) -> None:
        """The step's forward is over: a layer ``save_kv_layer`` was not
        called for (a layer sharing another's cache, a runner that skips
        the hook) is staged now, from the tensor the forward wrote."""
        staged, self._staged_layers = self._staged_layers, set()
        if saves and not self.shared and len(staged) != len(self.layers):
            missing = [name for name, i in self.index.items() if i not in staged]
            log.info("vllm.staged_late", layers=len(missing), first=missing[0])
            for name in missing:
                self.stage_layer(name, saves)
            self._staged_layers = set()
        if self.gpu is not None:
            # Queued, not waited for: a pull server waits before it pushes.
            self.gpu.end_step()

    def hold(self, sends: Iterable[Send]) -> None:
        """Finished prefill requests: held for their pulls, or (pushed as
        computed) released once their pushes end."""
        held = []
        for s in sends:
            if s.transfer_id:
                self.ended(s)
            else:
                held.append(s)
        super().hold(held)

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
        """Stop every transfer and close the client (its pools go with it;
        on a GPU, the copies are waited for and the pool unpinned first)."""
        self.bridge.close()
