"""The one request/response pump over a sans-IO ``Connection``.

``Pump`` drives a ``p2pxfer.protocol.Connection`` over a byte stream: it
reads until a whole message (or the end) is there, encodes what we send under
a lock (the connection's state moves as it encodes), and turns ``error``
frames into the exceptions of ``p2pxfer.protocol.ERRORS``. The daemon (client
sessions, the control port, peer links), the client and the bench all use
it; it runs under trio and, through anyio's lock, under asyncio too.

Streams are adapted at the edge, once (``TrioStream`` here; the client's
anyio stream and the daemon's fd-passing unix socket beside their users):
``receive_some`` returns ``b""`` when the stream ended or broke, and
``send_all`` raises ``ConnectionLost``. What must not live here: protocol
rules (``p2pxfer.protocol``) or what a request means (its handler).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import anyio
import trio

from p2pxfer.errors import ConnectionLost, P2PXferError
from p2pxfer.protocol import (
    CLOSED,
    NEED_DATA,
    Connection,
    Message,
    ProtocolError,
    error_from_wire,
    wire_error,
)

__all__ = ["ByteStream", "LogThrottle", "Pump", "TrioStream", "bounded", "where_raised"]

RECEIVE_BYTES = 1 << 16
MAX_TEXT = 500  # longest exception text put into a log line or an error frame


def where_raised(exc: BaseException, frames: int = 8) -> str:
    """Where ``exc`` was raised, innermost first, as ``file:line function``
    (file names and line numbers only: nothing of hostile input): what a log
    line about a bug must say."""
    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(tb))


def bounded(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters: what we log or send about a
    failure may quote hostile input."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class LogThrottle:
    """At most one log line per ``interval_s`` about one kind of hostile
    event (a connection flood must not become a disk flood): ``due()`` says
    whether to log now, and how many were left unlogged since the last line."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self._skipped = 0

    def due(self, now: float) -> int | None:
        if now - self._last < self.interval_s:
            self._skipped += 1
            return None
        self._last, skipped, self._skipped = now, self._skipped, 0
        return skipped


class ByteStream(Protocol):
    async def receive_some(self) -> bytes:
        """Some bytes; ``b""`` once the stream ended (or broke)."""
        ...

    async def send_all(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """All of ``data`` (with ``fds``, where the stream can pass them);
        ``ConnectionLost`` if the other end is gone."""
        ...

    async def aclose(self) -> None: ...


class TrioStream:
    """A trio stream (TCP or unix), its failures mapped at this edge."""

    def __init__(self, stream: trio.abc.Stream, where: str) -> None:
        self.stream = stream
        self.where = where

    async def receive_some(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some(RECEIVE_BYTES))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return b""

    async def send_all(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if fds:
            raise ConnectionLost(f"{self.where}: this stream cannot pass file descriptors")
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(f"{self.where}: {exc or type(exc).__name__}") from exc

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class Pump:
    """One conversation: a ``Connection`` over a ``ByteStream``. ``where``
    names the other end in errors ("node-b"); without it an error reads
    "code: message" (the client's: its caller knows whom it asked)."""

    def __init__(self, conn: Connection, stream: ByteStream, where: str) -> None:
        self.conn = conn
        self.stream = stream
        self.where = where
        # Taken without a scheduler round when free: a reply costs the
        # session no extra round (the stream's send may still wait).
        self._send_lock = anyio.Lock(fast_acquire=True)

    async def receive(self) -> Message | None:
        """The next message, or None once the conversation is over. A
        ``RemoteProtocolError`` propagates: answer it with ``send_error``."""
        while True:
            event = self.conn.next_event()
            if event is NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some())
                continue
            if event is CLOSED:
                return None
            assert isinstance(event, Message)
            return event

    async def send(self, kind: str, fields: Mapping[str, Any] | None = None, *,
                   fds: Sequence[int] = (), **kw: Any) -> None:
        """Encode and send one message. A ``LocalProtocolError`` (not legal
        now, too big, not encodable) leaves the conversation as it was."""
        async with self._send_lock:
            data = self.conn.send(kind, fields, **kw)
            if data:
                await self.stream.send_all(data, fds)

    async def send_error(self, err: ProtocolError) -> None:
        """Answer a protocol error (a fatal one ends the conversation)."""
        async with self._send_lock:
            await self.stream.send_all(self.conn.send_error(err))

    async def answer(self, rid: int | None, outcome: Mapping[str, Any] | BaseException
                     ) -> None:
        """``ok`` with ``outcome``, or the ``error`` its exception maps to."""
        if isinstance(outcome, BaseException):
            code, text = wire_error(outcome)
            await self.send("error", id=rid, code=code, message=bounded(text))
        else:
            await self.send("ok", id=rid, result=dict(outcome))

    async def hello(self, **fields: Any) -> Message:
        """Say hello; the ``welcome`` (an ``error`` instead is raised)."""
        try:
            await self.send("hello", **fields)
        except ConnectionLost as lost:
            # A daemon that refuses us (a cap) says why and hangs up before
            # it reads our hello: its error is still there to read.
            try:
                return await self.reply(None)
            except ConnectionLost:
                raise lost from None
        return await self.reply(None)

    async def exchange(self, kind: str, **fields: Any) -> Message:
        """Send one request and read up to its reply (``ok`` or ``error``).
        For callers with one request at a time; others read ``receive``."""
        rid = self.conn.next_id()
        await self.send(kind, id=rid, **fields)
        return await self.reply(rid)

    async def request(self, kind: str, **fields: Any) -> dict[str, Any]:
        """``exchange``, then the result; an error reply is raised."""
        return self.result(await self.exchange(kind, **fields))

    async def reply(self, rid: int | None) -> Message:
        """Read until the reply to ``rid`` (None: the handshake's answer).
        ``ConnectionLost`` if the conversation ends first; a connection-level
        error is raised as the exception of its code."""
        while True:
            msg = await self.receive()
            if msg is None:
                raise ConnectionLost(f"{self.where or 'the other end'} closed the connection")
            if msg.kind == "error" and msg.id is None:
                raise self.error(msg)
            if rid is None or msg.id == rid:
                return msg

    def result(self, msg: Message) -> dict[str, Any]:
        if msg.kind == "error":
            raise self.error(msg)
        return dict(msg.get("result") or {})

    def error(self, msg: Message) -> P2PXferError:
        return error_from_wire(msg["code"], msg["message"], self.where)

    async def aclose(self) -> None:
        await self.stream.aclose()
