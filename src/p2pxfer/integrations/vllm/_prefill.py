"""The worker side of a prefill: finished requests held under their keys
until each pull lands in the mailbox, then pushed.

A held request's key owns ``f`` mailbox slots (``f`` decode ranks per
prefill rank; else 1): slot ``key*f + j``, with immediate ``key*f + j``,
is the pull of decode rank ``j`` of those: head slice ``j`` (staging
blocks ``b*k + j``, ``k == f``), or whole blocks for MLA (``k == 1``).
The request is released (reported finished sending, so vLLM frees its
blocks) once every slot was served (an empty pull releases at once),
refused, or its lease passed. A pull whose push failed is answered with
``kv_abandon`` (``_abandon``): its decode's load fails now, not at its
deadline. What must not live here: set-up (``_worker``), loads
(``_decode``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.errors import ConnectionLost, InvalidArgument, P2PXferError, WaitTimeout
from p2pxfer.integrations._tensors import checksum_blocks
from p2pxfer.log import get_logger
from p2pxfer.protocol import MAX_REASON
from p2pxfer.scatter import ScatterList

from ._plan import Pull, Send, decode_pull
from ._state import SUM_BYTES, WorkerState

__all__ = ["PrefillSide"]

log = get_logger("p2pxfer.vllm")


class PrefillSide(WorkerState):
    def hold(self, sends: Iterable[Send]) -> None:
        """Serve the pulls of these finished requests (in the bridge) and
        return; a key out of range refuses them all."""
        sends = list(sends)
        for s in sends:
            if not 1 <= s.key <= self.opts.max_held:
                raise InvalidArgument(f"key {s.key} is outside 1..{self.opts.max_held}")
        try:
            self.bridge.spawn_each(self._serve, sends)
        except ConnectionLost as exc:
            # The daemon is gone: nobody can pull them, so vLLM frees their
            # blocks now instead of an exception out of its step.
            with self._lock:
                for s in sends:
                    log.warning("vllm.hold_failed", request=s.request, key=s.key,
                                error=str(exc))
                    self._sent.add(s.request)

    async def _serve(self, s: Send) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for j in range(self.fanout):
                    nursery.start_soon(self._serve_one, s, j)
        finally:
            with self._lock:
                self._sent.add(s.request)

    async def _serve_one(self, s: Send, j: int) -> None:
        """Wait for the pull of head slice ``j`` of ``s`` (at most its
        lease), then push it."""
        c, o = self.bridge.client, self.opts
        assert self._mailbox is not None and self.pool is not None
        slot = s.key * self.fanout + j
        outcome = "pushed"
        taken: Pull | None = None
        try:
            await c.wait_imm(slot, 1, region=self.pull_name, timeout=o.lease_s)
            sb = self.slot_bytes
            pull = decode_pull(self._mailbox.array[slot * sb:(slot + 1) * sb])
            if pull.prefill_request != s.request:
                raise InvalidArgument(f"a pull for {pull.prefill_request!r} came under key "
                                      f"{s.key}, which holds {s.request!r}")
            taken = pull
            blocks = np.asarray(s.blocks, np.int64)[pull.skip:]
            if not 0 <= pull.skip <= len(s.blocks) or len(blocks) != len(pull.blocks):
                raise InvalidArgument(f"a pull of {len(pull.blocks)} blocks after {pull.skip} "
                                      f"for a request of {len(s.blocks)}")
            src = blocks * self.k + (j if self.k > 1 else 0)
            if len(src):
                if self.gpu is not None:  # the staging copies are in the pool
                    await trio.to_thread.run_sync(self.gpu.staged)
                if pull.sums:
                    await self._send_sums(slot, pull, src)
                push = await c.kv_push(pull.node, pull.pool, self.pool, src, pull.blocks,
                                       request=pull.request, deadline=o.lease_s)
                result = await push.wait()
                log.debug("vllm.pushed", request=s.request, peer=pull.node, nbytes=result.nbytes,
                          seconds=result.seconds, part=j)
        except WaitTimeout:
            outcome = "lease_expired"
            log.warning("vllm.lease_expired", request=s.request, key=s.key, part=j,
                        lease_s=o.lease_s)
        except P2PXferError as exc:
            outcome = "failed"
            log.warning("vllm.push_failed", request=s.request, key=s.key, part=j, error=str(exc))
            if taken is not None:
                await self._abandon(s.request, taken, f"its push failed: {exc}")
        log.debug("vllm.released", request=s.request, key=s.key, part=j, outcome=outcome)

    async def _abandon(self, request: str, pull: Pull, why: str) -> None:
        """Tell the decode whose ``pull`` was taken that no more of it comes
        (``kv_abandon``): its load fails now (vLLM computes the blocks
        there), not at its deadline. Best effort: a decode we cannot reach
        fails at its deadline, or sooner if its daemon rules us dead."""
        reason = f"prefill request {request!r}: {why}"[:MAX_REASON]
        try:
            await self.bridge.client.kv_abandon(pull.node, pull.pool, pull.request,
                                                reason=reason)
        except P2PXferError as exc:
            log.debug("vllm.abandon_failed", request=request, peer=pull.node, error=str(exc))
        else:
            log.info("vllm.abandoned", request=request, peer=pull.node, why=why)

    async def _send_sums(self, slot: int, pull: Pull, src: npt.NDArray[np.int64],
                         layers: npt.NDArray[np.int64] | None = None) -> None:
        """Each layer's checksum (of ``layers``, else all) over the blocks
        about to be pushed, written into the decode's checksum region
        before the push starts."""
        pool, layout = self.pool, self.layout
        assert pool is not None and layout is not None
        n = layout.num_layers
        which = np.arange(n) if layers is None else layers

        def compute() -> npt.NDArray[np.uint64]:
            return np.array([checksum_blocks(pool.array, layout, int(layer), src)
                             for layer in which], "<u8")

        # In a thread (the gathers and CRCs release the GIL): the bridge
        # serves other pulls and loads meanwhile.
        sums = await trio.to_thread.run_sync(compute)
        out = self._sums_out
        assert out is not None
        base = slot * n * SUM_BYTES
        out.array[base:base + n * SUM_BYTES].view("<u8")[which] = sums
        # One piece per run of consecutive layers (all of them: one piece).
        runs = np.split(which, np.flatnonzero(np.diff(which) != 1) + 1)
        where = ScatterList(
            np.array([base + r[0] * SUM_BYTES for r in runs], np.int64),
            np.array([(pull.request * n + r[0]) * SUM_BYTES for r in runs], np.int64),
            np.array([len(r) * SUM_BYTES for r in runs], np.int64))
        await self.bridge.client.write(pull.node, pull.sums, where, src=out)
