"""The client protocol's handler table: one function per request kind, each
turning a request into calls on its ``ClientSession`` (``_sessions``) and the
daemon's parts, checked against the protocol's request kinds when this
module loads (a request without a handler fails the import, not a client).
What must not live here: serving the connection (``_sessions``), or any
rule a part owns (uid checks, the write path, the region directory).
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from p2pxfer.buffers import populate_resident
from p2pxfer.errors import Forbidden, InvalidArgument, UnknownRegion
from p2pxfer.log import get_logger
from p2pxfer.protocol import (
    CLIENT_REQUESTS,
    Message,
    check_handlers,
    check_reason,
    unpack_scatter,
)
from p2pxfer.scatter import ScatterList

from ._device import is_device
from ._follow import WATCH_TIMEOUT_MAX_S

if TYPE_CHECKING:
    from ._sessions import ClientSession

__all__ = ["HANDLERS"]

log = get_logger("p2pxfer.daemon")

Handler = Callable[["ClientSession", Message], Awaitable[dict[str, Any]]]


async def _share(s: ClientSession, msg: Message) -> dict[str, Any]:
    return {"mem": s.share(msg["size"])}


async def _share_device(s: ClientSession, msg: Message) -> dict[str, Any]:
    return {"mem": await s.share_device(msg["handle"], msg["offset"], msg["size"], msg["gpu"])}


async def _unshare(s: ClientSession, msg: Message) -> dict[str, Any]:
    s.unshare(msg["mem"])
    return {}


async def _export(s: ClientSession, msg: Message) -> dict[str, Any]:
    await s.name_freed(msg["name"])
    return {"descriptor": s.export(msg["name"], msg["mem"], msg["offset"], msg["length"],
                                   msg.get("writers"))}


async def _unexport(s: ClientSession, msg: Message) -> dict[str, Any]:
    reason = msg.get("reason")
    if reason is not None:
        check_reason(reason)
    await s.unexport(msg["name"], reason)
    return {}


async def _withdraw(s: ClientSession, msg: Message) -> dict[str, Any]:
    check_reason(msg["reason"])
    await s.name_freed(msg["name"])
    s.withdraw(msg["name"], msg["reason"])
    return {}


async def _write(s: ClientSession, msg: Message) -> dict[str, Any]:
    src = s.mem(msg["mem"]).view(msg["offset"])
    scatter = ScatterList(*unpack_scatter(msg["scatter"]))
    pieces = await s.daemon.writes.write(s.label, src, scatter, msg["peer"], msg["region"],
                                         msg.get("imm"), session=s,
                                         notify=msg.get("notify", False))
    return {"pieces": pieces}


async def _wait_imm(s: ClientSession, msg: Message) -> dict[str, Any]:
    region = msg.get("region")
    if region is not None and region not in s.exports:
        raise UnknownRegion(f"this client exported no {region!r}: only a region's owner "
                            "waits for its immediates")
    value = s.daemon.imm_slots.check_value(msg["imm"])
    timeout_ms = msg.get("timeout_ms")
    with trio.move_on_after(math.inf if timeout_ms is None else max(timeout_ms, 0) / 1000):
        await s.counts.wait(region, value, msg["count"])
        return {}
    # Said here, where the count is: how far the wait got is the clue.
    return {"timed_out": True, "arrived": s.counts.count(region, value)}


async def _status(s: ClientSession, msg: Message) -> dict[str, Any]:
    return s.daemon.status()


async def _peers(s: ClientSession, msg: Message) -> dict[str, Any]:
    return {"peers": s.daemon.peer_list()}


async def _add_peer(s: ClientSession, msg: Message) -> dict[str, Any]:
    if not s.privileged:
        raise Forbidden(f"add_peer changes the whole node: only root or the daemon's uid "
                        f"({os.getuid()}) may, not uid {s.uid}")
    s.daemon.peers.add(msg["name"], msg["address"])
    return {}


async def _locate(s: ClientSession, msg: Message) -> dict[str, Any]:
    return {"nodes": await s.daemon.regions.locate(msg["region"])}


async def _watch(s: ClientSession, msg: Message) -> dict[str, Any]:
    timeout_ms = msg.get("timeout_ms", 30_000)
    if timeout_ms < 0:
        raise InvalidArgument(f"timeout_ms must be >= 0, got {timeout_ms}")
    d = s.daemon
    return await d.follower.watch(msg["after"], min(timeout_ms / 1000, WATCH_TIMEOUT_MAX_S),
                                  d.peer_list)


async def _kv_pool(s: ClientSession, msg: Message) -> dict[str, Any]:
    await s.name_freed(msg["name"])
    result = s.daemon.kv.add_pool(s, msg["name"], msg["mem"], msg["layout"],
                                  msg.get("receive", True), msg.get("writers"),
                                  msg.get("memory", "host"))
    # A pool is registered once and pushed from (or into) for its life: the
    # pages its client has are mapped here now (pushes read its mapping; the
    # export's own, a receiving pool's, is where peers' writes land), in a
    # worker thread, not one fault at a time on the pushes.
    views = [s.kv_pools[msg["name"]].view]
    export = s.daemon.exports.get(msg["name"]) if msg.get("receive", True) else None
    if export is not None:
        views.append(export.own.view)
    for view in views:
        if is_device(view):  # the client's GPU memory: resident already
            continue
        err = await trio.to_thread.run_sync(populate_resident, view, abandon_on_cancel=True)
        if err:
            log.info("kv.pool_not_populated", client=s.label, pool=msg["name"],
                     error=os.strerror(err))
            break
    return result


async def _kv_push(s: ClientSession, msg: Message) -> dict[str, Any]:
    return await s.daemon.kv.push(s, msg)


async def _kv_wait(s: ClientSession, msg: Message) -> dict[str, Any]:
    timeout_ms = msg.get("timeout_ms", -1)
    return await s.daemon.kv.wait(s, msg["pool"], msg["request"], msg.get("first", 0),
                                  msg["upto"], math.inf if timeout_ms < 0 else timeout_ms / 1000)


async def _kv_forget(s: ClientSession, msg: Message) -> dict[str, Any]:
    await s.daemon.kv.forget(s, msg["pool"], msg["request"], bool(msg.get("refuse", False)))
    return {}


async def _kv_abandon(s: ClientSession, msg: Message) -> dict[str, Any]:
    return await s.daemon.kv.abandon_push(s, msg)


async def _cancel(s: ClientSession, msg: Message) -> dict[str, Any]:
    await s.cancel(msg["target"])
    return {}


async def _ping(s: ClientSession, msg: Message) -> dict[str, Any]:
    return await s.daemon.ping.run(msg.get("peer", ""), msg.get("timeout_ms", 10_000) / 1000)


HANDLERS: dict[str, Handler] = {
    "share": _share, "share_device": _share_device, "unshare": _unshare, "export": _export,
    "unexport": _unexport,
    "withdraw": _withdraw, "write": _write, "wait_imm": _wait_imm, "status": _status,
    "peers": _peers,
    "add_peer": _add_peer, "locate": _locate, "watch": _watch, "cancel": _cancel,
    "kv_pool": _kv_pool, "kv_push": _kv_push, "kv_wait": _kv_wait, "kv_forget": _kv_forget,
    "kv_abandon": _kv_abandon, "ping": _ping,
}
check_handlers(HANDLERS, CLIENT_REQUESTS, "client sessions")
