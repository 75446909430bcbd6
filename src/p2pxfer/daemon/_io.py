"""Socket plumbing of the daemon's unix listener: receiving bytes together
with SCM_RIGHTS file descriptors, peer credentials, and the client socket as
a ``p2pxfer._pump.ByteStream`` (its failures mapped here, once). Error codes
are the protocol's (``p2pxfer.protocol.ERRORS``)."""

from __future__ import annotations

import array
import contextlib
import os
import socket
import struct
from collections import deque
from collections.abc import Sequence

import trio

from p2pxfer.errors import ConnectionLost

__all__ = ["MAX_FDS", "MAX_QUEUED_FDS", "UnixFdStream", "close_fds", "peer_credentials",
           "recv_with_fds"]

MAX_FDS = 8  # taken per recvmsg (the kernel closes any beyond)
#: descriptors a client may have sent ahead of its ``share`` requests; one
#: that sends more is flooding us and is cut off
MAX_QUEUED_FDS = 8
_CREDS = struct.Struct("3i")


async def recv_with_fds(sock: trio.socket.SocketType, bufsize: int = 1 << 16
                        ) -> tuple[bytes, list[int]]:
    """Bytes and any file descriptors that came with them (b"" at EOF)."""
    data, ancdata, _flags, _addr = await sock.recvmsg(bufsize, socket.CMSG_SPACE(MAX_FDS * 4),
                                                      socket.MSG_CMSG_CLOEXEC)
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


class UnixFdStream:
    """A client's unix socket: bytes in with the descriptors that came with
    them (queued in ``fds``, oldest first, at most ``MAX_QUEUED_FDS``), bytes
    out. A client that queues more is cut off: its descriptors are closed
    and the stream reads as ended (``flooded`` says why)."""

    def __init__(self, sock: trio.socket.SocketType, label: str) -> None:
        self.sock = sock
        self.label = label
        self.fds: deque[int] = deque()
        self.flooded = False

    async def receive_some(self) -> bytes:
        if self.flooded:
            return b""
        try:
            data, fds = await recv_with_fds(self.sock)
        except OSError:
            return b""
        if len(self.fds) + len(fds) > MAX_QUEUED_FDS:
            close_fds(fds)
            close_fds(list(self.fds))
            self.fds.clear()
            self.flooded = True
            self.shutdown()
            return b""
        self.fds.extend(fds)
        return data

    async def send_all(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if fds:
            raise ConnectionLost("the daemon passes no file descriptors to clients")
        try:
            view = memoryview(data)
            while view:
                view = view[await self.sock.send(view):]
        except OSError as exc:
            raise ConnectionLost(f"client {self.label} is gone: {exc}") from exc

    def shutdown(self) -> None:
        """End the conversation from our side (the receive loop then ends)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    async def aclose(self) -> None:
        close_fds(list(self.fds))
        self.fds.clear()
        self.sock.close()
