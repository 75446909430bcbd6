"""The control port: peer daemons (and the bench) ask us over TCP.

One task per connection: with TLS configured the TLS 1.3 handshake
(``_tls``: the caller's certificate must come from the cluster CA), a
``Pump`` over the stream, the hello (strictly checked; with TLS its name must
be the certificate's) and the token handshake (``_auth``), then each request
dispatched through ``HANDLERS``, a table checked against the peer protocol's
requests when this module loads. Connections are admitted (``_admit``:
caps in all, per address, and for those not yet authenticated per source
range, oldest pending closed first) before any handshake; one must finish the TLS handshake and
say hello (and prove the token) within ``AUTH_TIMEOUT_S``, in frames of at
most 4 KiB until then; once it proved the token every frame both ways is
MACed (``Connection.secure``). A caller becomes a peer only if it showed the
port's credentials and calls from the address it gives. Whatever goes wrong
inside one connection (a failed TLS handshake too) ends that connection
alone, logged once (failed handshakes: once a second at most): never the
daemon. What must not live here: the region directory (``_regions``) or
dialling out (``_peers``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from p2pxfer._pump import ByteStream, Pump, TrioStream, bounded, where_raised
from p2pxfer.address import format_hostport, parse_hostport
from p2pxfer.errors import (
    AuthenticationFailed,
    ConnectionLost,
    InvalidArgument,
    P2PXferError,
    RegionWithdrawn,
    UnknownRegion,
)
from p2pxfer.log import get_logger
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
from ._regions import TICKET_BATCH
from ._tls import accept_tls

if TYPE_CHECKING:
    from ._daemon import Daemon

__all__ = ["HANDLERS", "serve_control", "serve_peer"]

log = get_logger("p2pxfer.daemon")

Handler = Callable[["Daemon", Caller, Message], dict[str, Any]]


def _auth_request(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    caller.prove(msg["proof"])  # the conversation is secured before the answer goes
    return {}


def _resolve(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    try:
        desc = d.regions.local_descriptor(msg["region"], for_peer=caller.name)
    except RegionWithdrawn:
        if caller.name != d.node:
            raise
        # This daemon asking itself (a peer entry whose address is our own
        # control port): the writer's uid is not known here, so it hears
        # what a uid the region did not admit would (``Exports.absent``).
        raise UnknownRegion(f"no region named {msg['region']!r} on {d.node}") from None
    slot = d.regions.slot(d.node, msg["region"])
    result: dict[str, Any] = {"descriptor": desc.to_wire(), "slot": slot}
    want = msg.get("tickets", 0)
    if want and caller.name in d.peers:  # held per peer: only known ones (bounded)
        result["tickets"] = d.imm_slots.tickets(slot, caller.name, min(want, TICKET_BATCH))
    if (layout := d.kv.layout_of(msg["region"])) is not None:
        result["kv"] = layout  # a KV pool: pushers need its layout
    return result


def _imm_tickets(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    if caller.name not in d.peers:
        return {"tickets": []}
    n = msg["n"]
    if not 0 < n <= TICKET_BATCH:
        raise InvalidArgument(f"imm_tickets: n must be within 1..{TICKET_BATCH}, got {n}")
    slot = d.regions.slot(d.node, msg["region"])
    return {"tickets": d.imm_slots.tickets(slot, caller.name, n)}


def _invalidate(d: Daemon, caller: Caller, msg: Message) -> dict[str, Any]:
    d.regions.forget(caller.name, msg["region"])
    return {}


HANDLERS: dict[str, Handler] = {
    "kv_begin": lambda d, caller, msg: d.kv.begin(caller.name, msg["pool"], msg["request"],
                                                  msg["layers"], msg["deadline_ms"],
                                                  msg.get("pieces")),
    "kv_expect": lambda d, caller, msg: d.kv.expect(caller.name, msg["slot"], msg["pieces"],
                                                    msg.get("first", 0)),
    "kv_arrived": lambda d, caller, msg: d.kv.arrived(caller.name, msg["pool"], msg["request"],
                                                      msg["layer"]),
    "kv_abandoned": lambda d, caller, msg: d.kv.abandon(caller.name, msg["pool"],
                                                        msg["request"], msg.get("reason", ""),
                                                        msg.get("landed", b"")),
    "imm_tickets": _imm_tickets,
    "notify_settle": lambda d, caller, msg: {
        "arrived": d.imm_slots.settle(msg["ticket"], caller.name, msg["imm"])},
    "auth": _auth_request,
    "resolve": _resolve,
    "invalidate": _invalidate,
    "status": lambda d, caller, msg: d.status(remote=True),
    "peers": lambda d, caller, msg: {"peers": d.peer_list()},
    "ping": lambda d, caller, msg: d.ping.answer(msg.get("offset"), msg.get("length")),
}
check_handlers(HANDLERS, PEER_REQUESTS, "the control port")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a host name proves nothing about where a caller is
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _same_host(a: str, b: str) -> bool:
    ia = _ip(a)
    return ia is not None and ia == _ip(b)


def _known(d: Daemon, caller: Caller) -> None:
    """A daemon that showed the port's credentials (the token, its
    certificate) can be reached back: no static world. Nobody else is learnt
    (an open daemon learns no peer this way), and only at the address it
    called from, while the table has room. With membership on, the members
    are the peers: a caller must not add itself."""
    if not (caller.trusted and caller.name and caller.control) or caller.name in d.peers \
            or d.follower.enabled:
        return
    host = parse_hostport(caller.control)[0]
    if not _same_host(host, caller.remote_host):
        log.warning("peer.not_learnt", caller=bounded(caller.name, 100), remote=caller.remote,
                    control=caller.control, reason="not the address it called from")
        return
    try:
        d.peers.add(caller.name, caller.control)
    except InvalidArgument as exc:  # the table is full
        log.warning("peer.not_learnt", caller=bounded(caller.name, 100), remote=caller.remote,
                    reason=str(exc))


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
    remote_host, remote = _remote(stream)
    admission = d.admission
    ticket = admission.admit(remote_host)
    if ticket is None:
        skipped = d.refusals.due(trio.current_time())
        if skipped is not None:
            log.warning("peer.refused", remote=remote, connections=admission.total,
                        from_host=admission.per_host[remote_host], not_logged=skipped)
        with trio.CancelScope(shield=True):
            await stream.aclose()
        return
    where = f"caller {remote}"
    transport: ByteStream = TrioStream(stream, where)
    caller = Caller(remote, d.auth, d.node)
    caller.remote_host = remote_host
    # A caller that has not said hello (and proved the token, if one is set)
    # soon gets no more of our time, nor a file descriptor to hold.
    proving = trio.CancelScope(deadline=trio.current_time() + _auth.AUTH_TIMEOUT_S)
    caller.admitted = partial(admission.authenticated, ticket)
    try:
        with ticket.scope, proving:
            if d.tls is not None:
                tls = await accept_tls(stream, d.tls, where)
                transport, caller.cert_names = tls, tls.peer_names()
            pump = Pump(Connection("peer", RESPONDER, max_frame=d.config.max_frame),
                        transport, where)
            await _converse(d, pump, caller, proving)
        if ticket.evicted:
            skipped = d.refusals.due(trio.current_time())
            if skipped is not None:
                log.warning("peer.evicted", remote=remote, not_logged=skipped,
                            reason="unauthenticated, and the oldest pending connection "
                                   "where a newer one needed the room")
        elif proving.cancelled_caught:
            log.warning("peer.auth_timeout", caller=bounded(caller.name, 100), remote=remote,
                        seconds=_auth.AUTH_TIMEOUT_S)
    except AuthenticationFailed as exc:  # the TLS handshake (or an alert after it)
        skipped = d.tls_refusals.due(trio.current_time())
        if skipped is not None:
            log.warning("peer.tls_failed", remote=remote, error=bounded(str(exc)),
                        not_logged=skipped)
    except ConnectionLost:
        return  # the caller went away
    except Exception as exc:  # this connection ends; the daemon serves on
        log.warning("peer.connection_failed", remote=remote, caller=bounded(caller.name, 100),
                    error=bounded(f"{type(exc).__name__}: {exc}"))
    finally:
        admission.release(ticket)
        await transport.aclose()


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
        if msg.kind == "error":  # the caller ends the connection, saying why
            log.info("peer.error_received", remote=caller.remote,
                     code=bounded(str(msg.get("code")), 100),
                     error=bounded(str(msg.get("message"))))
            return
        if msg.kind == "hello":
            if not await _welcome(d, pump, caller, msg, proving):
                return
            continue
        try:
            if msg.kind != "auth":
                caller.require(msg.kind)
            outcome: dict[str, Any] | BaseException = HANDLERS[msg.kind](d, caller, msg)
            if msg.kind == "auth" and caller.proved and not pump.conn.secured:
                # From the answer on, every frame both ways carries a MAC.
                pump.conn.secure(*caller.session_keys())
                pump.conn.lift_frame_limit()
                _known(d, caller)
        except P2PXferError as exc:
            outcome = exc
        except Exception as exc:  # a bug: answer "internal", keep serving
            log.error("request.crashed", remote=caller.remote, kind=msg.kind,
                      error=bounded(f"{type(exc).__name__}: {exc}"), where=where_raised(exc))
            outcome = exc
        await pump.answer(msg.id, outcome)
        if isinstance(outcome, BaseException) and is_fatal(wire_error(outcome)[0]):
            return  # auth_failed: said so, now hang up
        if caller.proved:
            proving.deadline = math.inf
            caller.admitted()


async def _welcome(d: Daemon, pump: Pump, caller: Caller, msg: Message,
                   proving: trio.CancelScope) -> bool:
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
    if caller.authenticated:  # open, or TLS alone: nothing more to prove
        pump.conn.lift_frame_limit()
        proving.deadline = math.inf
        caller.admitted()
        _known(d, caller)  # its certificate named it (an open daemon learns nobody)
    return True


def _remote(stream: trio.SocketStream) -> tuple[str, str]:
    """(source host, "host:port") of a caller."""
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return "?", "?"
    if isinstance(peer, tuple):
        return str(peer[0]), f"{peer[0]}:{peer[1]}"
    return str(peer or "?"), str(peer or "?")
