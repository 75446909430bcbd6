"""Settling a KV layer whose notification's outcome is unknown.

Every byte of the layer landed (delivery-complete), but its one notification
failed or its rail broke before it was acknowledged (``NotificationUnknown``).
The receiver is asked over the control connection (``kv_arrived``: another
path than the broken rail), and the notification is sent again,
delivery-complete, only where it has not landed: the layer is counted once.
A layer's immediate (request slot | layer) is unique per push, so the answer
is exact.

Runs in the daemon's trio thread, inside a push (``_kv_push.Pushes._post``); owns no
state. What must not live here: the push itself, the receiver's bookkeeping
(``_kv``), posting (the engine).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.engine import NOTIFY_BYTES, Engine
from p2pxfer.errors import NotificationUnknown, TransferError
from p2pxfer.log import get_logger
from p2pxfer.scatter import ScatterList

from ._peers import seconds_left

__all__ = ["Unsettled", "settle_notification"]

log = get_logger("p2pxfer.daemon")

I64 = npt.NDArray[np.int64]
Ask = Callable[..., Awaitable[dict[str, Any]]]
RESEND_PAUSE_S = 0.1  # after a resend whose rail failed, before asking again


class Unsettled(NamedTuple):
    """The layer whose notification's outcome is unknown, and its immediate."""

    peer: str
    pool: str
    request: int
    layer: int
    imm: int


async def settle_notification(engine: Engine, ask: Ask, u: Unsettled, src: Any, desc: Any,
                              piece: tuple[I64, I64, I64], until: float,
                              unknown: NotificationUnknown) -> None:
    """Ask, and resend where it did not land, until the receiver has the
    notification or ``until`` (trio time) passes (then ``unknown`` is
    raised). ``piece``: the layer's first piece (src, dst, length), whose
    first bytes the notification writes again (they landed already)."""
    src_off, dst_off, length = piece
    one = ScatterList(src_off, dst_off, np.minimum(length, NOTIFY_BYTES))
    where = {"peer": u.peer, "pool": u.pool, "request": u.request, "layer": u.layer}
    log.info("kv.notification_unknown", **where, error=str(unknown))
    while trio.current_time() < until:
        got = await ask(u.peer, "kv_arrived", until, pool=u.pool, request=u.request,
                        layer=u.layer)
        if int(got.get("arrived", 0)) >= 1:
            log.info("kv.notification_settled", **where, sent_again=False)
            return
        try:
            await engine.write(src, desc, one, imm=u.imm, notify=True,
                               timeout=seconds_left(until))
        except NotificationUnknown:
            continue  # ask again
        except TransferError as exc:
            log.info("kv.notification_resend_failed", **where, error=str(exc))
            await trio.sleep(min(RESEND_PAUSE_S, max(until - trio.current_time(), 0)))
            continue
        log.info("kv.notification_settled", **where, sent_again=True)
        return
    raise unknown
