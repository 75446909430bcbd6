"""The blocking client's conversation with the daemon: a unix socket of its
own, in blocking mode, and a sans-IO ``Connection`` of its own. No event
loop and no thread behind it: the calling thread sends its request and reads
up to its reply.

One request at a time (a lock): a thread that calls while another waits
queues behind it. A call given up while it waits (its ``timeout``, or
``KeyboardInterrupt``) tells the daemon (``cancel``) and reads on until the
daemon has answered the request, i.e. stopped serving it (a write's source
is no longer read, a wait no longer counts), as the async client does; only
then does it raise. Interrupted while sending or while cancelling, the
conversation is over (``ConnectionLost`` from then on): half a frame cannot
be taken back. What must not live here: the API (``_sync.py``). The lock
owns every field.
"""

from __future__ import annotations

import array
import contextlib
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from p2pxfer.errors import ConnectionLost, P2PXferError, WaitTimeout
from p2pxfer.protocol import (
    CLOSED,
    INITIATOR,
    NEED_DATA,
    SCHEMA_VERSION,
    Connection,
    Message,
    ProtocolError,
    error_from_wire,
)

from ._client import unreachable

__all__ = ["BlockingConversation"]

RECEIVE_BYTES = 1 << 16


class BlockingConversation:
    """Requests and replies on a blocking socket (see the module docstring)."""

    def __init__(self, path: str, max_frame: int) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise ConnectionLost(unreachable(path, exc)) from exc
        self._sock = sock
        self._conn = Connection("client", INITIATOR, max_frame=max_frame)
        self._lock = threading.Lock()
        self._closed: P2PXferError | None = None
        try:
            self._send(self._conn.send("hello", None, v=SCHEMA_VERSION, role="client"))
            welcome = self._read_until(None, None)
        except BaseException:
            self.close()
            raise
        assert welcome is not None
        if welcome.kind == "error":
            self.close()
            raise error_from_wire(welcome["code"], welcome["message"])
        self.node: str = welcome["node"]
        self.incarnation: int = welcome["incarnation"]

    def request(self, kind: str, fds: Sequence[int] = (), *, timeout: float | None = None,
                **fields: Any) -> dict[str, Any]:
        """Send one request and return its result (an error reply is
        raised). After ``timeout`` seconds the request is cancelled as the
        module docstring says, then ``WaitTimeout`` (unless its reply came
        meanwhile: then it is returned)."""
        with self._lock:
            if self._closed is not None:
                raise ConnectionLost(f"connection to the daemon is closed ({self._closed})")
            rid = self._conn.next_id()
            # Encoded first: a request that cannot be sent (too big, a bad
            # field) leaves the conversation as it was.
            data = self._conn.send(kind, None, id=rid, **fields)
            try:
                self._send(data, fds)
            except BaseException as exc:
                self._end(exc)
                raise
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                reply = self._read_until(rid, deadline)
            except P2PXferError as exc:  # the daemon went, or ended the conversation
                self._end(exc)
                raise
            except BaseException:
                self._cancel(rid)  # KeyboardInterrupt: the daemon stops first
                raise
            if reply is None:  # its time ran out
                reply = self._cancel(rid)
                if reply is None or reply.kind == "error" or \
                        (reply.get("result") or {}).get("cancelled"):
                    raise WaitTimeout(f"{kind}: no answer within {timeout:g} s")
            if reply.kind == "error":
                raise error_from_wire(reply["code"], reply["message"])
            return dict(reply.get("result") or {})

    def _cancel(self, rid: int) -> Message | None:
        """Tell the daemon to stop request ``rid`` and read until it has
        answered it (it answers ``rid`` before the ``cancel``); its reply.
        Anything going wrong here ends the conversation."""
        try:
            cid = self._conn.next_id()
            self._send(self._conn.send("cancel", None, id=cid, target=rid))
            reply = self._read_until(rid, None)
            self._read_until(cid, None)
            return reply
        except BaseException as exc:
            self._end(exc)
            if not isinstance(exc, P2PXferError):
                raise
            return None

    def _send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        try:
            if fds:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = self._sock.sendmsg([data], ancillary)
                data = data[sent:]
            if data:
                self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost(f"the daemon at {self.path} is gone: {exc}") from exc

    def _read_until(self, rid: int | None, deadline: float | None) -> Message | None:
        """Messages until the reply to ``rid`` (None: the hello's answer);
        replies to other requests (one given up before) are dropped. None
        once ``deadline`` (``time.monotonic()``) passes first."""
        conn = self._conn
        while True:
            try:
                event = conn.next_event()
            except ProtocolError as exc:
                raise ConnectionLost(f"protocol error from the daemon: {exc}") from exc
            if event is CLOSED:
                raise ConnectionLost(f"the daemon at {self.path} closed the connection")
            if event is NEED_DATA:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                        return None
                try:
                    data = self._sock.recv(RECEIVE_BYTES)
                except OSError:
                    data = b""
                conn.receive_data(data)
                continue
            assert isinstance(event, Message)
            if event.id is None:
                if event.kind == "error" and rid is not None:
                    raise error_from_wire(event["code"], event["message"])
                if rid is None:
                    return event
                continue
            if event.id == rid:
                return event

    def _end(self, why: BaseException) -> None:
        if self._closed is None:
            self._closed = why if isinstance(why, P2PXferError) else \
                ConnectionLost(f"a request was interrupted: {why!r}")
            self._shutdown()

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Say goodbye and close. A call another thread still waits in ends
        with ``ConnectionLost`` (the daemon drops what it served for it)."""
        if not self._lock.acquire(blocking=False):
            self._end(ConnectionLost("client closed"))
            return
        try:
            if self._closed is None:
                self._closed = ConnectionLost("client closed")
                with contextlib.suppress(ConnectionLost, ProtocolError):
                    self._send(self._conn.send("bye", None))
            self._sock.close()
        finally:
            self._lock.release()
