"""The worker side's options and state, shared by its halves
(``_prefill.PrefillSide``, ``_push.PushSide``, ``_decode.DecodeSide``) and put together by
``_worker.Worker``. No I/O here.

Threads: vLLM's thread calls the public methods (and issues the prefill's
device copies, on vLLM's stream); the transfers run in the bridge's trio
thread (``_bridge``), which issues the decode's device copies on a stream
of its own (``_device``). The fields under ``_lock`` (finished
sets, load errors, slot tables, the loads running, the requests pushed as
computed) are the only ones both touch; everything
else is set in ``Worker.register`` before any transfer starts, and read
after.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.client import KVPool, SharedMemory
from p2pxfer.errors import InvalidArgument
from p2pxfer.integrations._bridge import Bridge
from p2pxfer.integrations._slots import SlotTable
from p2pxfer.integrations._tensors import HeadSlices, LayerTensor
from p2pxfer.kv_plan import MAX_REQUEST, KVLayout

from ._device import DeviceSide
from ._plan import pull_slot_bytes, region_names, split

__all__ = ["MEMORY_MODES", "SUM_BYTES", "WorkerOptions", "WorkerState"]

SUM_BYTES = 8  # one little-endian uint64 (a CRC-32) per layer
MEMORY_MODES = ("auto", "staging", "shared")
#: a push's longest deadline, seconds (the daemon's ``MAX_DEADLINE_MS``):
#: ``lease_s`` is the deadline of the prefill's push
MAX_LEASE_S = 600.0


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
    #: pushed as computed: how long a prefill request aborted before its
    #: decode pulled still takes the pull, to tell that decode (whose pull
    #: is retried at least every 0.25 s)
    abort_grace_s: float = 2.0
    arrangement: str | None = None
    #: "auto": zero copy where the engine allocated its host KV cache in the
    #: worker's allocation context (the pool is laid over it), else staging;
    #: "staging": the pool mirrors the engine's tensors (a copy per layer per
    #: request on each side); "shared": zero copy always (placed, or the
    #: engine's torch tensors are moved into the pool)
    memory: str = "auto"
    tp_size: int = 1  # this engine's tensor parallel size
    #: the other side's (decode's for a prefill, prefill's for a decode);
    #: None: the same as ours
    peer_tp_size: int | None = None
    #: where the heads sit in a block, NHD or HND; None: from the tensors'
    #: strides where they say (vLLM's [blocks, heads, tokens, K|V] views), else NHD
    head_layout: str | None = None
    #: one latent plane whole on every rank (MLA); None: guessed from the
    #: tensors' shape (one plane), which packed K|V blocks share: vLLM's
    #: connector says it from the KV cache spec
    replicated: bool | None = None
    #: vLLM's own per-layer views are ``[blocks, heads, tokens, K|V]``: a
    #: 4-D tensor of this many heads per rank (the KV cache spec's) is one
    #: plane (arrangement ``single``), however many heads (two are not K and
    #: V planes); fewer heads than head slices means the larger TP size
    #: holds replicas (whole blocks move, as MLA's)
    view_heads: int | None = None
    #: the blocks the engine schedules (vLLM's ``KVCacheConfig.num_blocks``):
    #: tensors with a multiple of it hold kernel blocks, that many to a block
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.abort_grace_s <= MAX_LEASE_S:
            raise InvalidArgument(f"abort_grace_s must be within 0..{MAX_LEASE_S:g} seconds, "
                                  f"got {self.abort_grace_s}")
        if not 0 < self.lease_s <= MAX_LEASE_S:
            raise InvalidArgument(f"lease_s must be within 0..{MAX_LEASE_S:g} seconds (a "
                                  f"push's longest deadline), got {self.lease_s}")

    @property
    def peer_tp(self) -> int:
        return self.tp_size if self.peer_tp_size is None else self.peer_tp_size


class WorkerState:
    """Everything the worker's halves share (see the module docstring)."""

    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        #: pulls a held request serves (a prefill whose decode has more ranks)
        self.fanout = split(opts.tp_size, opts.peer_tp)
        #: head slices per staging block (the other side's ranks hold fewer
        #: heads); 1 for MLA's latent, the same on every rank (``register``)
        self.k = self.fanout
        self.replicated = False  # MLA: one latent plane, whole on every rank
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
        self._load_ids = itertools.count()  # each load's own slot keys
        self.layers: list[LayerTensor] = []
        self.index: dict[str, int] = {}
        self.layout: KVLayout | None = None
        self.slices: HeadSlices | None = None
        self.pool: KVPool | None = None
        self._mailbox: SharedMemory | None = None
        self._sums: SharedMemory | None = None  # decode: checksums as they land
        self._sums_out: SharedMemory | None = None  # prefill: checksums to send
        self._msgs: SharedMemory | None = None
        #: loads started and not over, by vLLM request id (to stop them; the
        #: scopes are cancelled in the bridge's thread only)
        self._running: dict[str, trio.CancelScope] = {}
        #: test hook: ``(staging array, layout, layer, blocks)`` after a layer landed
        #: and before it is checked and copied (tests corrupt a byte with it)
        self.on_landed: Callable[[npt.NDArray[np.uint8], KVLayout, int, Any], None] | None = None
        self.shared = False
        #: the CUDA device the engine's tensors are on (None: host memory)
        self.device: int | None = None
        self.gpu: DeviceSide | None = None  # its pinned pool, streams, events
