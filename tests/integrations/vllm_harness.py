"""Driving vLLM's own objects without a model (``VLLM_TARGET_DEVICE=cpu``):
a ``VllmConfig`` for a tiny local model config (no download), vLLM's
``Scheduler`` (which builds the scheduler-side connector through
``KVConnectorFactory``), a worker-side connector from the same factory,
per-layer CPU torch KV tensors, and one "engine step" that does what a
model runner does around a forward: bind the step's metadata, start
loads, save each layer (filling the request's blocks first, as attention
would), wait for saves, gather ``get_finished`` and load errors, and hand
vLLM the output.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import p2pxfer.integrations.vllm._connector as connector_module

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD = 4, 16, 2, 16
NUM_BLOCKS = 96
MAX_LEN = 1024


def tiny_model(root: Path) -> str:
    """A Llama config vLLM can read offline (no weights: nothing runs it)."""
    path = root / "tiny-llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "head_dim": HEAD}))
    return str(path)


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@dataclass
class Engine:
    """One vLLM instance's scheduler and worker connectors (one per TP rank)."""

    config: VllmConfig
    scheduler: Scheduler
    workers: list[Any]
    kvs: list[dict[str, torch.Tensor]]
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    outputs: list[Any] = field(default_factory=list)
    #: each request as vLLM first scheduled it (its blocks, computed tokens)
    new_reqs: dict[str, Any] = field(default_factory=dict)
    _partial: dict[str, Counter[str]] = field(default_factory=dict)

    @property
    def worker(self) -> Any:
        return self.workers[0]

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        return self.kvs[0]

    def _all_ranks(self, what: str, ids: set[str] | None) -> set[str]:
        """What vLLM's output aggregator does: a request is finished once
        every worker said so."""
        seen = self._partial.setdefault(what, Counter())
        seen.update(ids or ())
        done = {r for r, n in seen.items() if n == len(self.workers)}
        for r in done:
            del seen[r]
        return done

    def scheduled(self, rid: str) -> Any:
        """How vLLM first scheduled ``rid`` (stepping once more if it has
        not yet)."""
        if rid not in self.new_reqs:
            self.step()
        return self.new_reqs[rid]

    def _partial_prefill(self, rid: str) -> bool:
        req = self.scheduler.requests[rid]
        return bool(req.num_computed_tokens < req.num_prompt_tokens)

    def step(self, fill: Any = None) -> Any:
        """One engine step; ``fill(name, tensor, scheduler_output)`` writes
        what "attention" computed into a layer before it is saved."""
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.new_reqs.setdefault(new.req_id, new)
        sending: set[str] = set()
        recving: set[str] = set()
        errors: set[int] = set()
        for w, kv in zip(self.workers, self.kvs, strict=True):
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
            if out.total_num_scheduled_tokens:
                for name in layer_names():
                    w.wait_for_layer_load(name)
                    if fill is not None:
                        fill(name, kv[name], out)
                    w.save_kv_layer(name, kv[name], None)
                w.wait_for_save()
            s, r = w.get_finished(set())
            sending |= self._all_ranks("sending", s)
            recving |= self._all_ranks("recving", r)
            errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        self.finished_sending |= sending
        self.finished_recving |= recving
        self.load_errors |= errors
        req_ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            # A partial prefill samples nothing (as a model runner's).
            sampled_token_ids=[[] if self._partial_prefill(r) else [7] for r in req_ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending or None,
                                                  finished_recving=recving or None,
                                                  invalid_block_ids=errors))
        for eo in self.scheduler.update_from_output(out, mro).values():
            self.outputs.extend(eo.outputs)
        return out


def blocks(t: torch.Tensor) -> torch.Tensor:
    """A layer's KV tensor indexed by the scheduler's block first: vLLM's
    own per-layer views (``[blocks, heads, tokens, K|V]``) as they are, or,
    when their rows are kernel blocks (``r`` to a block), as ``[blocks, r,
    heads, tokens, K|V]``; the ``(2, blocks, ...)`` tensors this harness
    makes by default with the planes moved inside."""
    if t.dim() == 4:
        return t if t.shape[0] == NUM_BLOCKS else t.view(NUM_BLOCKS, -1, *t.shape[1:])
    return t.transpose(0, 1)


def vllm_kv_cache(kv_cache_config: KVCacheConfig, spec: FullAttentionSpec, layout: str,
                  context: Any, kernel_block: int | None = None) -> dict[str, torch.Tensor]:
    """The KV cache as vLLM's worker allocates it (``allocate_kv_cache``:
    one backing allocation, a view per layer), inside the connector's
    ``get_mem_pool_context`` as vLLM's worker enters it; ``layout`` a
    ``KVCacheLayout`` name (layers outermost ``L...``, or blocks ``B...``);
    ``kernel_block``: the attention kernels' block size in tokens, when
    smaller than the scheduler's (the views' rows are then kernel blocks)."""
    page, names = spec.page_size_bytes, layer_names()
    layer_stride, block_stride = (page * NUM_BLOCKS, page) if layout.startswith("L") else \
        (page, page * len(names))
    kv_cache_config.kv_cache_tensors = [KVCacheTensor(
        size=page * NUM_BLOCKS * len(names), layers=names, layer_stride=layer_stride,
        block_stride=block_stride)]
    with context if context is not None else nullcontext():
        return allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout],
                                 None if kernel_block is None else [kernel_block])


def engine(root: Path, role: str, socket: str, engine_id: str, *, tp: int = 1,
           chunk: int = MAX_LEN, async_scheduling: bool = False, vllm_alloc: str | None = None,
           kernel_block: int | None = None, **extra: Any) -> Engine:
    """An engine of ``tp`` ranks (their worker connectors made here, rank by
    rank, as vLLM's workers would make theirs); each rank holds
    ``KV_HEADS / tp`` heads. ``chunk``: tokens per step (chunked prefill).
    ``async_scheduling``: vLLM's ``AsyncScheduler`` (``step`` still runs
    each step's output before the next is scheduled). ``vllm_alloc``: the
    KV cache allocated by vLLM's own code in that ``KVCacheLayout`` (see
    :func:`vllm_kv_cache`), else a ``(2, blocks, tokens, heads, head)``
    tensor per layer."""
    kv = KVTransferConfig(kv_connector="P2PXferConnector",
                          kv_connector_module_path="p2pxfer.integrations.vllm", kv_role=role,
                          engine_id=engine_id, kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"socket": socket, **extra})
    model = tiny_model(root)
    config = VllmConfig(
        model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=MAX_LEN),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=8,
                                         max_model_len=MAX_LEN, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=kv)
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    # The CPU platform raises the step's token budget; a test asks for its own.
    config.scheduler_config.max_num_batched_tokens = chunk
    config.scheduler_config.max_num_scheduled_tokens = chunk
    config.scheduler_config.enable_chunked_prefill = True
    heads = KV_HEADS // tp
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD,
                             dtype=torch.float16)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layer_names(), spec)])
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE)
    workers, kvs = [], []
    for rank in range(tp):
        # Outside vLLM's distributed set-up the connector would be rank 0.
        with mock.patch.object(connector_module, "_rank", lambda rank=rank: rank):
            worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER,
                                                         kv_cache_config)
        if vllm_alloc is not None:
            tensors = vllm_kv_cache(kv_cache_config, spec, vllm_alloc,
                                    worker.get_mem_pool_context(), kernel_block)
        else:
            tensors = {name: torch.zeros((2, NUM_BLOCKS, BLOCK_SIZE, heads, HEAD),
                                         dtype=torch.float16) for name in layer_names()}
        worker.register_kv_caches(tensors)
        workers.append(worker)
        kvs.append(tensors)
    return Engine(config, scheduler, workers, kvs)


def request(rid: str, prompt: list[int], max_tokens: int,
            params: dict[str, Any] | None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, prompt, sp, None)
