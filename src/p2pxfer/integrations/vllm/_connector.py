"""``P2PXferConnector``: vLLM's ``KVConnectorBase_V1`` over the p2pxfer
daemon. One object per role, as vLLM makes them: in the scheduler process
it plans (``_scheduler.SchedulerSide``), in each worker process it moves
KV (``_worker.Worker``); the two talk only through the metadata vLLM
carries each step (``P2PXferMetadata``) and the worker outputs vLLM
gathers (``get_finished``, ``get_block_ids_with_load_errors``).

Configuration: ``kv_connector_extra_config`` keys ``socket`` (the node
daemon's socket; default ``$P2PXFER_SOCKET`` or
``/run/p2pxfer/p2pxfer.sock``), ``checksum`` (bool: a CRC-32 per layer per
request, checked on decode before a layer reaches the engine), ``lease_s``
(how long a prefill holds a finished request for its pull),
``load_timeout_s``, ``poll_s``, ``abort_grace_s`` (pushed as computed: how
long a prefill request aborted before its decode pulled still answers the
pull with the abort), ``max_held``, ``max_loads``,
``arrangement`` (``planes_first`` / ``blocks_first`` / ``single``; guessed
from the tensors' shape by default), ``kv_memory`` (``auto``, the
default: on a CPU engine vLLM allocates its KV cache in daemon-shared
memory through ``get_mem_pool_context`` and the pool is laid over it,
zero copy; where that cannot be (a GPU, tensor parallel sizes that
differ, tensors placed elsewhere), ``staging``: a pool mirroring the KV
tensors, a copy of the blocks moved on each side; ``shared``: zero copy
or an error, the tensors moved into the pool if vLLM did not allocate
them there),
``peer_tp_size`` (the other side's tensor parallel size, when it differs:
the decode's on a prefill, the prefill's on a decode), ``head_layout``
(``NHD`` or ``HND``: where the heads sit in a block, for head slices across
TP sizes; by default read from the tensors' strides, else ``NHD``). Whether
the cache is MLA's one latent plane (whole on every rank) comes from vLLM's
KV cache spec.

This module is the only one of the package that imports vLLM (and it is
loaded only when vLLM asks for the class: ``p2pxfer.integrations.vllm``
resolves ``P2PXferConnector`` lazily). State: vLLM's threads of each role
call in; the worker half says which of its fields its transfer thread
shares.
"""

from __future__ import annotations

import os
import queue
import threading
from contextlib import AbstractContextManager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from p2pxfer.client import SyncClient
from p2pxfer.errors import InvalidArgument
from p2pxfer.log import get_logger

from ._scheduler import SchedulerSide, StepPlan
from ._worker import Worker, WorkerOptions

__all__ = ["P2PXferConnector", "P2PXferMetadata"]

log = get_logger("p2pxfer.vllm")

DEFAULT_SOCKET = "/run/p2pxfer/p2pxfer.sock"


class P2PXferMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, scheduler -> workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _daemon_node(socket: str) -> str:
    """The node name of the daemon at ``socket``, asked from a thread of
    its own (vLLM may build its scheduler inside a running event loop,
    where a blocking client refuses to be made)."""
    answer: queue.Queue[str | BaseException] = queue.Queue()

    def ask() -> None:
        try:
            with SyncClient(socket) as c:
                answer.put(c.node)
        except BaseException as exc:  # handed to the caller, who raises it
            answer.put(exc)

    threading.Thread(target=ask, name="p2pxfer-node", daemon=True).start()
    got = answer.get(timeout=60)
    if isinstance(got, BaseException):
        raise got
    return got


def _spec(kv_cache_config: Any) -> Any:
    """vLLM's KV cache spec of the first group (None where there is none)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    spec = groups[0].kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return next(iter(specs.values())) if specs else spec


def _mla(spec: Any) -> bool:
    """One latent plane (MLA and its variants: no V head, or an MLA spec)."""
    return getattr(spec, "head_size_v", None) == 0 or \
        any("MLA" in c.__name__ for c in type(spec).__mro__)


def _replicated(kv_cache_config: Any) -> bool | None:
    """Whether the KV cache is one latent plane, whole on every rank (MLA),
    from vLLM's KV cache spec; None where there is none to ask."""
    spec = _spec(kv_cache_config)
    if spec is None:
        return None
    if _mla(spec):
        return True
    return False if hasattr(spec, "num_kv_heads") else None


def _view_heads(kv_cache_config: Any) -> int | None:
    """Heads per rank in vLLM's per-layer views of an attention KV cache
    (``[blocks, heads, tokens, K|V]``), from its spec."""
    spec = _spec(kv_cache_config)
    if spec is None or _mla(spec) or not hasattr(spec, "num_heads"):
        return None
    return int(spec.num_heads)


def _rank() -> int:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )
    # A worker built outside vLLM's distributed set-up (one process, no
    # tensor parallelism) is rank 0.
    return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0


class P2PXferConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Disaggregated prefill/decode over p2pxfer daemons (see the README,
    "Using p2pxfer from vLLM")."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        socket = str(extra.get("socket") or os.environ.get("P2PXFER_SOCKET") or DEFAULT_SOCKET)
        send, receive = bool(kv.is_kv_producer), bool(kv.is_kv_consumer)
        block_size = int(vllm_config.cache_config.block_size)
        max_len = int(vllm_config.model_config.max_model_len)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        max_held = int(extra.get("max_held", 256))
        peer_tp = int(extra.get("peer_tp_size", tp))
        self._scheduler: SchedulerSide | None = None
        self._worker: Worker | None = None
        self._host = False  # a worker whose engine keeps its KV cache in host memory
        self._kv_config = kv_cache_config
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(_daemon_node(socket), str(kv.engine_id), block_size,
                                            max_held, send, receive, tp, peer_tp)
        elif role == KVConnectorRole.WORKER:
            self._worker = Worker(WorkerOptions(
                socket=socket, engine=str(kv.engine_id), rank=_rank(), send=send,
                receive=receive, block_size=block_size, max_blocks=-(-max_len // block_size) + 1,
                max_held=max_held, max_loads=int(extra.get("max_loads", 256)),
                checksum=bool(extra.get("checksum", False)),
                lease_s=float(extra.get("lease_s", 120.0)),
                load_timeout_s=float(extra.get("load_timeout_s", 120.0)),
                poll_s=float(extra.get("poll_s", 0.5)), arrangement=extra.get("arrangement"),
                abort_grace_s=float(extra.get("abort_grace_s", 2.0)),
                memory=str(extra.get("kv_memory", "auto")), tp_size=tp, peer_tp_size=peer_tp,
                head_layout=extra.get("head_layout"), replicated=_replicated(kv_cache_config),
                view_heads=_view_heads(kv_cache_config),
                num_blocks=getattr(kv_cache_config, "num_blocks", None) or None))
            self._host = str(getattr(vllm_config.device_config, "device_type", "")) == "cpu"
        else:
            raise InvalidArgument(f"unknown connector role {role!r}")
        log.info("vllm.connector", role=str(role), socket=socket, producer=send, consumer=receive,
                 engine=kv.engine_id)

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise InvalidArgument("a scheduler-side connector has no worker half")
        return self._worker

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise InvalidArgument("a worker-side connector has no scheduler half")
        return self._scheduler

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2PXferMetadata)
        return meta.plan

    # -- worker side -------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """Where vLLM allocates the KV cache: on a host-memory engine, in
        memory the daemon shares (``kv_memory`` ``auto`` or ``shared``), so
        the tensors are the pool. A GPU engine keeps vLLM's own pool."""
        if self._worker is None or not self._host:
            return None
        sizes = {int(t.size) for t in getattr(self._kv_config, "kv_cache_tensors", None) or ()}
        return self._worker.allocation_context(sizes)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Open this step's prefills pushed as computed, hand its finished
        prefills to the pull servers and start its loads; all run in the
        transfer thread, so this returns at once."""
        plan = self._plan()
        self.worker.withdraw(plan.withdraws)
        self.worker.open(plan.opens)
        self.worker.hold(plan.sends)
        self.worker.cancel(plan.cancels)
        self.worker.load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous (the requests they
        are for run only after ``get_finished`` reported them), so no
        layer of this step's forward depends on one."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        plan = self._plan()
        if plan.saves:
            self.worker.stage_layer(layer_name, plan.saves)

    def wait_for_save(self) -> None:
        self.worker.end_step(self._plan().saves)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self.worker.finished()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> P2PXferMetadata:
        return P2PXferMetadata(self.scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.sent(set(connector_output.finished_sending or ()))
        self.scheduler.received(set(connector_output.finished_recving or ()))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus
        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                       RequestStatus.FINISHED_STOPPED)
        return self.scheduler.finished(request, block_ids, completed)
