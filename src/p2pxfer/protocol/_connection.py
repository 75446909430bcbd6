"""The sans-IO connection: bytes in -> messages out, messages in -> bytes out.

The daemon, the client and the tests all drive this same object; it never
touches a socket, a thread or trio. File descriptors passed with SCM_RIGHTS
travel beside the bytes and are the I/O layer's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ._errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ._frames import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame
from ._messages import CLIENT_REQUESTS, PEER_REQUESTS, SCHEMA_VERSION, Message, validate
from ._state import INITIATOR, RESPONDER, State, is_reply, transition

__all__ = ["CLOSED", "NEED_DATA", "Connection"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = _Sentinel("NEED_DATA")
CLOSED: Final = _Sentinel("CLOSED")

PROTOCOLS = {"client": CLIENT_REQUESTS, "peer": PEER_REQUESTS}


class Connection:
    """One end of a client<->daemon ("client") or daemon<->daemon ("peer")
    conversation. ``our_role`` is INITIATOR (says hello, sends requests) or
    RESPONDER (welcomes, replies)."""

    def __init__(self, protocol: str, our_role: str, *,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if protocol not in PROTOCOLS or our_role not in (INITIATOR, RESPONDER):
            raise ValueError(f"bad protocol {protocol!r} or role {our_role!r}")
        self.protocol = protocol
        self.our_role = our_role
        self.their_role = RESPONDER if our_role == INITIATOR else INITIATOR
        self.requests = PROTOCOLS[protocol]
        self.state = State.IDLE
        self.max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)
        self._eof = False
        self._outstanding: set[int] = set()
        self._next_id = 1

    # -- outgoing -------------------------------------------------------------

    def next_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def send(self, msg: Message | str, fields: Mapping[str, Any] | None = None,
             **kw: Any) -> bytes:
        """Encode a message we send, checking it is legal now."""
        if isinstance(msg, str):
            msg = Message(msg, {**(fields or {}), **kw})
        msg = validate(msg.to_wire(), remote=False)
        self._advance(self.our_role, msg, LocalProtocolError)
        return encode_frame(msg.to_wire(), self.max_frame)

    def send_error(self, err: ProtocolError) -> bytes:
        """The error frame that answers ``err`` (a fatal one closes us)."""
        msg = Message("error", {"id": err.request_id, "code": err.code, "message": err.message})
        if err.request_id is not None and err.request_id in self._outstanding and not err.fatal:
            return self.send(msg)
        self.state = State.CLOSED
        return encode_frame(msg.to_wire(), self.max_frame)

    # -- incoming -------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer; ``b""`` means end of stream."""
        if data:
            self._decoder.feed(data)
        else:
            self._eof = True

    def next_event(self) -> Message | _Sentinel:
        """The next message, NEED_DATA, or CLOSED. Raises RemoteProtocolError
        for anything malformed or out of place (``fatal`` says whether the
        connection is over; ``request_id`` which request to answer if not)."""
        if self.state is State.CLOSED:
            return CLOSED
        try:
            obj = self._decoder.next_frame()
        except RemoteProtocolError:
            self.state = State.CLOSED
            raise
        if obj is None:
            if self._eof:
                truncated = self._decoder.buffered
                self.state = State.CLOSED
                if truncated:
                    raise RemoteProtocolError("bad_frame", f"stream ended inside a frame "
                                              f"({truncated} bytes buffered)")
                return CLOSED
            return NEED_DATA
        try:
            msg = validate(obj, remote=True)
        except RemoteProtocolError as exc:
            if exc.fatal:
                self.state = State.CLOSED
            elif exc.request_id is not None and self.our_role == RESPONDER:
                # Answerable: it still counts as a request we owe a reply.
                self._outstanding.add(exc.request_id)
            raise
        self._advance(self.their_role, msg, RemoteProtocolError)
        return msg

    # -- shared ---------------------------------------------------------------

    def _advance(self, sender: str, msg: Message, err: type[ProtocolError]) -> None:
        nxt = transition(self.state, sender, msg.kind, self.requests)
        if nxt is None:
            if err is RemoteProtocolError:
                self.state = State.CLOSED
            raise err("unexpected", f"{sender} may not send {msg.kind!r} in state "
                      f"{self.state.value} of the {self.protocol} protocol")
        if msg.kind == "hello":
            self._check_version(msg, err)
        if msg.kind in self.requests:
            rid = msg.id
            if rid is None or rid in self._outstanding:
                if err is RemoteProtocolError:
                    self.state = State.CLOSED
                raise err("bad_request", f"request id {rid!r} is missing or already in use")
            self._outstanding.add(rid)
        elif is_reply(msg.kind) and self.state is State.READY:
            rid = msg.id
            if rid is not None:
                if rid not in self._outstanding:
                    if err is RemoteProtocolError:
                        self.state = State.CLOSED
                    raise err("unexpected", f"reply to unknown request id {rid}")
                self._outstanding.discard(rid)
            elif msg.kind == "error":
                nxt = State.CLOSED  # a connection-level error ends the conversation
        self.state = nxt

    def _check_version(self, msg: Message, err: type[ProtocolError]) -> None:
        if msg["v"] != SCHEMA_VERSION:
            if err is RemoteProtocolError:
                self.state = State.CLOSED
            raise err("bad_version", f"schema version {msg['v']} is not supported "
                      f"(this side speaks {SCHEMA_VERSION})")
        if msg["role"] != ("client" if self.protocol == "client" else "daemon"):
            if err is RemoteProtocolError:
                self.state = State.CLOSED
            raise err("unexpected", f"role {msg['role']!r} does not speak the "
                      f"{self.protocol} protocol")

    @property
    def outstanding(self) -> frozenset[int]:
        return frozenset(self._outstanding)
