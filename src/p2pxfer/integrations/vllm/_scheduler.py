"""The connector's scheduler side, on vLLM's request and scheduler-output
objects (read by attribute, no vLLM import): what a decode loads, what a
prefill stages each step and holds when it finishes, and the keys that
name held requests.

``kv_transfer_params`` (vLLM carries them from the prefill's answer to the
decode's request, as for NIXL):

- a prefill request asks to be pulled with ``{"do_remote_decode": true}``;
- its ``request_finished`` answers ``{"do_remote_prefill": true,
  "remote_node", "remote_engine_id", "remote_key", "remote_request_id",
  "remote_block_ids", "remote_tp_size"}`` and holds its blocks (each
  decode TP rank pulls from the prefill rank of its own number);
- a decode request with those loads the prompt's KV from there
  (``get_num_new_matched_tokens`` returns it as loaded asynchronously).

Push as computed (a proxy sends the request to both at once): the prefill
request has ``{"do_remote_decode": true, "transfer_id": id}``, the decode
request ``{"do_remote_prefill": true, "remote_node", "remote_engine_id",
"transfer_id": id, "remote_tp_size"}``. The prefill takes its key when the
request is first scheduled (``Open``), marks the step that computes its
last prompt tokens (``Save.last``), and its ``request_finished`` holds the
blocks until the workers' pushes end (nothing to answer: the decode has its
parameters already). The decode's pull names the id.

State: vLLM's scheduler thread only (vLLM calls all of this from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pxfer.errors import InvalidArgument, LimitExceeded
from p2pxfer.integrations._slots import SlotTable
from p2pxfer.log import get_logger

from ._plan import Load, Open, Save, Send, Withdraw, check_transfer_id

__all__ = ["SchedulerSide", "StepPlan"]

log = get_logger("p2pxfer.vllm")

REMOTE_KEYS = ("remote_node", "remote_engine_id", "remote_key", "remote_request_id",
               "remote_block_ids")
PUSH_KEYS = ("remote_node", "remote_engine_id", "transfer_id")


def _remote_keys(params: dict[str, Any]) -> tuple[str, ...]:
    """What a decode request's ``kv_transfer_params`` must name: a held
    request (pulled), or a transfer id (pushed as computed)."""
    return PUSH_KEYS if "transfer_id" in params else REMOTE_KEYS


@dataclass
class StepPlan:
    """What the workers do this step (carried in the connector's metadata)."""

    saves: list[Save] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    opens: list[Open] = field(default_factory=list)
    #: decode: loads pushed as computed whose request was aborted: stop them
    cancels: list[str] = field(default_factory=list)
    #: prefill: transfers that will never be opened
    withdraws: list[Withdraw] = field(default_factory=list)


def _prompt_tokens(request: Any) -> int | None:
    """A request's prompt tokens (``num_prompt_tokens``, which a prompt of
    embeddings has too); None if unknown."""
    n = getattr(request, "num_prompt_tokens", None)
    if isinstance(n, int):
        return n
    ids = getattr(request, "prompt_token_ids", None)
    return None if ids is None else len(ids)


def _blocks_of(blocks: Any) -> list[int]:
    """The first KV cache group's block ids of a ``KVCacheBlocks``."""
    ids = blocks.get_block_ids()
    return list(ids[0]) if ids else []


class SchedulerSide:
    def __init__(self, node: str, engine: str, block_size: int, max_held: int,
                 send: bool, receive: bool, tp_size: int = 1,
                 peer_tp_size: int | None = None) -> None:
        self.node = node
        self.tp_size = tp_size
        #: the other side's TP size the workers' pools are cut for
        self.peer_tp = tp_size if peer_tp_size is None else peer_tp_size
        self.engine = engine
        self.block_size = block_size
        self.send = send
        self.receive = receive
        self._keys = SlotTable(1, max_held, "held prefill request")
        self._loads: dict[str, Load] = {}  # to start at the next step
        self._blocks: dict[str, list[int]] = {}  # prefill: every block of a request to stage
        self._prompts: dict[str, int] = {}  # prefill: the prompt's tokens, all that is sent
        self._sends: list[Send] = []
        self._opens: list[Open] = []
        #: prefill, pushed as computed: request -> (key, transfer id, prompt tokens)
        self._push: dict[str, tuple[int, str, int]] = {}
        #: prefill, pushed as computed: requests that will never be opened
        #: (their transfers withdrawn already)
        self._refused: set[str] = set()
        self._withdraws: list[Withdraw] = []
        #: decode: requests whose load pushed as computed has not reported back
        self._pushed_loads: set[str] = set()
        self._cancels: list[str] = []

    # -- decode ------------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not (self.receive and params.get("do_remote_prefill")):
            return 0, False
        missing = [k for k in _remote_keys(params) if k not in params]
        if missing:
            raise InvalidArgument(f"request {request.request_id!r} asks for a remote prefill "
                                  f"without {missing} in kv_transfer_params")
        if not self._valid_transfer(request, params):
            params["do_remote_prefill"] = False  # computed here; nothing to release
            return 0, False
        if int(params.get("remote_tp_size", 1)) != self.peer_tp:
            # Our staging pools are cut for a prefill of peer_tp ranks: one of
            # another size is not loaded from (computed here; the prefill's
            # hold ends with its lease).
            log.warning("vllm.tp_mismatch", request=request.request_id,
                        remote_tp=params.get("remote_tp_size"), expected_tp=self.peer_tp)
            return 0, False
        # Every prompt token the decode has not computed comes from the
        # prefill; vLLM then computes the sampled token itself.
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if self.send and params.get("do_remote_decode"):
            self._blocks[request.request_id] = _blocks_of(blocks)
            if (n := _prompt_tokens(request)) is not None:
                self._prompts[request.request_id] = n
            if "transfer_id" in params:
                self._open(request, params)
        if not (self.receive and params.get("do_remote_prefill")):
            return
        # Once: a request preempted and scheduled again computes for itself.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        local = _blocks_of(blocks)
        n_new = -(-num_external_tokens // self.block_size)
        local_new = local[len(local) - n_new:] if n_new else []
        # The blocks decode already had (a local prefix hit) are skipped on
        # the prefill side: the remote table's tail matches our new blocks.
        skip = self._remote_blocks(request, params) - len(local_new)
        if skip < 0:
            raise InvalidArgument(f"request {request.request_id!r}: {len(local_new)} new blocks "
                                  "to load but the prefill holds "
                                  f"{self._remote_blocks(request, params)}")
        self._loads[request.request_id] = self._load(request.request_id, params, skip,
                                                     tuple(local_new))
        if "transfer_id" in params:
            self._pushed_loads.add(request.request_id)

    @staticmethod
    def _valid_transfer(request: Any, params: dict[str, Any]) -> bool:
        """A ``transfer_id``, if any, that can name a region: else the
        request is served as if it had none (a client's bad parameter is
        logged, not raised out of vLLM's step)."""
        if "transfer_id" not in params:
            return True
        try:
            check_transfer_id(params["transfer_id"])
        except InvalidArgument as exc:
            log.warning("vllm.bad_transfer_id", request=request.request_id, error=str(exc))
            return False
        return True

    def _remote_blocks(self, request: Any, params: dict[str, Any]) -> int:
        """Blocks of the prompt the prefill holds: its table, or (pushed as
        computed, the table unknown yet) the prompt's length in blocks."""
        if "transfer_id" in params:
            return -(-(_prompt_tokens(request) or 0) // self.block_size)
        return len(params["remote_block_ids"])

    @staticmethod
    def _load(rid: str, params: dict[str, Any], skip: int, blocks: tuple[int, ...]) -> Load:
        node, engine = str(params["remote_node"]), str(params["remote_engine_id"])
        if "transfer_id" in params:
            tid = check_transfer_id(params["transfer_id"])
            return Load(rid, node, engine, 0, tid, skip, blocks, tid)
        return Load(rid, node, engine, int(params["remote_key"]),
                    str(params["remote_request_id"]), skip, blocks)

    # -- prefill -----------------------------------------------------------------------

    def finished(self, request: Any, block_ids: list[int], completed: bool
                 ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: ``completed`` when it stopped or hit
        its length (not aborted). A prefill that completed is held for its
        pull; a decode request aborted before its load started releases the
        prefill's hold at once (an empty pull)."""
        rid = request.request_id
        self._blocks.pop(rid, None)
        self._prompts.pop(rid, None)
        params = request.kv_transfer_params or {}
        if self.receive and params.get("do_remote_prefill") and \
                all(k in params for k in _remote_keys(params)):
            params["do_remote_prefill"] = False
            if not self._valid_transfer(request, params):
                return False, None
            self._loads[rid] = self._load(rid, params, self._remote_blocks(request, params), ())
            return False, None
        if rid in self._pushed_loads:
            self._pushed_loads.discard(rid)
            if not completed:
                # Its prefill may take long to compute it, or never (aborted
                # too): the load stops now (its blocks, which vLLM keeps
                # until the load reports back, then go).
                self._cancels.append(rid)
            return False, None
        if not (self.send and params.get("do_remote_decode")):
            return False, None
        if (n := _prompt_tokens(request)) is not None:
            # The prompt's blocks only: a block vLLM gave a token after the
            # prompt (a step of asynchronous scheduling) is never staged, and
            # the decode lines the table up with its own prompt blocks.
            block_ids = block_ids[:-(-n // self.block_size)]
        if "transfer_id" in params and rid not in self._push:
            # Pushed as computed but never opened (aborted while it waited,
            # no key, a bad id): no decode can pull it; its blocks go now,
            # and a decode's pull hears why (unless it did already).
            if rid in self._refused:
                self._refused.discard(rid)
            elif self._valid_transfer(request, params):
                self._withdraw(params, f"prefill request {rid!r} ended before it was "
                                       f"scheduled ({'finished' if completed else 'aborted'})")
            return False, None
        pushed = self._push.pop(rid, None)
        if pushed is not None:
            # Its pushes may be under way from these blocks: they are held
            # until the worker says its pushes ended (aborted: at once).
            key, tid, _ = pushed
            done = completed and bool(block_ids)
            self._sends.append(Send(rid, key, tuple(int(b) for b in block_ids) if done else (),
                                    tid))
            return True, None
        if not completed or not block_ids:
            # Aborted (or errored): nobody will pull it; its blocks go now.
            log.debug("vllm.not_held", request=rid, status=str(getattr(request, "status", "")))
            return False, None
        try:
            key = self._keys.take(rid)
        except LimitExceeded as exc:
            # Nothing to hold it under: its blocks go now, and the decode,
            # given no kv_transfer_params, computes the prompt itself.
            log.warning("vllm.not_held", request=rid, error=str(exc))
            return False, None
        self._sends.append(Send(rid, key, tuple(int(b) for b in block_ids)))
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_node": self.node, "remote_engine_id": self.engine,
                      "remote_key": key, "remote_request_id": rid,
                      "remote_block_ids": [int(b) for b in block_ids],
                      "remote_tp_size": self.tp_size}

    def _open(self, request: Any, params: dict[str, Any]) -> None:
        """A prefill request pushed as computed was scheduled: its key now,
        so a decode can pull before it finished."""
        rid = request.request_id
        if rid in self._push or rid in self._refused:
            return  # scheduled again after a preemption: open (or refused) already
        if not self._valid_transfer(request, params):
            return
        tid = str(params["transfer_id"])
        if getattr(request, "max_tokens", 1) != 1:
            # Its later steps would write the prompt's last block while it
            # is pushed: a prefill to be pushed as computed generates one token.
            why = f"prefill request {rid!r} has max_tokens {request.max_tokens}, not 1"
            log.warning("vllm.not_opened", request=rid, transfer_id=tid, reason=why)
            self._refuse(rid, params, why)
            return
        try:
            key = self._keys.take(rid)
        except LimitExceeded as exc:
            # Nothing to take its pull in: the decode hears so and computes
            # the prompt itself.
            log.warning("vllm.not_opened", request=rid, transfer_id=tid, error=str(exc))
            self._refuse(rid, params, f"prefill request {rid!r} could not be held: {exc}")
            return
        self._push[rid] = (key, tid, len(request.prompt_token_ids or ()))
        self._opens.append(Open(rid, key, tid))

    def _refuse(self, rid: str, params: dict[str, Any], why: str) -> None:
        """``rid`` is never opened: its transfer is withdrawn now."""
        self._refused.add(rid)
        self._withdraw(params, why)

    def _withdraw(self, params: dict[str, Any], why: str) -> None:
        self._withdraws.append(Withdraw(str(params["transfer_id"]), why))

    def held(self) -> int:
        """Prefill requests held for a pull."""
        return len(self._keys)

    def sent(self, requests: set[str]) -> None:
        """Workers report these held requests pushed (or given up): their
        keys are free again."""
        for rid in requests:
            self._keys.release(rid)

    def received(self, requests: set[str]) -> None:
        """Workers report these loads over: nothing of them to stop."""
        self._pushed_loads -= requests

    # -- every step --------------------------------------------------------------------

    def plan(self, scheduler_output: Any) -> StepPlan:
        step = StepPlan(loads=list(self._loads.values()), sends=self._sends, opens=self._opens,
                        cancels=self._cancels, withdraws=self._withdraws)
        self._loads = {}
        self._sends = []
        self._opens = []
        self._cancels = []
        self._withdraws = []
        if self.send and self._blocks:
            step.saves = self._saves(scheduler_output)
        return step

    def _saves(self, out: Any) -> list[Save]:
        """The blocks each step's tokens touch, per request to be pulled; a
        request's first step stages from its first block (a locally cached
        prefix is not computed again, but it is pushed)."""
        scheduled = out.num_scheduled_tokens
        saves = []
        for new in out.scheduled_new_reqs:
            blocks = self._blocks.get(new.req_id)
            if blocks is None:
                continue
            self._blocks[new.req_id] = blocks = list(new.block_ids[0])
            end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            if (save := self._save(new.req_id, blocks, 0, end)) is not None:
                saves.append(save)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = self._blocks.get(rid)
            if blocks is None:
                continue
            added = cached.new_block_ids[i]
            if rid in getattr(cached, "resumed_req_ids", ()):
                # Preempted and scheduled again: these are all its blocks.
                blocks[:] = added[0] if added else []
            elif added:
                blocks.extend(added[0])
            start = cached.num_computed_tokens[i]
            if (save := self._save(rid, blocks, start, start + scheduled.get(rid, 0))) is not None:
                saves.append(save)
        return saves

    def _save(self, rid: str, blocks: list[int], start: int, end: int) -> Save | None:
        """The blocks of the prompt's tokens among ``start..end`` of ``rid``
        (None if there are none); for one pushed as computed whose prompt
        ends this step, ``last`` and its table. Later tokens are never sent,
        and staging them (a step vLLM's asynchronous scheduling runs after
        the prompt's last) would write the prompt's last block again while
        a push may be reading it."""
        end = min(end, self._prompts.get(rid, end))
        if start >= end:
            return None
        bs = self.block_size
        step = tuple(blocks[start // bs:-(-end // bs)])
        pushed = self._push.get(rid)
        if pushed is None or not start < pushed[2] <= end:
            return Save(rid, step)
        return Save(rid, step, last=True, table=tuple(blocks[:-(-pushed[2] // bs)]))
