"""Dialling a daemon's control port: ``dial_peer``, the one way to open a
control connection, used by the daemon's peer links and by the bench (which
asks a peer for a region's descriptor the way daemons ask each other).

With a cluster token the handshake is mutual (``proto/PROTOCOL.md``): our
``hello`` carries a nonce, the ``welcome`` the daemon's nonce and its proof,
we check that proof and that the daemon is the node we meant, then prove
ourselves with ``auth``; every frame after that ``auth``, both ways, carries a
MAC under this connection's keys (``ClusterAuth.session_keys``). With TLS
credentials the connection is mutual TLS 1.3 first (``_tls``): the daemon's
certificate must name the node we meant (``expect``) and the node its
``welcome`` says it is; token and TLS may be used together. The connection
is handed over only once all of that passed. What must not live here: what a
caller then asks.
"""

from __future__ import annotations

import os

import trio

from p2pxfer._pump import ByteStream, Pump, TrioStream
from p2pxfer.address import parse_hostport
from p2pxfer.errors import AuthenticationFailed
from p2pxfer.log import get_logger
from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import DEFAULT_MAX_FRAME, INITIATOR, SCHEMA_VERSION, Connection

from ._tls import TlsCredentials, connect_tls

__all__ = ["NONCE_BYTES", "dial_peer", "nonce_ok"]

log = get_logger("p2pxfer.daemon")

NONCE_BYTES = 16


def nonce_ok(nonce: bytes) -> bool:
    return NONCE_BYTES <= len(nonce) <= 64


async def dial_peer(address: str, *, name: str, expect: str | None = None,
                    auth: ClusterAuth | None = None, tls: TlsCredentials | None = None,
                    control: str = "", max_frame: int = DEFAULT_MAX_FRAME) -> Pump:
    """A ready control connection to the daemon at ``address`` (``host:port``),
    introducing ourselves as ``name`` (and, for a daemon, the ``control``
    address it can reach us back at). With ``auth``, both sides prove the
    cluster token; with ``tls``, both show a certificate of the cluster CA
    (ours must name ``name``). With either, the daemon must be ``expect``
    (when given): ``AuthenticationFailed`` otherwise. Connection failures
    raise ``OSError`` (or ``ConnectionLost``); the caller bounds the time."""
    host, port = parse_hostport(address, port_zero=False)
    where = expect or address
    label = f"peer {where} at {address}"
    stream = await trio.open_tcp_stream(host, port)
    transport: ByteStream = TrioStream(stream, label)
    names: tuple[str, ...] = ()
    if tls is not None:
        transport = tls_stream = await connect_tls(stream, tls, label)
        names = tls_stream.peer_names()
    pump = Pump(Connection("peer", INITIATOR, max_frame=max_frame), transport, where)
    try:
        if tls is not None and expect is not None and expect not in names:
            log.warning("peer.auth_failed", peer=expect, remote=address,
                        reason=f"its certificate names {list(names)}")
            raise AuthenticationFailed(f"peer {expect} at {address}: its certificate names "
                                       f"{list(names)}, not {expect!r}")
        nonce = os.urandom(NONCE_BYTES) if auth is not None else b""
        extra: dict[str, object] = {"nonce": nonce} if nonce else {}
        if control:
            extra["control"] = control
        welcome = await pump.hello(v=SCHEMA_VERSION, role="daemon", name=name, **extra)
        node = welcome["node"]
        if (auth is not None or tls is not None) and expect is not None and node != expect:
            log.warning("peer.auth_failed", peer=expect, remote=address,
                        reason=f"the peer says it is {node!r}")
            raise AuthenticationFailed(f"peer {expect} at {address} says it is {node!r}")
        if tls is not None and node not in names:
            log.warning("peer.auth_failed", peer=where, remote=address,
                        reason=f"it says it is {node!r}, its certificate names {list(names)}")
            raise AuthenticationFailed(f"peer {where} at {address} says it is {node!r}; its "
                                       f"certificate names {list(names)}")
        if auth is None:
            return pump
        theirs = welcome.get("nonce", b"")
        if not (nonce_ok(theirs) and auth.check_connection(
                "responder", nonce, theirs, node, welcome.get("proof", b""))):
            log.warning("peer.auth_failed", peer=where, remote=address,
                        reason="the peer did not prove the cluster token")
            raise AuthenticationFailed(f"peer {where} at {address} did not prove the "
                                       "cluster token")
        proof = auth.connection_proof("initiator", nonce, theirs, name)
        rid = pump.conn.next_id()
        await pump.send("auth", id=rid, proof=proof)
        # The answer, and everything after it, comes MACed.
        pump.conn.secure(*auth.session_keys(nonce, theirs, name, node))
        pump.result(await pump.reply(rid))
    except BaseException:
        await pump.aclose()
        raise
    return pump
