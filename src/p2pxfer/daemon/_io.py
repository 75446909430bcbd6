"""Socket plumbing of the daemon's unix listener: receiving bytes together
with SCM_RIGHTS file descriptors, peer credentials, and the client socket as
a ``p2pxfer._pump.ByteStream`` (its failures mapped here, once). Error codes
are the protocol's (``p2pxfer.protocol.ERRORS``).

The client socket is read and written with plain non-blocking calls that
park in trio only when the kernel says "not now": a no-op request then costs
the session one scheduler round (the wait for the request), not three (trio's
socket methods add a checkpoint to every call that succeeds at once)."""

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
           "recv_with_fds", "recv_with_fds_nowait"]

MAX_FDS = 8  # taken per recvmsg (the kernel closes any beyond)
#: descriptors a client may have sent ahead of its ``share`` requests; one
#: that sends more is flooding us and is cut off
MAX_QUEUED_FDS = 8
_CREDS = struct.Struct("3i")


_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)


def recv_with_fds_nowait(sock: socket.socket, bufsize: int = 1 << 16
                         ) -> tuple[bytes, list[int]]:
    """Bytes and any file descriptors that came with them (b"" at EOF) from a
    non-blocking socket; ``BlockingIOError`` when nothing is there yet."""
    data, ancdata, _flags, _addr = sock.recvmsg(bufsize, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
    if not ancdata:
        return data, []
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    return data, fds


async def recv_with_fds(sock: socket.socket, bufsize: int = 1 << 16
                        ) -> tuple[bytes, list[int]]:
    """``recv_with_fds_nowait``, waiting (in trio) until something is there."""
    while True:
        try:
            return recv_with_fds_nowait(sock, bufsize)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


def peer_credentials(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int, int]:
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

    def __init__(self, sock: socket.socket | trio.socket.SocketType, label: str) -> None:
        if not isinstance(sock, socket.socket):
            # Plain calls on the descriptor, trio only to wait (module docstring).
            sock = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())
        sock.setblocking(False)
        self.sock = sock
        self.label = label
        self.fds: deque[int] = deque()
        self.flooded = False

    async def receive_some(self) -> bytes:
        """The next bytes (b"" once the stream ended or broke). Checkpoints
        only when it waits: the session yields to others every few requests
        (``_sessions.FAIR_REQUESTS``)."""
        if self.flooded:
            return b""
        try:
            try:
                data, fds = recv_with_fds_nowait(self.sock)
            except BlockingIOError:
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

    def take_fd(self) -> int | None:
        """The oldest queued descriptor, now the caller's to close; None
        when none is queued."""
        return self.fds.popleft() if self.fds else None

    def drop_fd(self) -> None:
        """Close the oldest queued descriptor, if any: its ``share`` was
        refused before it could take it."""
        if (fd := self.take_fd()) is not None:
            close_fds([fd])

    async def send_all(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if fds:
            raise ConnectionLost("the daemon passes no file descriptors to clients")
        try:
            view = memoryview(data)
            while view:
                try:
                    view = view[self.sock.send(view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)
        except OSError as exc:
            raise ConnectionLost(f"client {self.label} is gone: {exc}") from exc

    def shutdown(self) -> None:
        """End the conversation from our side (the receive loop then ends)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    async def aclose(self) -> None:
        close_fds(list(self.fds))
        self.fds.clear()
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
