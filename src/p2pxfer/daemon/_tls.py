"""Mutual TLS 1.3 on the control port: the ``ssl`` contexts made from a
daemon's ``tls_ca`` / ``tls_cert`` / ``tls_key``, and the handshakes of both
ends over ``trio.SSLStream``.

Both ends present a certificate from the cluster CA and verify the other's
against it (TLS 1.3 only, no session tickets: every connection verifies a
certificate). Names are checked here, not by ``ssl``: a node name need not be
a host name, and what a name must match is known only to the caller (the
node it dialled) or after the ``hello`` (the name it claims), so the contexts
leave hostname checking off and the handshakes return the names the other
end's certificate carries. TLS failures are mapped at this edge, once: a
refused certificate is ``AuthenticationFailed``, a connection that broke is
``ConnectionLost``. What must not live here: making certificates
(``p2pxfer.certs``), the token handshake (``_auth``, ``_dial``).
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass

import trio

from p2pxfer._pump import TrioStream, bounded
from p2pxfer.certs import check_node
from p2pxfer.errors import AuthenticationFailed, ConfigError, ConnectionLost
from p2pxfer.log import get_logger

from ._config import DaemonConfig

__all__ = ["CLOSE_NOTIFY_S", "TlsCredentials", "TlsStream", "accept_tls", "config_tls",
           "connect_tls", "load_tls"]

log = get_logger("p2pxfer.daemon")

#: at most this long saying close_notify on the way out: a caller that stops
#: reading must not hold our task (and its descriptor) open
CLOSE_NOTIFY_S = 1.0
# SSLErrors that only say the connection ended (not that anyone refused anything)
_ENDED = (ssl.SSLEOFError, ssl.SSLSyscallError, ssl.SSLZeroReturnError)


@dataclass(frozen=True)
class TlsCredentials:
    """One daemon's (or the bench's) TLS credentials, ready to use."""

    name: str  # the node name our certificate carries (we say it in hello)
    server: ssl.SSLContext
    client: ssl.SSLContext


def _context(purpose: int, ca: str, cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if purpose == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # the node name is checked by the caller (connect_tls)
    else:
        ctx.num_tickets = 0  # no resumption: each connection shows its certificate
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        ctx.load_verify_locations(cafile=ca)
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tls_cert {cert} / tls_key {key} / tls_ca {ca}: "
                          f"{bounded(str(exc), 200)}") from exc
    return ctx


def load_tls(ca: str, cert: str, key: str, *, node: str | None = None) -> TlsCredentials:
    """Credentials from the three files, checked first (``ConfigError``
    naming the file: missing, unreadable, not what it should be, the key not
    the certificate's, not signed by the CA, not valid now, not naming
    ``node``)."""
    info = check_node(ca, cert, key, node=node)
    try:
        mode = os.stat(key).st_mode
    except OSError:
        mode = 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("tls.key_mode", key=key, mode=oct(stat.S_IMODE(mode)),
                    advice="chmod 600: anyone who reads the key can act as this node")
    name = node if node is not None else info.names[0] if info.names else ""
    return TlsCredentials(name, _context(ssl.PROTOCOL_TLS_SERVER, ca, cert, key),
                          _context(ssl.PROTOCOL_TLS_CLIENT, ca, cert, key))


def config_tls(config: DaemonConfig) -> TlsCredentials | None:
    """A daemon's credentials (its certificate must name its node); None
    without ``tls_cert``."""
    if not config.tls:
        return None
    return load_tls(config.tls_ca, config.tls_cert, config.tls_key, node=config.node)


def reason(exc: BaseException) -> str:
    """What a TLS failure says, short (the OpenSSL reason, or why the
    certificate did not verify)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"certificate refused: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):
        return str(cause.reason or cause)
    return bounded(f"{type(cause).__name__}: {cause}", 200)


def _refused(exc: BaseException) -> bool:
    """A TLS failure that is somebody's refusal (an alert, a certificate that
    did not verify), not a connection that ended."""
    cause = exc.__cause__
    return isinstance(cause, ssl.SSLError) and not isinstance(cause, _ENDED)


class TlsStream(TrioStream):
    """A ``trio.SSLStream`` as the pump's byte stream. An alert from the
    other end (it refused our certificate: TLS 1.3 says so only after our
    handshake finished) raises ``AuthenticationFailed``; any other break
    reads as the end. Closing sends close_notify for at most
    ``CLOSE_NOTIFY_S``, then closes the socket regardless."""

    stream: trio.SSLStream[trio.SocketStream]

    async def receive_some(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some())
        except trio.BrokenResourceError as exc:
            if _refused(exc):
                raise AuthenticationFailed(f"{self.where}: TLS: {reason(exc)}") from exc
            return b""
        except (trio.ClosedResourceError, OSError):
            return b""

    async def aclose(self) -> None:
        # Cut short, SSLStream.aclose closes the socket without close_notify.
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_NOTIFY_S):
            await self.stream.aclose()

    def peer_names(self) -> tuple[str, ...]:
        """The DNS names of the other end's (verified) certificate."""
        cert = self.stream.getpeercert() or {}
        return tuple(str(v) for k, v in cert.get("subjectAltName", ()) if k == "DNS")


async def accept_tls(stream: trio.SocketStream, creds: TlsCredentials, where: str
                     ) -> TlsStream:
    """Our side of an incoming connection's handshake; ``AuthenticationFailed``
    (with the reason) when it fails for whatever cause: the socket is closed
    then. Cancelled: the socket is closed and nothing is logged."""
    tls = TlsStream(trio.SSLStream(stream, creds.server, server_side=True), where)
    try:
        await tls.stream.do_handshake()
    except trio.BrokenResourceError as exc:
        await tls.aclose()
        raise AuthenticationFailed(f"{where}: TLS handshake failed: {reason(exc)}") from exc
    except BaseException:
        await tls.aclose()
        raise
    return tls


async def connect_tls(stream: trio.SocketStream, creds: TlsCredentials, where: str
                      ) -> TlsStream:
    """Our side of a dialled connection's handshake. A server certificate
    that does not verify (or an alert) is ``AuthenticationFailed``; a
    connection that ends during it, ``ConnectionLost``. The socket is closed
    on any failure."""
    tls = TlsStream(trio.SSLStream(stream, creds.client, server_hostname=None), where)
    try:
        await tls.stream.do_handshake()
    except trio.BrokenResourceError as exc:
        await tls.aclose()
        if _refused(exc):
            log.warning("peer.auth_failed", peer=where, reason=f"TLS: {reason(exc)}")
            raise AuthenticationFailed(f"{where}: TLS: {reason(exc)}") from exc
        raise ConnectionLost(f"{where}: closed during the TLS handshake") from exc
    except BaseException:
        await tls.aclose()
        raise
    return tls
