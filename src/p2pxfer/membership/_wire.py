"""The membership wire format: authenticated datagrams carrying one msgpack map.

```
+---------+------------------------------+----------------------------------+
| v: u8=2 | tag: 32 bytes HMAC-SHA256    | body: one msgpack map            |
+---------+------------------------------+----------------------------------+
tag     = HMAC-SHA256(mac_key, v || body)
mac_key = HMAC-SHA256(token, "p2pxfer/membership/datagram/v1")
```

The tag is checked before the body is parsed: nothing a stranger sends is
ever decoded. Join proofs use a second key derived from the same token
(``join_key``), so a proof can never double as a datagram tag, and bind the
prover's name: ``proof = HMAC-SHA256(join_key, nonce || 0x00 || name)``.

Member records travel as arrays ``[name, address, incarnation, version,
state]`` (state 0 alive, 1 suspect, 2 dead, 3 left), with a sixth element, the
member's other addresses (one per further rail), when it has any. The kinds and
their fields are in ``proto/MEMBERSHIP.md``; ``decode`` refuses anything else
(a missing, unknown or mistyped field, an unknown kind).

What must not live here: protocol decisions (``_swim*.py``) and sockets.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2pxfer.errors import InvalidArgument

from ._member import MemberState

__all__ = [
    "KINDS",
    "TAG_SIZE",
    "WIRE_VERSION",
    "ClusterAuth",
    "Record",
    "SwimMessage",
    "WireError",
    "decode",
    "encode",
]

WIRE_VERSION = 2  # 2: records carry a member's other addresses (rails)
MAX_EXTRA_ADDRESSES = 8
TAG_SIZE = 32
MAX_NAME = 255
MAX_ADDRESS = 300
MAX_UPDATES = 512
MAX_MEMBERS = 8192
NONCE_SIZE = 16

KINDS = frozenset({"swim_ping", "swim_ack", "swim_ping_req", "swim_join", "swim_challenge",
                   "swim_welcome", "swim_sync", "swim_leave"})

_STATES = (MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT)
_STATE_CODE = {s: i for i, s in enumerate(_STATES)}

#: (name, address, incarnation, version, state, other addresses)
Record = tuple[str, str, int, int, MemberState, tuple[str, ...]]

# Required and optional fields per kind (besides "t" and "from").
_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "swim_ping": (frozenset({"seq", "to", "d", "u"}), frozenset()),
    "swim_ack": (frozenset({"seq", "d", "u"}), frozenset({"for"})),
    "swim_ping_req": (frozenset({"seq", "target", "u"}), frozenset()),
    "swim_join": (frozenset({"nonce"}), frozenset({"challenge", "proof"})),
    "swim_challenge": (frozenset({"nonce", "proof", "challenge"}), frozenset()),
    "swim_welcome": (frozenset({"members"}), frozenset()),
    "swim_sync": (frozenset({"members"}), frozenset({"reply"})),
    "swim_leave": (frozenset({"u"}), frozenset()),
}


class WireError(Exception):
    """A datagram was refused. ``authentic`` says whether it carried a valid
    tag (a member's bug or version skew) or not (no token: an intruder)."""

    def __init__(self, reason: str, *, authentic: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.authentic = authentic


class ClusterAuth:
    """Keys derived from the cluster token, and what is done with them."""

    def __init__(self, token: bytes) -> None:
        if not isinstance(token, bytes):
            raise InvalidArgument("the cluster token must be bytes")
        self._mac_key = hmac.digest(token, b"p2pxfer/membership/datagram/v1", "sha256")
        self._join_key = hmac.digest(token, b"p2pxfer/membership/join/v1", "sha256")
        self._value_key = hmac.digest(token, b"p2pxfer/membership/value/v1", "sha256")
        self._control_key = hmac.digest(token, b"p2pxfer/control/v1", "sha256")

    def seal(self, body: bytes) -> bytes:
        head = bytes((WIRE_VERSION,))
        return head + hmac.digest(self._mac_key, head + body, "sha256") + body

    def open(self, datagram: bytes) -> bytes:
        """The body of an authentic datagram; ``WireError`` otherwise."""
        if len(datagram) < 1 + TAG_SIZE + 1:
            raise WireError(f"datagram of {len(datagram)} bytes is too short", authentic=False)
        if datagram[0] != WIRE_VERSION:
            raise WireError(f"wire version {datagram[0]}, not {WIRE_VERSION}", authentic=False)
        tag, body = datagram[1:1 + TAG_SIZE], datagram[1 + TAG_SIZE:]
        want = hmac.digest(self._mac_key, datagram[:1] + body, "sha256")
        if not hmac.compare_digest(tag, want):
            raise WireError("bad MAC (wrong or missing cluster token)", authentic=False)
        return body

    def prove(self, nonce: bytes, name: str) -> bytes:
        """The answer to a join challenge ``nonce`` for a member called ``name``."""
        return hmac.digest(self._join_key, nonce + b"\0" + name.encode(), "sha256")

    def check(self, nonce: bytes, name: str, proof: bytes) -> bool:
        return hmac.compare_digest(self.prove(nonce, name), proof)

    def connection_proof(self, side: str, initiator_nonce: bytes, responder_nonce: bytes,
                         name: str) -> bytes:
        """What ``side`` ("initiator" or "responder") of a control connection
        shows to prove it holds the token: a MAC over both nonces in a fixed
        order, its side and its node name (so a proof can be neither replayed
        on another connection nor reflected back to its sender)."""
        # Each part length-prefixed: no two different tuples give the same input.
        parts = (side.encode(), initiator_nonce, responder_nonce, name.encode())
        data = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
        return hmac.digest(self._control_key, data, "sha256")

    def check_connection(self, side: str, initiator_nonce: bytes, responder_nonce: bytes,
                         name: str, proof: bytes) -> bool:
        return hmac.compare_digest(
            self.connection_proof(side, initiator_nonce, responder_nonce, name), proof)

    def session_keys(self, initiator_nonce: bytes, responder_nonce: bytes, initiator: str,
                     responder: str) -> tuple[bytes, bytes]:
        """The MAC keys of one authenticated control connection, (initiator to
        responder, responder to initiator): derived from the token, both
        nonces and both names, so every connection and direction has its own
        and no proof sent in the clear (its first part is a side, not
        "session") gives them away."""
        parts = (b"session", initiator_nonce, responder_nonce, initiator.encode(),
                 responder.encode())
        data = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
        master = hmac.digest(self._control_key, data, "sha256")
        return (hmac.digest(master, b"initiator->responder", "sha256"),
                hmac.digest(master, b"responder->initiator", "sha256"))

    def sign(self, data: bytes) -> bytes:
        """A MAC for a value stored outside the wire (the etcd backend's keys)."""
        return hmac.digest(self._value_key, data, "sha256")

    def verify(self, data: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.sign(data), mac)


@dataclass(slots=True)
class SwimMessage:
    """One decoded message; which fields are set depends on ``kind``."""

    kind: str
    sender: Record
    seq: int = 0
    to: str = ""
    target: Record | None = None
    updates: list[Record] = field(default_factory=list)
    on_behalf: str | None = None  # "for": the member a relayed ack speaks for
    nonce: bytes = b""
    challenge: bytes | None = None
    proof: bytes | None = None
    members: list[Record] = field(default_factory=list)
    digest: int | None = None  # "d": the sender's view digest (pings, acks)
    reply: bool = False  # swim_sync: answer with our own full state


def record_to_wire(rec: Record) -> list[Any]:
    out = [rec[0], rec[1], rec[2], rec[3], _STATE_CODE[rec[4]]]
    if rec[5]:
        out.append(list(rec[5]))
    return out


def encode(kind: str, sender: Record, **fields: Any) -> bytes:
    """The msgpack body of one message. Records in ``target``, ``u`` and
    ``members`` are given as ``Record`` tuples."""
    body: dict[str, Any] = {"t": kind, "from": record_to_wire(sender)}
    for key, value in fields.items():
        if key == "target":
            body[key] = record_to_wire(value)
        elif key in ("u", "members"):
            body[key] = [record_to_wire(r) for r in value]
        elif key == "on_behalf":
            body["for"] = value
        else:
            body[key] = value
    return bytes(msgpack.packb(body, use_bin_type=True))


def decode(body: bytes) -> SwimMessage:
    """Parse and check one authentic body; ``WireError(authentic=True)`` if it
    is not a well-formed message of a known kind."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise _bad(f"body is not msgpack ({exc})") from exc
    if not isinstance(obj, dict):
        raise _bad(f"body is a {type(obj).__name__}, not a map")
    kind = obj.get("t")
    if not isinstance(kind, str) or kind not in KINDS:
        raise _bad(f"unknown kind {kind!r}")
    required, optional = _FIELDS[kind]
    keys = set(obj) - {"t", "from"}
    if missing := required - keys:
        raise _bad(f"{kind} lacks {sorted(missing)}")
    if extra := keys - required - optional:
        raise _bad(f"{kind} has unknown fields {sorted(extra)}")
    msg = SwimMessage(kind, _record(obj.get("from"), "from"))
    if "seq" in obj:
        msg.seq = _int(obj["seq"], "seq")
    if "d" in obj:
        msg.digest = _int(obj["d"], "d")
    if "reply" in obj:
        if not isinstance(obj["reply"], bool):
            raise _bad("reply must be a bool")
        msg.reply = obj["reply"]
    if "to" in obj:
        msg.to = _name(obj["to"], "to")
    if "for" in obj:
        msg.on_behalf = _name(obj["for"], "for")
    if "target" in obj:
        msg.target = _record(obj["target"], "target")
    if "u" in obj:
        msg.updates = _records(obj["u"], "u", MAX_UPDATES)
    if "members" in obj:
        msg.members = _records(obj["members"], "members", MAX_MEMBERS)
    if "nonce" in obj:
        msg.nonce = _bin(obj["nonce"], "nonce")
    if "challenge" in obj:
        msg.challenge = _bin(obj["challenge"], "challenge")
    if "proof" in obj:
        msg.proof = _bin(obj["proof"], "proof")
    if kind == "swim_join" and (msg.challenge is None) != (msg.proof is None):
        raise _bad("swim_join carries challenge and proof together or neither")
    return msg


def _bad(reason: str) -> WireError:
    return WireError(reason, authentic=True)


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _bad(f"{what} must be an int >= 0, got {value!r}")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise _bad(f"{what} must be a name of 1..{MAX_NAME} characters")
    return value


def _bin(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or not NONCE_SIZE <= len(value) <= 64:
        raise _bad(f"{what} must be {NONCE_SIZE}..64 bytes")
    return value


def _record(value: Any, what: str) -> Record:
    # One expression on the good path: members decode hundreds of these a period.
    if type(value) is list and 5 <= len(value) <= 6:
        name, address, inc, ver, state = value[:5]
        if type(name) is str and 0 < len(name) <= MAX_NAME and _is_address(address) \
                and type(inc) is int and inc >= 0 and type(ver) is int and ver >= 0 \
                and type(state) is int and 0 <= state < 4:
            if len(value) == 5:
                return (name, address, inc, ver, _STATES[state], ())
            extra = value[5]
            if type(extra) is list and 0 < len(extra) <= MAX_EXTRA_ADDRESSES \
                    and all(_is_address(a) for a in extra):
                return (name, address, inc, ver, _STATES[state], tuple(extra))
    raise _bad(f"{what} must be [name, address (host:port), incarnation >= 0, "
               f"version >= 0, state 0..3, optionally [1..{MAX_EXTRA_ADDRESSES} more "
               f"addresses]], got {value!r:.200}")


def _is_address(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_ADDRESS and ":" in value


def _records(value: Any, what: str, limit: int) -> list[Record]:
    if not isinstance(value, list) or len(value) > limit:
        raise _bad(f"{what} must be a list of at most {limit} records")
    return [_record(v, what) for v in value]
