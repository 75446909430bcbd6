"""The sans-IO connection: bytes in -> messages out, messages in -> bytes out.

The daemon, the client and the tests all drive this same object; it never
touches a socket, a thread or trio. File descriptors passed with SCM_RIGHTS
travel beside the bytes and are the I/O layer's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ._errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ._frames import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    FrameDecoder,
    FrameMac,
    encode_frame,
)
from ._messages import CLIENT_REQUESTS, PEER_REQUESTS, SCHEMA_VERSION, Message, validate
from ._transitions import INITIATOR, RESPONDER, State, is_reply, transition

__all__ = ["CLOSED", "NEED_DATA", "Connection"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = _Sentinel("NEED_DATA")
CLOSED: Final = _Sentinel("CLOSED")

PROTOCOLS = {"client": CLIENT_REQUESTS, "peer": PEER_REQUESTS}

#: maps and arrays one frame a responder receives may hold: requests are flat
#: maps, so this is generous, and it keeps a 16 MiB frame of empty maps from
#: becoming gigabytes of dicts
RESPONDER_MAX_CONTAINERS = 64
#: the same bound on answers a daemon reads from its peers (they are as
#: hostile as requests until proven otherwise), larger because answers nest
#: more (``peers``, a remote ``status``); clients trust their own daemon
PEER_ANSWER_MAX_CONTAINERS = 16384


class Connection:
    """One end of a client<->daemon ("client") or daemon<->daemon ("peer")
    conversation. ``our_role`` is INITIATOR (says hello, sends requests) or
    RESPONDER (welcomes, replies).

    Until the other end is known, frames may be at most ``handshake_max_frame``
    bytes: an initiator lifts that limit when the ``welcome`` arrives, a
    responder when its I/O layer calls ``lift_frame_limit`` (a client whose
    credentials passed, a peer that proved the cluster token). After
    ``secure`` every frame both ways carries a MAC with a sequence number."""

    def __init__(self, protocol: str, our_role: str, *,
                 max_frame: int = DEFAULT_MAX_FRAME,
                 handshake_max_frame: int = HANDSHAKE_MAX_FRAME) -> None:
        if protocol not in PROTOCOLS or our_role not in (INITIATOR, RESPONDER):
            raise ValueError(f"bad protocol {protocol!r} or role {our_role!r}")
        self.protocol = protocol
        self.our_role = our_role
        self.their_role = RESPONDER if our_role == INITIATOR else INITIATOR
        self.requests = PROTOCOLS[protocol]
        self.state = State.IDLE
        self.max_frame = max_frame  # what we accept
        self.send_max_frame = max_frame  # what the peer accepts (welcome may lower it)
        self._decoder = FrameDecoder(
            min(max_frame, handshake_max_frame),
            max_containers=RESPONDER_MAX_CONTAINERS if our_role == RESPONDER
            else PEER_ANSWER_MAX_CONTAINERS if protocol == "peer" else None)
        self._send_mac: FrameMac | None = None
        self._eof = False
        self._outstanding: set[int] = set()
        self._next_id = 1

    # -- limits and keys ------------------------------------------------------

    def lift_frame_limit(self) -> None:
        """Accept frames up to ``max_frame`` from now on (the other end is known)."""
        self._decoder.max_frame = self.max_frame

    @property
    def frame_limit(self) -> int:
        """The largest frame body accepted right now."""
        return self._decoder.max_frame

    def secure(self, send_key: bytes, receive_key: bytes) -> None:
        """From now on every frame we send carries a MAC under ``send_key`` and
        every frame we receive must carry one under ``receive_key`` (each with
        its own sequence number): a changed, injected, dropped or replayed
        frame is a fatal ``auth_failed``."""
        self._send_mac = FrameMac(send_key)
        self._decoder.mac = FrameMac(receive_key)

    @property
    def secured(self) -> bool:
        return self._send_mac is not None

    # -- outgoing -------------------------------------------------------------

    def next_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def send(self, msg: Message | str, fields: Mapping[str, Any] | None = None,
             **kw: Any) -> bytes:
        """Encode a message we send, checking it is legal now. A refused
        message changes nothing."""
        wire = ({"t": msg, **(fields or {}), **kw} if isinstance(msg, str)
                else msg.to_wire())
        checked = validate(wire, remote=False)
        state = self.state
        rid = checked.id
        # What _advance may change, to put back if encoding fails: the state
        # and this message's id (added by a request, removed by a reply).
        had = rid in self._outstanding
        self._advance(self.our_role, checked, LocalProtocolError)
        try:
            return encode_frame(wire, self.send_max_frame, self._send_mac)
        except LocalProtocolError:
            self.state = state
            if rid is not None:
                if had:
                    self._outstanding.add(rid)
                else:
                    self._outstanding.discard(rid)
            raise

    def send_error(self, err: ProtocolError) -> bytes:
        """The error frame answering ``err``. A non-fatal error answers its
        request and keeps the conversation; a fatal one goes out with no id
        (connection-level) and closes us."""
        rid = err.request_id
        if not err.fatal and rid is not None and rid in self._outstanding:
            return self.send("error", id=rid, code=err.code, message=err.message)
        self.state = State.CLOSED
        frame = {"t": "error", "id": None, "code": err.code, "message": err.message}
        try:
            return encode_frame(frame, self.send_max_frame, self._send_mac)
        except LocalProtocolError:
            return encode_frame({**frame, "message": err.message[:200]}, self.send_max_frame,
                                self._send_mac)

    # -- incoming -------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer; ``b""`` means end of stream."""
        if data:
            self._decoder.feed(data)
        else:
            self._eof = True

    def next_event(self) -> Message | _Sentinel:
        """The next message, NEED_DATA, or CLOSED. Raises RemoteProtocolError
        for anything malformed or out of place: ``fatal`` ones close the
        connection; others carry the ``request_id`` to answer."""
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
            self._triage(exc, obj.get("t"))
            raise
        self._advance(self.their_role, msg, RemoteProtocolError)
        return msg

    def _triage(self, exc: RemoteProtocolError, kind: Any) -> None:
        """A malformed request may be answered (and the conversation go on)
        only by a responder, in READY, for one of this protocol's request
        kinds with an id not already in use. Anything else is fatal."""
        rid = exc.request_id
        answerable = (
            exc.code == "bad_request" and self.our_role == RESPONDER
            and self.state is State.READY and kind in self.requests
            and rid is not None and rid not in self._outstanding
        )
        if answerable:
            assert rid is not None
            exc.fatal = False
            exc.kind = kind
            self._outstanding.add(rid)  # we owe it a reply
        else:
            exc.fatal = True
            exc.request_id = None
            self.state = State.CLOSED

    # -- shared ---------------------------------------------------------------

    def _fail(self, err: type[ProtocolError], code: str, message: str) -> ProtocolError:
        if err is RemoteProtocolError:
            self.state = State.CLOSED
        return err(code, message)

    def _advance(self, sender: str, msg: Message, err: type[ProtocolError]) -> None:
        state = self.state
        rid = msg.id
        if state is State.READY and rid is not None:
            # The common cases, as the table says (``transition``): a request
            # from the initiator, a reply from the responder to an id owed.
            if sender == INITIATOR and msg.kind in self.requests:
                if rid not in self._outstanding:
                    self._outstanding.add(rid)
                    return
            elif sender == RESPONDER and is_reply(msg.kind) and rid in self._outstanding:
                self._outstanding.discard(rid)
                return
        if msg.kind == "error" and msg.id is None and state is not State.CLOSED:
            self.state = State.CLOSED  # a connection-level error, from either side
            return
        nxt = transition(state, sender, msg.kind, self.requests)
        if nxt is None:
            raise self._fail(err, "unexpected", f"{sender} may not send {msg.kind!r} in "
                             f"state {state.value} of the {self.protocol} protocol")
        if msg.kind == "hello":
            self._check_hello(msg, err)
        elif msg.kind == "welcome":
            if msg["v"] != SCHEMA_VERSION:
                raise self._fail(err, "bad_version", f"welcome speaks schema version "
                                 f"{msg['v']}, not {SCHEMA_VERSION}")
            if sender == self.their_role:
                self.send_max_frame = min(self.send_max_frame, msg["max_frame"])
                self.lift_frame_limit()  # we know whom we called
        if msg.kind in self.requests:
            rid = msg.id
            if rid is None or rid in self._outstanding:
                raise self._fail(err, "bad_request", f"request id {msg.get('id')!r} is "
                                 "missing or already in use")
            self._outstanding.add(rid)
        elif is_reply(msg.kind):
            rid = msg.id
            assert rid is not None  # id-less errors were handled above
            if rid not in self._outstanding:
                raise self._fail(err, "unexpected", f"reply to unknown request id {rid}")
            self._outstanding.discard(rid)
        self.state = nxt

    def _check_hello(self, msg: Message, err: type[ProtocolError]) -> None:
        if msg["v"] != SCHEMA_VERSION:
            raise self._fail(err, "bad_version", f"schema version {msg['v']} is not "
                             f"supported (this side speaks {SCHEMA_VERSION})")
        if msg["role"] != ("client" if self.protocol == "client" else "daemon"):
            raise self._fail(err, "unexpected", f"role {msg['role']!r} does not speak the "
                             f"{self.protocol} protocol")

    @property
    def outstanding(self) -> frozenset[int]:
        return frozenset(self._outstanding)
