"""The KV core that moves and counts, one for the in-process API
(``p2pxfer.kv``) and the daemon (``p2pxfer.daemon._kv``, ``_kv_push``):

- ``push_layers`` runs a planned push (``kv_plan.plan_push``): one transfer
  per layer, submitted in layer order before any is awaited (the receiver
  starts on layer 0 while later layers post), each carrying its layer's
  immediate (``kv_plan.layer_imm``) once, after every piece of the layer
  landed; a failed or cancelled push stops what has not gone out and
  returns once what was posted is over (the source is the caller's again).
- ``LayerArrivals`` is one request's bookkeeping at the receiver: per layer,
  how many notifications it brings (1 in notify mode; announced by the
  sender or known in advance) and how many arrived; a layer is complete
  when they match, in whatever order the two come; waits for sets of
  layers.

What must not live here: planning and the immediate encoding (``kv_plan``),
how a layer is sent (the caller's ``submit``: an engine transfer, or the
daemon's same-daemon copy) or how a request's immediates are routed to its
``LayerArrivals`` (``Engine.route_imms`` in-process, the daemon's
``ImmTable`` slots), a Python loop over pieces or blocks.

State: a ``LayerArrivals`` is its receiver's trio thread's (arrivals come
there: engine route handlers and ``ImmTable`` sinks run in trio); each push
lives in the task that runs it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.errors import NotificationUnknown, P2PXferError
from p2pxfer.kv_plan import PushPlan
from p2pxfer.log import get_logger
from p2pxfer.scatter import ScatterList

__all__ = ["LayerArrivals", "LayerSend", "push_layers"]

log = get_logger("p2pxfer.kv")

I64 = npt.NDArray[np.int64]


class LayerSend(Protocol):
    """One layer on its way (an engine ``Transfer``, or a copy that is over)."""

    @property
    def pieces(self) -> int: ...

    @property
    def imms(self) -> int: ...

    def cancel(self, *, drain: bool = False) -> None: ...

    async def wait(self, *, drain: bool = False) -> int: ...


#: ``submit(layer, its pieces)``: the layer on its way
Submit = Callable[[int, ScatterList], Awaitable[LayerSend]]
#: ``announce(first, sends)``: the receiver hears how many notifications the
#: layers ``first, first + 1, ...`` of the push bring
Announce = Callable[[int, list[LayerSend]], Awaitable[None]]
#: ``settle(k, error)``: layer ``k`` of the push landed but whether its
#: notification did is unknown; returns once it is known to have
Settle = Callable[[int, NotificationUnknown], Awaitable[None]]


async def push_layers(plan: PushPlan, submit: Submit, *, announce: Announce | None = None,
                      settle: Settle | None = None) -> tuple[list[int], float]:
    """Run ``plan``: every layer submitted in order, then awaited in order.
    With ``announce``, the receiver hears layer 0's count as soon as it is
    submitted (so it can complete while later layers are submitted), the
    others' once all are; with ``settle``, a ``NotificationUnknown`` is
    settled rather than raised. Returns the pieces of each layer as sent
    (after striping) and ``time.perf_counter()`` when layer 0 was over.

    On an error or cancellation: layers none of which went out are
    cancelled, a layer under way goes on to its end (its notification
    included), each is awaited (shielded), then it raises: the source is no
    longer read, and nothing of the push lands afterwards. (Stopped midway,
    a layer's pieces would only be known handed to the provider: on tcp a
    completion means in the socket, and they could land after the push
    raised, and after its receiver was told it ended.)"""
    sends: list[LayerSend] = []
    first = 0.0
    try:
        for layer, part in plan.per_layer():
            sends.append(await submit(layer, ScatterList(plan.src[part], plan.dst[part],
                                                         plan.length[part])))
            if len(sends) == 1 and announce is not None:
                await announce(0, sends[:1])
        if len(sends) > 1 and announce is not None:
            await announce(1, sends[1:])
        for k, send in enumerate(sends):
            try:
                await send.wait(drain=True)
            except NotificationUnknown as exc:
                if settle is None:
                    raise
                await settle(k, exc)
            if k == 0:
                first = time.perf_counter()
    except BaseException:
        for send in sends:
            send.cancel(drain=True)
        with trio.CancelScope(shield=True):
            for send in sends:
                try:
                    await send.wait(drain=True)
                except Exception as exc:  # already failing: the first error stands
                    log.debug("kv.layer_failed", error=str(exc))
        raise
    return [s.pieces for s in sends], first


@dataclass(eq=False)
class LayerArrivals:
    """One request's notifications into one receiver, per layer.

    ``expected[n]`` is how many notifications layer ``n`` brings (-1: not
    announced yet), ``arrived[n]`` how many came; arrivals before their
    count are kept, not lost. ``error`` ends every wait with that error;
    ``expired`` ends them with no error (the request's deadline passed).
    """

    arrived: I64
    expected: I64
    error: P2PXferError | None = None
    expired: bool = False
    changed: trio.Event = field(default_factory=trio.Event)

    @classmethod
    def for_layers(cls, layers: int, expected: int = -1) -> LayerArrivals:
        return cls(np.zeros(layers, np.int64), np.full(layers, expected, np.int64))

    def widen(self, layers: int, expected: int) -> None:
        """Room for layers ``0..layers-1`` (the new ones expecting ``expected``)."""
        extra = layers - len(self.arrived)
        if extra > 0:
            self.arrived = np.concatenate([self.arrived, np.zeros(extra, np.int64)])
            self.expected = np.concatenate([self.expected, np.full(extra, expected, np.int64)])

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def arrive(self, layer: int, count: int) -> bool:
        """``count`` notifications of ``layer`` landed; True if that made it
        complete (its waiters are woken). Per batch of completions: a few
        scalar operations, no numpy over layers."""
        if not 0 <= layer < len(self.arrived):
            return False  # not a layer of this receiver: nothing to count it for
        before = int(self.arrived[layer])
        self.arrived[layer] = before + count
        expected = int(self.expected[layer])
        if 0 <= expected <= before + count and before < expected:
            self.wake()
            return True
        return False

    def announce(self, layers: I64, counts: I64) -> int:
        """Layers ``layers`` bring ``counts`` notifications each; returns how
        many of them are complete already (their waiters are woken)."""
        self.expected[layers] = counts
        done = int((self.arrived[layers] >= counts).sum())
        if done:
            self.wake()
        return done

    def end(self, error: P2PXferError | None) -> None:
        """No more waits succeed: they raise ``error`` (None: they expire)."""
        if error is None:
            self.expired = True
        elif self.error is None:
            self.error = error
        self.wake()

    def complete(self, arrived: I64 | None = None) -> npt.NDArray[np.bool_]:
        """The layers complete (with ``arrived`` instead of what arrived)."""
        got = self.arrived if arrived is None else arrived
        return (self.expected >= 0) & (got >= self.expected)

    def prefix(self, first: int) -> int:
        """The first layer from ``first`` on that is not complete."""
        missing = np.flatnonzero(~self.complete()[first:])
        return first + int(missing[0]) if len(missing) else len(self.arrived)

    async def wait(self, want: I64, timeout: float = math.inf) -> bool:
        """Until every layer of ``want`` is complete (True), or ``timeout``
        seconds passed or the request expired first (False); raises the
        request's error. Cancellation leaves the bookkeeping as it was."""
        with trio.move_on_after(timeout):
            while True:
                if self.error is not None:
                    raise self.error
                if self.complete()[want].all():
                    return True
                if self.expired:
                    return False
                await self.changed.wait()
        return False
