"""Framing: a 4-byte big-endian length, then that many bytes of one msgpack map
(and, on an authenticated control connection, a MAC after it).

The length prefix is checked against the current limit as soon as it arrives,
so an oversized frame is refused without waiting for (or decoding) its body.
A decoder can also bound what one body may make: how many maps and arrays
(``max_containers``) and how long each may be, so a small frame cannot blow
up into gigabytes of Python objects. ``FrameMac`` seals and checks frames once
a connection has a key. What must not live here: message schema or state.
"""

from __future__ import annotations

import hmac
import struct
from typing import Any

import msgpack

from ._errors import LocalProtocolError, RemoteProtocolError

__all__ = ["DEFAULT_MAX_FRAME", "HANDSHAKE_MAX_FRAME", "MAC_BYTES", "FrameDecoder", "FrameMac",
           "encode_frame"]

DEFAULT_MAX_FRAME = 16 << 20
#: the largest frame anyone may send before it is known who they are
HANDSHAKE_MAX_FRAME = 4096
MAC_BYTES = 16
_HEADER = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class FrameMac:
    """One direction's MAC state: HMAC-SHA-256 under a per-connection key,
    cut to ``MAC_BYTES``, over the frame's sequence number (8 bytes, counted
    from 0, never sent) and its body. The sequence number makes a dropped,
    replayed or reordered frame fail the check as surely as a changed one."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.seq = 0

    def tag(self, body: bytes) -> bytes:
        mac = hmac.new(self._key, _SEQ.pack(self.seq), "sha256")
        mac.update(body)
        self.seq += 1
        return mac.digest()[:MAC_BYTES]


def encode_frame(obj: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME,
                 mac: FrameMac | None = None) -> bytes:
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError("bad_request", f"cannot encode message: {exc}") from exc
    if len(body) > max_frame:
        raise LocalProtocolError("too_big", f"frame of {len(body)} bytes exceeds {max_frame}")
    if mac is None:
        return _HEADER.pack(len(body)) + bytes(body)
    return _HEADER.pack(len(body) + MAC_BYTES) + bytes(body) + mac.tag(body)


class FrameDecoder:
    """Bytes in, msgpack maps out. ``max_frame`` is the current limit on a
    body (it may be raised once the other end is known); ``max_containers``
    bounds the maps and arrays one body may hold (None: only by its size);
    with ``mac`` set, every frame must end in the right tag."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, *,
                 max_containers: int | None = None) -> None:
        self.max_frame = max_frame
        self.max_containers = max_containers
        self.mac: FrameMac | None = None
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next_frame(self) -> dict[str, Any] | None:
        """The next complete frame, or None if more bytes are needed."""
        if len(self._buf) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        tag_bytes = MAC_BYTES if self.mac is not None else 0
        if n - tag_bytes > self.max_frame:
            raise RemoteProtocolError("too_big", f"frame of {n - tag_bytes} bytes exceeds "
                                      f"{self.max_frame}")
        if len(self._buf) < _HEADER.size + n:
            return None
        if self.mac is None:
            body = bytes(self._buf[_HEADER.size:_HEADER.size + n])
            del self._buf[:_HEADER.size + n]
            return self._decode(body)
        body = bytes(self._buf[_HEADER.size:_HEADER.size + n - tag_bytes])
        tag = bytes(self._buf[_HEADER.size + n - tag_bytes:_HEADER.size + n])
        del self._buf[:_HEADER.size + n]
        if self.mac is not None and (n < tag_bytes
                                     or not hmac.compare_digest(self.mac.tag(body), tag)):
            # Not from the holder of this connection's key (or not in order):
            # nothing more on this connection can be trusted.
            raise RemoteProtocolError("auth_failed", "a frame's MAC is wrong (changed, "
                                      "replayed, reordered or not from the authenticated peer)")
        return self._decode(body)

    def _decode(self, body: bytes) -> dict[str, Any]:
        limits: dict[str, Any] = {}
        if self.max_containers is not None:
            budget = [self.max_containers]

            def count(obj: Any) -> Any:
                budget[0] -= 1
                if budget[0] < 0:
                    raise ValueError(f"more than {self.max_containers} maps and arrays")
                return obj

            limits = {"object_hook": count, "list_hook": count,
                      "max_map_len": self.max_containers * 4,
                      "max_array_len": self.max_containers * 64}
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True, **limits)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as exc:
            raise RemoteProtocolError("bad_frame", f"frame is not msgpack ({exc})") from exc
        if not isinstance(obj, dict):
            raise RemoteProtocolError("bad_frame", f"frame is a {type(obj).__name__}, not a map")
        return obj
