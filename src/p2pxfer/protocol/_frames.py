"""Framing: a 4-byte big-endian length, then that many bytes of one msgpack map.

The length prefix is checked against the maximum as soon as it arrives, so an
oversized frame is refused without waiting for (or decoding) its body.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from ._errors import LocalProtocolError, RemoteProtocolError

__all__ = ["DEFAULT_MAX_FRAME", "FrameDecoder", "encode_frame"]

DEFAULT_MAX_FRAME = 16 << 20
_HEADER = struct.Struct(">I")


def encode_frame(obj: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError("bad_request", f"cannot encode message: {exc}") from exc
    if len(body) > max_frame:
        raise LocalProtocolError("too_big", f"frame of {len(body)} bytes exceeds {max_frame}")
    return _HEADER.pack(len(body)) + bytes(body)


class FrameDecoder:
    """Bytes in, msgpack maps out."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
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
        if n > self.max_frame:
            raise RemoteProtocolError("too_big", f"frame of {n} bytes exceeds {self.max_frame}")
        if len(self._buf) < _HEADER.size + n:
            return None
        body = bytes(self._buf[_HEADER.size:_HEADER.size + n])
        del self._buf[:_HEADER.size + n]
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as exc:
            raise RemoteProtocolError("bad_frame", f"frame is not msgpack ({exc})") from exc
        if not isinstance(obj, dict):
            raise RemoteProtocolError("bad_frame", f"frame is a {type(obj).__name__}, not a map")
        return obj
