"""Protocol errors, and the one table of error codes.

``ProtocolError``: ours (we tried to send something illegal) vs theirs (the
peer sent something illegal); each carries a wire ``code`` and whether the
connection must close. ``ERRORS`` maps every code of ``proto/PROTOCOL.md``
to the exception class a receiver raises and whether the conversation ends
with it; the daemon (exception -> code, ``wire_error``) and the client (code
-> exception, ``error_from_wire``) both derive from it, so the two directions
round-trip. What must not live here: I/O, or deciding what to answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from p2pxfer.errors import (
    AuthenticationFailed,
    DaemonError,
    DeviceError,
    EngineClosed,
    Forbidden,
    InvalidArgument,
    LimitExceeded,
    NameTaken,
    NotificationUnknown,
    P2PXferError,
    PeerLost,
    PeerUnreachable,
    RailFailedUnderImmediates,
    RailsExhausted,
    RegionWithdrawn,
    ScatterError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    UnknownPeer,
    UnknownRegion,
    UnregisteredMemory,
)

__all__ = ["ERRORS", "LocalProtocolError", "ProtocolError", "RemoteProtocolError",
           "error_from_wire", "wire_error"]


class ProtocolError(P2PXferError):
    def __init__(self, code: str, message: str, *, fatal: bool = True,
                 request_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.fatal = fatal
        self.request_id = request_id
        #: the request kind a non-fatal error answers (its frame named one)
        self.kind: str | None = None


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids in this state."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed or out of place. ``fatal`` errors
    close the connection; others are answered with an error frame."""


#: codes ``Connection`` raises itself (always fatal: the error goes out with no id)
PROTOCOL_CODES = ("bad_frame", "too_big", "unknown_type", "bad_version", "unexpected")

# The classes a receiver raises, each with its own ``code``; ``bad_request``
# (``InvalidArgument``) is answered and the conversation goes on, except when
# ``Connection`` raises it for a message without a usable id (then fatal).
_ANSWERS: tuple[tuple[type[P2PXferError], bool], ...] = (
    (InvalidArgument, False),
    (RegionWithdrawn, False),
    (UnknownRegion, False),
    (UnregisteredMemory, False),
    (DeviceError, False),
    (ScatterError, False),
    (NameTaken, False),
    (UnknownPeer, False),
    (PeerUnreachable, False),
    # The peer protocol's conversation ends with it (the daemon hangs up after
    # saying so); a client hears it relayed, as a plain answer.
    (AuthenticationFailed, True),
    (Forbidden, False),
    (PeerLost, False),
    # What a write's caller must act on, each told apart: whether the data
    # landed, whether the receiver's count can be trusted, whether to retry.
    (RailsExhausted, False),
    (NotificationUnknown, False),
    (RailFailedUnderImmediates, False),
    (TransferAborted, False),
    (TransferTimeout, False),
    (TransferError, False),
    (EngineClosed, False),
    (LimitExceeded, False),
    (DaemonError, False),  # "internal"
)


def _table() -> Mapping[str, tuple[type[P2PXferError], bool]]:
    table: dict[str, tuple[type[P2PXferError], bool]] = {
        code: (ProtocolError, True) for code in PROTOCOL_CODES}
    for cls, fatal in _ANSWERS:
        code = cls.code  # type: ignore[attr-defined]
        assert code not in table, f"error code {code!r} has two classes"
        table[code] = (cls, fatal)
    return MappingProxyType(table)


#: code -> (exception class, whether the conversation ends with it)
ERRORS = _table()
_WIRE = tuple({cls for cls, _ in ERRORS.values() if cls is not ProtocolError})


def error_from_wire(code: str, message: str, where: str = "") -> P2PXferError:
    """The exception a receiver raises for an ``error`` frame, its text
    "WHERE: message" (without ``where``: "CODE: message"). A code this
    version does not know becomes a ``DaemonError`` that keeps it."""
    cls, fatal = ERRORS.get(code, (DaemonError, False))
    if issubclass(cls, ProtocolError):  # says "CODE: ..." by itself
        return cls(code, f"{where}: {message}" if where else message, fatal=fatal)
    text = f"{where or code}: {message}"
    if cls is DaemonError:
        return DaemonError(text, code=code)
    return cls(text)


def wire_error(exc: BaseException) -> tuple[str, str]:
    """The ``(code, message)`` an ``error`` frame carries for ``exc``: the code
    of the most specific class in ``ERRORS`` it is an instance of, else
    ``internal`` (with the exception's type, to find the bug by)."""
    if isinstance(exc, ProtocolError):
        return exc.code, exc.message
    if isinstance(exc, _WIRE):
        code = getattr(exc, "code", "internal")
        return (code if isinstance(code, str) else "internal"), str(exc)
    return "internal", f"{type(exc).__name__}: {exc}"


def is_fatal(code: str) -> bool:
    """Whether the conversation ends with an error of ``code``."""
    return ERRORS.get(code, (DaemonError, False))[1]


def check_handlers(kinds: Iterable[str], requests: frozenset[str], where: str) -> None:
    """A table of request handlers must cover exactly ``requests`` (a
    protocol's request kinds): checked when the module defining it loads."""
    have = frozenset(kinds)
    if have != requests:
        raise LocalProtocolError("unexpected", f"{where}: handlers for {sorted(have)} do "
                                 f"not match the protocol's requests {sorted(requests)} "
                                 f"(missing {sorted(requests - have)}, extra "
                                 f"{sorted(have - requests)})")
