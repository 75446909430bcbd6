"""The responder's half of the control port's credentials: the cluster
token's handshake, and the name a TLS certificate gives a caller.

A ``Caller`` is what one incoming control connection has said about itself.
With a token configured, the ``welcome`` carries our nonce and (when the
caller challenged us) our proof; the caller's ``auth`` must prove the token
for our nonce before anything else is served, within ``AUTH_TIMEOUT_S``.
With TLS, the caller's certificate (verified in the handshake, ``_tls``)
names it: a ``hello`` claiming another name is refused. Dialling and the
initiator's half are ``_dial``. What must not live here: what an
authenticated caller may ask (``_control``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from p2pxfer._pump import bounded
from p2pxfer.address import format_hostport, parse_hostport
from p2pxfer.errors import AuthenticationFailed
from p2pxfer.log import get_logger
from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import Message

from ._dial import NONCE_BYTES, nonce_ok

__all__ = ["AUTH_TIMEOUT_S", "Caller"]

log = get_logger("p2pxfer.daemon")

AUTH_TIMEOUT_S = 10.0  # a control connection must have said hello (and proved the token) by then


class Caller:
    """What one incoming control connection has said about itself."""

    def __init__(self, remote: str, auth: ClusterAuth | None, node: str) -> None:
        self.remote = remote
        self.remote_host = ""  # the address it calls from
        #: called once it is authenticated (``_admit``: it keeps its slot)
        self.admitted: Callable[[], None] = lambda: None
        self.auth = auth
        self.node = node  # ours
        self.authenticated = auth is None
        self.name = ""
        self.control = ""  # where it can be reached back (checked host:port), or ""
        self.nonce = b""  # the caller's challenge to us
        self.our_nonce = b""  # ours to it
        #: it proved the cluster token (never true on an open daemon)
        self.proved = False
        #: the names its TLS certificate carries (None: no TLS on this port)
        self.cert_names: tuple[str, ...] | None = None

    @property
    def trusted(self) -> bool:
        """It showed every credential this port asks for, and there is at
        least one (an open daemon trusts nobody, though it serves all)."""
        return self.authenticated and (self.proved or self.cert_names is not None)

    def hello(self, msg: Message) -> dict[str, Any]:
        """Take in a ``hello``; the extra fields of our ``welcome``. A control
        address that is not ``host:port`` raises ``InvalidArgument``; a name
        its TLS certificate does not carry, ``AuthenticationFailed`` (logged)."""
        self.name = msg.get("name", "")
        if self.cert_names is not None and self.name not in self.cert_names:
            log.warning("peer.auth_failed", caller=bounded(self.name, 100), remote=self.remote,
                        reason=f"its certificate names {list(self.cert_names)}")
            raise AuthenticationFailed(f"{self.node}: hello says {bounded(self.name, 100)!r}, "
                                       f"the certificate names {list(self.cert_names)}")
        control = msg.get("control", "")
        if control:
            host, port = parse_hostport(control, port_zero=False)
            self.control = format_hostport(host, port)
        self.nonce = msg.get("nonce", b"")
        extra: dict[str, Any] = {}
        if self.auth is not None:
            self.our_nonce = os.urandom(NONCE_BYTES)
            extra["nonce"] = self.our_nonce
            if nonce_ok(self.nonce):
                extra["proof"] = self.auth.connection_proof(
                    "responder", self.nonce, self.our_nonce, self.node)
        return extra

    def prove(self, proof: bytes) -> None:
        """The caller's answer to our challenge: right, and it is
        authenticated; wrong, ``AuthenticationFailed`` (logged)."""
        if self.auth is None:
            return  # nothing to prove here
        if self.our_nonce and nonce_ok(self.nonce) and self.auth.check_connection(
                "initiator", self.nonce, self.our_nonce, self.name, proof):
            self.authenticated = self.proved = True
            return
        log.warning("peer.auth_failed", caller=bounded(self.name, 100), remote=self.remote,
                    reason="wrong proof of the cluster token")
        raise AuthenticationFailed(f"{self.node}: wrong cluster token")

    def session_keys(self) -> tuple[bytes, bytes]:
        """(send, receive) MAC keys of this connection, as ``Connection.secure``
        takes them, once the caller proved the token."""
        assert self.auth is not None and self.proved
        to_us, to_them = self.auth.session_keys(self.nonce, self.our_nonce, self.name,
                                                self.node)
        return to_them, to_us

    def require(self, kind: str) -> None:
        """Refuse (logged) a request before the caller proved the token."""
        if self.authenticated:
            return
        log.warning("peer.auth_required", caller=bounded(self.name, 100), remote=self.remote,
                    request=kind)
        raise AuthenticationFailed(f"{self.node} requires the cluster token: authenticate "
                                   "(auth) before any request")
