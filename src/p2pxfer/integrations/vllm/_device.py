"""A worker's CUDA side, when vLLM's KV tensors are on a GPU: the staging
pool page-locked, the streams its copies go on, and what waits for them.

- Prefill: ``save_kv_layer`` queues device -> pool copies on the stream the
  forward runs on (:meth:`DeviceSide.staging`: behind the kernels that
  wrote the layer); ``wait_for_save`` records an event on each such stream
  (:meth:`end_step`) and returns: the forward is not stopped. A pull server
  waits for every event recorded so far (:meth:`staged`, in a thread)
  before it reads the pool (checksums, push). A layer pushed as computed
  has an event of its own right behind its copies (:meth:`layer_event`),
  not behind the later layers' kernels queued since: its pusher waits for
  that one (:meth:`synced`).
- Decode: each landed layer's pool -> device copies go on a stream of the
  worker's (:attr:`DeviceSide.loads`), synchronized (:meth:`loads_done`, in
  a thread) before the load is reported, however it ended: vLLM never
  reads those blocks, or computes them again, while a copy runs.
- :meth:`close` (in the bridge, after its tasks, while the pool is still
  mapped): every copy waited for, the pool unpinned, the stream destroyed.

Threads: vLLM's thread calls ``staging`` and ``end_step``; the bridge's
trio thread issues the decode's copies and closes; worker threads wait.
``_issuing`` is held while a layer's copies are issued, so ``close`` sees
them queued (and waits for them) or stops them from being issued.
The step's streams and the recorded events are under ``_lock`` (never held
while waiting on the device); ``_waiting`` admits one waiter at a time. What must
not live here: the copies' offsets (``_tensors``), vLLM's objects.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from p2pxfer.cuda import driver
from p2pxfer.integrations._tensors import DeviceCopies
from p2pxfer.log import get_logger

__all__ = ["DeviceSide"]

log = get_logger("p2pxfer.vllm")


def current_stream(device: int) -> int:
    """The ``CUstream`` of torch's current stream on ``device``: the one
    vLLM's forward runs on (torch is there: the tensors are torch's)."""
    torch = importlib.import_module("torch")
    return int(torch.cuda.current_stream(device).cuda_stream)


class DeviceSide:
    """See the module docstring."""

    def __init__(self, device: int, pool: npt.NDArray[np.uint8], receive: bool) -> None:
        self.device = device
        self._pool = pool
        self._lock = threading.Lock()
        self._issuing = threading.Lock()  # held while a layer's copies are issued
        self._waiting = threading.Lock()  # held by the one waiter of ``staged``
        self._step: set[int] = set()  # streams this step's staging copies went on
        #: per stream, an event behind the staging copies of the steps ended
        #: so far, not yet waited for (a stream runs in order: the latest
        #: event covers the earlier ones, which are dropped)
        self._events: dict[int, int] = {}
        self.closed = False
        cuda = driver()
        t0 = time.perf_counter()
        self._pinned = cuda.host_register(pool, device)  # False: pinned by someone else
        #: the decode's stream for pool -> device copies
        self.loads: DeviceCopies | None = None
        try:
            if receive:
                self.loads = DeviceCopies(cuda.stream(device), device)
        except BaseException:
            self._unpin()
            raise
        log.info("vllm.pool_pinned", device=device, nbytes=pool.nbytes,
                 seconds=time.perf_counter() - t0, ours=self._pinned)

    # -- prefill ------------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self) -> Iterator[DeviceCopies | None]:
        """Where a layer's device -> pool copies go now (vLLM's current
        stream), held while they are issued: :meth:`close` waits for them.
        None once closed (nothing is pushed from the pool any more)."""
        with self._issuing:
            if self.closed:
                yield None
                return
            stream = current_stream(self.device)
            with self._lock:
                self._step.add(stream)
            yield DeviceCopies(stream, self.device)

    def end_step(self) -> None:
        """The step's staging copies are all queued: an event behind them on
        each stream they went on (waited for by :meth:`staged`). Under the
        lock (recording does not wait): a waiter sees either the step's
        streams or its events, never neither."""
        cuda = driver()
        with self._lock:
            if self.closed:
                return
            streams, self._step = self._step, set()
            for stream in streams:
                event = cuda.record(stream, self.device)
                if (old := self._events.pop(stream, None)) is not None:
                    cuda.event_done(old, self.device)  # covered by the new one
                self._events[stream] = event

    def staged(self) -> None:
        """Blocks until every staging copy queued so far is in the pool
        (call it from a worker thread).
        One waiter at a time: a second one must not find the list emptied
        by the first before its events are over."""
        with self._waiting:
            cuda = driver()
            with self._lock:
                events = list(self._events.values())
                self._events.clear()
                # A step staged but not ended (wait_for_save not called
                # yet, or never): behind what its streams hold now.
                events.extend(cuda.record(stream, self.device) for stream in self._step)
            self.synced(events)

    def layer_event(self, on: DeviceCopies) -> int:
        """An event behind the copies just issued on ``on`` (inside
        :meth:`staging`); whoever takes it hands it to :meth:`synced`."""
        return driver().record(on.stream, self.device)

    def synced(self, events: list[int]) -> None:
        """Blocks until ``events`` are over (from a worker thread), then
        destroys them, over or not."""
        cuda = driver()
        try:
            for event in events:
                cuda.event_sync(event, self.device)
        finally:
            self.drop(events)

    def drop(self, events: list[int]) -> None:
        """Destroy ``events`` without waiting (the device finishes what they
        stand behind on its own)."""
        cuda = driver()
        for event in events:
            cuda.event_done(event, self.device)

    # -- decode -------------------------------------------------------------------------

    def loads_done(self) -> None:
        """Blocks until every pool -> device copy issued so far has run."""
        if self.loads is not None:
            driver().stream_sync(self.loads.stream, self.device)

    # -- both ---------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every copy (a step staged but never ended included),
        then unpin the pool and destroy the stream. Once; from the bridge,
        after its tasks, while the pool is mapped."""
        cuda = driver()
        try:
            with self._issuing:  # copies being issued are queued by now
                self.closed = True  # vLLM's thread issues nothing more
            self.staged()  # the steps ended and the one under way
            self.loads_done()
        finally:
            try:
                self._unpin()
            finally:
                if self.loads is not None:
                    cuda.stream_destroy(self.loads.stream, self.device)
                    self.loads = None

    def _unpin(self) -> None:
        if self._pinned:
            self._pinned = False
            driver().host_unregister(self._pool, self.device)
