"""The control port: peer daemons (and the bench) ask us over TCP.

One task per connection: a ``Pump`` over the socket, the hello (strictly
checked) and the token handshake (``_auth``), then each request dispatched
through ``HANDLERS``, a table checked against the peer protocol's requests
when this module loads. Whatever goes wrong inside one connection ends that
connection alone, logged once: never the daemon. What must not live here:
the region directory (``_regions``) or dialling out (``_peers``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
import trio

from p2pxfer._pump import Pump, TrioStream, bounded
from p2pxfer.address import format_hostport, parse_hostport
from p2pxfer.errors import ConnectionLost, P2PXferError
from p2pxfer.protocol import (
    PEER_REQUESTS,
    RESPONDER,
    SCHEMA_VERSION,
    Connection,
    Message,
    RemoteProtocolError,
    check_handlers,
    is_fatal,
    wire_error,
)

from . import _auth
from ._auth import Caller

if TYPE_CHECKING:
    from ._daemon import Daemon

__all__ = ["HANDLERS", "serve_control", "serve_peer"]

log = structlog.get_logger("p2pxfer.daemon")

Handler = Callable[["Daemon", Caller, Message], dict[str, Any]]


def _auth_request(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    caller.prove(msg["proof"])
    _known(d, caller)
    return {}


def _resolve(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    desc = d.regions.local_descriptor(msg["region"], for_peer=caller.name)
    result = {"descriptor": desc.to_wire(), "slot": d.regions.slot(d.node, msg["region"])}
    if (layout := d.kv.layout_of(msg["region"])) is not None:
        result["kv"] = layout  # a KV pool: pushers need its layout
    return result


def _invalidate(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    d.regions.forget(caller.name, msg["region"])
    return {}


HANDLERS: dict[str, Handler] = {
    "kv_begin": lambda d, caller, msg: d.kv.begin(caller.name, msg["pool"], msg["request"],
                                                  msg["layers"], msg["deadline_ms"]),
    "kv_expect": lambda d, caller, msg: d.kv.expect(caller.name, msg["slot"], msg["pieces"],
                                                    msg.get("first", 0)),
    "auth": _auth_request,
    "resolve": _resolve,
    "invalidate": _invalidate,
    "status": lambda d, caller, msg: d.status(),
    "peers": lambda d, caller, msg: {"peers": d.peer_list()},
}
check_handlers(HANDLERS, PEER_REQUESTS, "the control port")


def _known(d: Daemon, caller: Caller) -> None:
    """A daemon that reached us (and proved the token, if one is set) can be
    reached back: no static world. With membership on, the members are the
    peers: a caller must not add itself this way."""
    if caller.authenticated and caller.name and caller.control \
            and caller.name not in d.peers and not d.follower.enabled:
        d.peers.add(caller.name, caller.control)


async def serve_control(d: Daemon, nursery: trio.Nursery) -> str:
    """Listen on the configured control address; returns the bound one."""
    host, port = parse_hostport(d.config.control)
    listeners = await nursery.start(partial(trio.serve_tcp, host=host),
                                    partial(serve_peer, d), port)
    addr = listeners[0].socket.getsockname()
    return format_hostport(addr[0], addr[1])


async def serve_peer(d: Daemon, stream: trio.SocketStream) -> None:
    """Serve one control connection until it ends; nothing it does can stop
    the daemon."""
    remote = _remote(stream)
    pump = Pump(Connection("peer", RESPONDER, max_frame=d.config.max_frame),
                TrioStream(stream, f"caller {remote}"), f"caller {remote}")
    caller = Caller(remote, d.auth, d.node)
    # A caller that has not proved the token soon gets no more of our time
    # (nor a file descriptor to hold).
    proving = trio.CancelScope(deadline=math.inf if caller.authenticated
                               else trio.current_time() + _auth.AUTH_TIMEOUT_S)
    try:
        with proving:
            await _converse(d, pump, caller, proving)
        if proving.cancelled_caught:
            log.warning("peer.auth_timeout", caller=bounded(caller.name, 100), remote=remote,
                        seconds=_auth.AUTH_TIMEOUT_S)
    except ConnectionLost:
        return  # the caller went away
    except Exception as exc:  # this connection ends; the daemon serves on
        log.warning("peer.connection_failed", remote=remote, caller=bounded(caller.name, 100),
                    error=bounded(f"{type(exc).__name__}: {exc}"))
    finally:
        await pump.aclose()


async def _converse(d: Daemon, pump: Pump, caller: Caller, proving: trio.CancelScope) -> None:
    while True:
        try:
            msg = await pump.receive()
        except RemoteProtocolError as exc:
            log.warning("peer.protocol_error", remote=caller.remote, code=exc.code,
                        error=bounded(exc.message))
            await pump.send_error(exc)
            if exc.fatal:
                return
            continue
        if msg is None or msg.kind == "bye":
            return
        if msg.kind == "hello":
            if not await _welcome(d, pump, caller, msg):
                return
            continue
        try:
            if msg.kind != "auth":
                caller.require(msg.kind)
            outcome: dict[str, Any] | BaseException = HANDLERS[msg.kind](d, caller, msg)
        except P2PXferError as exc:
            outcome = exc
        except Exception as exc:  # a bug: answer "internal", keep serving
            log.error("request.crashed", remote=caller.remote, kind=msg.kind,
                      error=bounded(f"{type(exc).__name__}: {exc}"))
            outcome = exc
        await pump.answer(msg.id, outcome)
        if isinstance(outcome, BaseException) and is_fatal(wire_error(outcome)[0]):
            return  # auth_failed: said so, now hang up
        if caller.authenticated:
            proving.deadline = math.inf


async def _welcome(d: Daemon, pump: Pump, caller: Caller, msg: Message) -> bool:
    try:
        extra = caller.hello(msg)
    except P2PXferError as exc:
        log.warning("peer.bad_hello", remote=caller.remote, error=bounded(str(exc)))
        with contextlib.suppress(P2PXferError):
            code, text = wire_error(exc)
            await pump.send("error", id=None, code=code, message=bounded(f"hello: {text}"))
        return False
    await pump.send("welcome", extra, v=SCHEMA_VERSION, node=d.node,
                    incarnation=d.incarnation, max_frame=d.config.max_frame)
    _known(d, caller)
    return True


def _remote(stream: trio.SocketStream) -> str:
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return "?"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "?")
