"""Every message of both protocols and its fields. ``proto/PROTOCOL.md`` is the
human-readable form of this file; keep them in step (SCHEMA_VERSION too).

A message is a msgpack map with ``t`` (its kind) and the fields below. What
must not live here: state (``_transitions.py``) or I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import InvalidArgument

from ._errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "CLIENT_REQUESTS",
    "MAX_REASON",
    "PEER_REQUESTS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Message",
    "check_reason",
    "pack_scatter",
    "unpack_scatter",
    "usable_id",
    "validate",
]

SCHEMA_VERSION = 6  # 2: control connections authenticate (nonce/proof/auth); watch, locate
# 3: frames MACed after auth, 4 KiB handshake frames, forbidden; cancel; wait_imm
# scoped to a region or the session; resolve returns a slot
# 4: kv_forget refuse; kv_abandon (client) and kv_abandoned (peer)
# 5: unexport reason, withdraw, region_withdrawn
# 6: kv_begin pieces (and expected in its answer)

#: the longest name a message carries (node, peer, region, pool, client):
#: a name is a key in tables and log lines, not a payload
MAX_NAME = 255
#: the longest other text (an error's message, an address)
MAX_TEXT_FIELD = 4096
#: the longest reason a sender gives for abandoning a KV request
#: (``kv_abandon``) or withdrawing a region (``unexport``), quoted in the
#: error its peer hears
MAX_REASON = 1024
NAME_FIELDS = frozenset({"name", "peer", "region", "pool", "src", "node", "role"})

_INT = (int,)
_STR = (str,)
_BIN = (bytes,)
_MAP = (dict,)
_OPT_INT = (int, type(None))
_BOOL = (bool,)
_LIST = (list,)

# kind -> {field: (accepted types, required)}
SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    # handshake and teardown (both protocols)
    "hello": {"v": (_INT, True), "role": (_STR, True), "name": (_STR, False),
              "nonce": (_BIN, False), "control": (_STR, False)},
    "welcome": {"v": (_INT, True), "node": (_STR, True), "incarnation": (_INT, True),
                "max_frame": (_INT, True), "nonce": (_BIN, False), "proof": (_BIN, False)},
    "bye": {},
    # replies
    "ok": {"id": (_INT, True), "result": (_MAP, False)},
    "error": {"id": (_OPT_INT, False), "code": (_STR, True), "message": (_STR, True)},
    # client -> daemon
    "share": {"id": (_INT, True), "size": (_INT, True), "name": (_STR, False)},
    "share_device": {"id": (_INT, True), "handle": (_BIN, True), "offset": (_INT, True),
                     "size": (_INT, True), "gpu": (_BIN, True)},
    "unshare": {"id": (_INT, True), "mem": (_INT, True)},
    "export": {"id": (_INT, True), "name": (_STR, True), "mem": (_INT, True),
               "offset": (_INT, True), "length": (_INT, True), "writers": (_LIST, False)},
    "unexport": {"id": (_INT, True), "name": (_STR, True), "reason": (_STR, False)},
    "withdraw": {"id": (_INT, True), "name": (_STR, True), "reason": (_STR, True)},
    "write": {"id": (_INT, True), "peer": (_STR, True), "region": (_STR, True),
              "mem": (_INT, True), "offset": (_INT, True), "scatter": (_BIN, True),
              "imm": (_OPT_INT, False), "notify": (_BOOL, False)},
    "wait_imm": {"id": (_INT, True), "imm": (_INT, True), "count": (_INT, True),
                 "region": (_STR, False), "timeout_ms": (_INT, False)},
    "status": {"id": (_INT, True)},
    "peers": {"id": (_INT, True)},
    "add_peer": {"id": (_INT, True), "name": (_STR, True), "address": (_STR, True)},
    "watch": {"id": (_INT, True), "after": (_INT, True), "timeout_ms": (_INT, False)},
    "locate": {"id": (_INT, True), "region": (_STR, True)},
    # daemon -> daemon
    "auth": {"id": (_INT, True), "proof": (_BIN, True)},
    "resolve": {"id": (_INT, True), "region": (_STR, True), "tickets": (_INT, False)},
    "invalidate": {"id": (_INT, True), "region": (_STR, True)},
    # -- schema 3: cancellation crosses the socket; scoped immediates --------------
    # client -> daemon
    "cancel": {"id": (_INT, True), "target": (_INT, True)},
    "kv_pool": {"id": (_INT, True), "name": (_STR, True), "mem": (_INT, True),
                "layout": (_MAP, True), "receive": (_BOOL, False),
                "writers": (_LIST, False), "memory": (_STR, False)},
    "kv_push": {"id": (_INT, True), "peer": (_STR, True), "pool": (_STR, True),
                "src": (_STR, True), "src_blocks": (_BIN, True), "dst_blocks": (_BIN, True),
                "request": (_INT, True), "layers": (_BIN, False), "deadline_ms": (_INT, False)},
    "kv_wait": {"id": (_INT, True), "pool": (_STR, True), "request": (_INT, True),
                "upto": (_INT, True), "first": (_INT, False), "timeout_ms": (_INT, False)},
    "kv_forget": {"id": (_INT, True), "pool": (_STR, True), "request": (_INT, True),
                  "refuse": (_BOOL, False)},
    "kv_abandon": {"id": (_INT, True), "peer": (_STR, True), "pool": (_STR, True),
                   "request": (_INT, True), "reason": (_STR, False)},
    # daemon -> daemon
    "kv_begin": {"id": (_INT, True), "pool": (_STR, True), "request": (_INT, True),
                 "layers": (_BIN, True), "deadline_ms": (_INT, True), "pieces": (_BIN, False)},
    "kv_expect": {"id": (_INT, True), "slot": (_INT, True), "pieces": (_BIN, True),
                  "first": (_INT, False)},
    "kv_arrived": {"id": (_INT, True), "pool": (_STR, True), "request": (_INT, True),
                   "layer": (_INT, True)},
    "kv_abandoned": {"id": (_INT, True), "pool": (_STR, True), "request": (_INT, True),
                     "reason": (_STR, False), "landed": (_BIN, False)},
    # notification tickets (daemon -> daemon): a notify-mode write's one
    # notification made identifiable, and settled when its outcome is unknown
    "imm_tickets": {"id": (_INT, True), "region": (_STR, True), "n": (_INT, True)},
    "notify_settle": {"id": (_INT, True), "ticket": (_INT, True), "imm": (_INT, True)},
    # -- ping: the check that two daemons work together (client and peer) ---------
    "ping": {"id": (_INT, True), "peer": (_STR, False), "timeout_ms": (_INT, False),
             "offset": (_INT, False), "length": (_INT, False)},
}

CLIENT_REQUESTS = frozenset(
    {"share", "share_device", "unshare", "export", "unexport", "withdraw", "write", "wait_imm",
     "status", "peers", "add_peer", "watch", "locate", "cancel", "kv_pool", "kv_push",
     "kv_wait", "kv_forget", "kv_abandon", "ping"}
)
PEER_REQUESTS = frozenset({"auth", "resolve", "invalidate", "status", "peers", "kv_begin",
                           "kv_expect", "kv_arrived", "kv_abandoned", "imm_tickets",
                           "notify_settle", "ping"})


class Message:
    """One protocol message: its kind and its fields (``t`` excluded).
    Immutable; ``id`` is the usable request id (``usable_id``), worked out
    once (every layer asks for it)."""

    __slots__ = ("fields", "id", "kind")
    kind: str
    fields: Mapping[str, Any]
    id: int | None

    def __init__(self, kind: str, fields: Mapping[str, Any] | None = None) -> None:
        fields = {} if fields is None else fields
        _set(self, "kind", kind)
        _set(self, "fields", fields)
        _set(self, "id", usable_id(fields.get("id")))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Message is immutable (setting {name!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self.kind == other.kind and self.fields == other.fields

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[Message], tuple[str, Mapping[str, Any]]]:
        return Message, (self.kind, self.fields)  # copy and pickle despite __setattr__

    def __repr__(self) -> str:
        return f"Message(kind={self.kind!r}, fields={self.fields!r})"

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.kind, **self.fields}


_set = object.__setattr__


def check_reason(reason: Any) -> None:
    """A reason (``kv_abandon``, ``unexport``) a daemon takes, else
    ``InvalidArgument``."""
    if not isinstance(reason, str):
        raise InvalidArgument(f"reason must be a str, got {type(reason).__name__}")
    if len(reason) > MAX_REASON:
        raise InvalidArgument(f"reason is {len(reason)} characters, at most {MAX_REASON}")


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error texts quote hostile
    input, and a 16 MiB field name must not become a 16 MiB log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def usable_id(value: Any) -> int | None:
    """A request id: an int (never a bool) in msgpack's unsigned range."""
    return value if type(value) is int and 0 <= value < 1 << 64 else None


#: kind -> (field -> accepted types, required fields): ``validate``'s fast path
_FAST: dict[str, tuple[dict[str, tuple[type, ...]], frozenset[str]]] = {
    kind: ({name: types for name, (types, _) in schema.items()},
           frozenset(name for name, (_, required) in schema.items() if required))
    for kind, schema in SCHEMA.items()
}
_I64_MIN, _U64_END = -(1 << 63), 1 << 64


def validate(obj: Mapping[str, Any], *, remote: bool) -> Message:
    """Check a map against the schema. Errors are raised fatal with the
    message's usable id attached; the connection decides whether a bad request
    can be answered instead (it knows the state and the ids in use).

    Every message is checked twice over on a round trip, so the common case
    (exact types, as msgpack decodes them) takes one pass over its fields;
    anything else goes through the full check, which says what is wrong."""
    kind = obj.get("t")
    fast = _FAST.get(kind) if type(kind) is str else None
    if fast is not None:
        assert isinstance(kind, str)
        types_of, required = fast
        fields = dict(obj)
        del fields["t"]
        if required <= fields.keys():
            for name, value in fields.items():
                tv = type(value)
                if tv not in types_of.get(name, ()):
                    break
                if tv is int and not _I64_MIN <= value < _U64_END:
                    break
                if tv is dict and not all(type(k) is str for k in value):
                    break
                if tv is str and len(value) > (MAX_NAME if name in NAME_FIELDS
                                               else MAX_TEXT_FIELD):
                    break
            else:
                return Message(kind, fields)
    return _validate(obj, remote=remote)


def _validate(obj: Mapping[str, Any], *, remote: bool) -> Message:
    """``validate``'s full check."""
    err = RemoteProtocolError if remote else LocalProtocolError
    kind = obj.get("t")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise err("unknown_type", f"unknown message type {_short(kind)}")
    schema = SCHEMA[kind]
    rid = usable_id(obj.get("id"))
    fatal = True
    fields = {k: v for k, v in obj.items() if k != "t"}
    if extra := sorted(set(fields) - set(schema), key=str):
        raise err("bad_request", f"{kind}: unknown fields {_short(extra[:8], 200)}",
                  fatal=fatal, request_id=rid)
    for name, (types, required) in schema.items():
        if name not in fields:
            if required:
                raise err("bad_request", f"{kind}: missing field {name!r}", fatal=fatal,
                          request_id=rid)
            continue
        value = fields[name]
        # bool is an int to Python, never to us.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = "/".join(t.__name__ for t in types)
            raise err("bad_request", f"{kind}: field {name!r} must be {want}, got "
                      f"{type(value).__name__}", fatal=fatal, request_id=rid)
        if isinstance(value, int) and not -(1 << 63) <= value < 1 << 64:
            raise err("bad_request", f"{kind}: field {name!r} = {_short(value)} does not "
                      "fit 64 bits", fatal=fatal, request_id=rid)
        if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
            raise err("bad_request", f"{kind}: map field {name!r} must have string keys",
                      fatal=fatal, request_id=rid)
        if isinstance(value, str):
            most = MAX_NAME if name in NAME_FIELDS else MAX_TEXT_FIELD
            if len(value) > most:
                raise err("bad_request", f"{kind}: field {name!r} is {len(value)} characters "
                          f"long, more than {most}", fatal=fatal, request_id=rid)
    return Message(kind, fields)


def pack_scatter(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                 length: npt.NDArray[np.int64]) -> bytes:
    """Three int64 columns as one little-endian ``bin``: src | dst | length."""
    if not len(src) == len(dst) == len(length):
        raise LocalProtocolError("bad_request", f"scatter columns differ in length: "
                                 f"{len(src)}, {len(dst)}, {len(length)}")
    return b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes() for a in (src, dst, length))


def unpack_scatter(data: bytes) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                         npt.NDArray[np.int64]]:
    if len(data) == 0 or len(data) % 24:
        raise RemoteProtocolError("bad_request", f"scatter of {len(data)} bytes is not "
                                  "3 x n int64 values", fatal=False)
    n = len(data) // 24
    cols = np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False).reshape(3, n)
    return cols[0], cols[1], cols[2]
