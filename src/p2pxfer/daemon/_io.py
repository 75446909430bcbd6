"""Socket plumbing shared by the daemon's listeners: receiving bytes together
with SCM_RIGHTS file descriptors, peer credentials, and the mapping of our
errors onto the protocol's error codes (done here, once, at the edge)."""

from __future__ import annotations

import array
import contextlib
import os
import socket
import struct

import trio

from p2pxfer.errors import (
    DescriptorError,
    EngineClosed,
    InvalidArgument,
    P2PXferError,
    PeerLost,
    RemoteClosed,
    ScatterError,
    TransferError,
    UnregisteredMemory,
)
from p2pxfer.protocol import ProtocolError

__all__ = ["MAX_FDS", "RequestError", "error_code", "peer_credentials", "recv_with_fds"]

MAX_FDS = 8
_CREDS = struct.Struct("3i")


class RequestError(P2PXferError):
    """A request the daemon refuses, with the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def recv_with_fds(sock: trio.socket.SocketType, bufsize: int = 1 << 16
                        ) -> tuple[bytes, list[int]]:
    """Bytes and any file descriptors that came with them (b"" at EOF)."""
    data, ancdata, _flags, _addr = await sock.recvmsg(bufsize, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    return data, fds


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(raw)
    return pid, uid, gid


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def error_code(exc: BaseException) -> tuple[str, str]:
    """The protocol's (code, message) for an exception raised serving a request."""
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    if isinstance(exc, ProtocolError):
        return exc.code, exc.message
    table: list[tuple[type[BaseException], str]] = [
        (ScatterError, "out_of_range"),
        (UnregisteredMemory, "unknown_mem"),
        (DescriptorError, "bad_request"),
        (InvalidArgument, "bad_request"),
        (PeerLost, "peer_lost"),
        (RemoteClosed, "peer_unreachable"),
        (TransferError, "transfer_failed"),
        (EngineClosed, "closed"),
    ]
    for cls, code in table:
        if isinstance(exc, cls):
            return code, str(exc)
    return "internal", f"{type(exc).__name__}: {exc}"
