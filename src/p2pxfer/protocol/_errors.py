"""Protocol errors: ours (we tried to send something illegal) vs theirs (the
peer sent something illegal). Each carries a wire ``code`` and whether the
connection must close."""

from __future__ import annotations

from p2pxfer.errors import P2PXferError

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ProtocolError(P2PXferError):
    def __init__(self, code: str, message: str, *, fatal: bool = True,
                 request_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.fatal = fatal
        self.request_id = request_id


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids in this state."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed or out of place. ``fatal`` errors
    close the connection; others are answered with an error frame."""
