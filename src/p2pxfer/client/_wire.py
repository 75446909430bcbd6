"""The client's end of its conversation with the daemon: requests out,
replies back to whoever awaits them. One class per concurrency regime, each
owning its connection: ``TrioConversation``, ``AsyncioConversation`` (both
over ``Conversation``, which sends, cancels and hands out replies), and, for
blocking callers, ``BlockingConversation`` (``_blocking.py``, a socket of its
own). ``open_conversation`` picks the one for the running loop.

Nobody reads the socket all the time. Under trio, a caller awaiting its reply reads the
socket itself when nobody else does (it *leads*): it hands every other reply
it reads to its caller and stops at its own. Callers that find a leader wait
for it to hand them their reply; a leader whose reply came hands the socket
to a caller still waiting or, when only requests nobody awaits are left (a
KV push not yet awaited), to the connection's reader task. Why: a reply read
by a reader task reaches its caller one or two scheduler rounds later, and
those rounds were most of a no-op round trip (see docs/architecture.md).
Under asyncio a callback of the loop reads (it runs inside the loop's poll;
no task wakes to read).

The socket is used directly (non-blocking ``send`` and ``recv``, parking only
when the kernel says "not now"); anyio's stream only for what must wait or
pass descriptors. What must not live here: the API (``_client``), or the
blocking client's conversation (``_blocking.py``, a socket of its own).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import sniffio
import trio

from p2pxfer._pump import RECEIVE_BYTES, Pump
from p2pxfer.errors import ConnectionLost, P2PXferError, WaitTimeout
from p2pxfer.protocol import (
    CLOSED,
    INITIATOR,
    NEED_DATA,
    SCHEMA_VERSION,
    Connection,
    Message,
    ProtocolError,
)

__all__ = ["AsyncioConversation", "Conversation", "TrioConversation", "open_conversation"]

_READER = object()  # the reader task, when it leads


class _AnyioStream:
    """The client's unix socket (anyio: trio or asyncio), its failures mapped
    at this edge: a broken receive is the end of the stream, a broken send is
    ``ConnectionLost``."""

    def __init__(self, stream: anyio.abc.SocketStream, path: str) -> None:
        self.stream = stream
        self.path = path

    async def receive_some(self) -> bytes:
        try:
            return await self.stream.receive(RECEIVE_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError):
            return b""

    async def send_all(self, data: bytes, fds: Sequence[int] = ()) -> None:
        try:
            if fds:
                await self.stream.send_fds(data, fds)  # type: ignore[attr-defined]
            else:
                await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(f"the daemon at {self.path} is gone: "
                                 f"{exc or type(exc).__name__}") from exc

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Pending:
    """A request sent, its reply not yet taken. ``event`` exists only while
    its caller waits: for a leader (trio; a leader needs none) or for the
    loop's callback (asyncio: a bare future, the cheapest wake-up there)."""

    __slots__ = ("event", "kind", "reply", "rid")

    def __init__(self, kind: str, rid: int) -> None:
        self.kind = kind
        self.rid = rid
        self.reply: Message | None = None
        self.event: anyio.Event | asyncio.Future[None] | None = None

    def wake(self) -> None:
        event = self.event
        if event is None:
            return
        if isinstance(event, asyncio.Future):
            if not event.done():
                event.set_result(None)
        else:
            event.set()


def open_conversation(stream: anyio.abc.SocketStream, max_frame: int,
                      path: str = "") -> Conversation:
    """The conversation for the loop this runs in (trio or asyncio)."""
    if sniffio.current_async_library() == "asyncio":
        return AsyncioConversation(stream, max_frame, path)
    return TrioConversation(stream, max_frame, path)


class Conversation(abc.ABC):
    """Requests and replies over the daemon's socket: what both async
    regimes share (sending, cancelling, handing out replies). Who reads is
    the regime's: ``_await_reply`` and ``run_reader``."""

    def __init__(self, stream: anyio.abc.SocketStream, max_frame: int, path: str = "") -> None:
        self._pump = Pump(Connection("client", INITIATOR, max_frame=max_frame),
                          _AnyioStream(stream, path), "")
        self._send_lock = anyio.Lock(fast_acquire=True)
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        assert isinstance(raw, socket.socket)
        self._raw = raw
        self._path = path
        self._pending: dict[int, _Pending] = {}  # sent, not answered
        self._closed: P2PXferError | None = None
        self.node = ""
        self.incarnation = 0

    @abc.abstractmethod
    async def _await_reply(self, p: _Pending) -> None:
        """Until ``p`` is answered or the conversation is over."""

    @abc.abstractmethod
    async def run_reader(self) -> None:
        """The connection's reader task, for the conversation's lifetime."""

    @abc.abstractmethod
    def _nudge_reader(self) -> None:
        """Replies may be due that nobody reads (a send waits on the socket)."""

    async def handshake(self) -> None:
        msg = await self._pump.hello(v=SCHEMA_VERSION, role="client")
        self.node, self.incarnation = msg["node"], msg["incarnation"]

    # -- reading ----------------------------------------------------------------

    def _take(self) -> Message | None:
        """The next message already read (None: more bytes needed). Raises
        ``ConnectionLost`` at the end of the conversation."""
        event = self._pump.conn.next_event()
        if event is NEED_DATA:
            return None
        if event is CLOSED:
            raise ConnectionLost(f"the daemon at {self._path} closed the connection")
        assert isinstance(event, Message)
        return event

    def _deliver(self, msg: Message) -> None:
        if msg.id is None:
            if msg.kind == "error":
                raise self._pump.error(msg)
            return
        p = self._pending.pop(msg.id, None)
        if p is not None:  # else: a reply to a request whose caller went away
            p.reply = msg
            p.wake()

    def _recv_nowait(self) -> bool:
        """Feed what the socket holds to the connection; False if nothing yet."""
        try:
            data = self._raw.recv(RECEIVE_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        self._pump.conn.receive_data(data)
        return True

    def _fail_all(self, exc: P2PXferError) -> None:
        self._closed = exc
        for p in self._pending.values():
            p.wake()

    # -- requests ---------------------------------------------------------------

    async def request(self, kind: str, fds: list[int] | None = None, *,
                       timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and await its reply. Cancelled (or interrupted)
        while waiting: the daemon is told (``cancel``) and this returns only
        once the daemon has answered the request, i.e. stopped serving it:
        a write's buffer is no longer read, a wait no longer counts. After
        ``timeout`` seconds the same, then ``WaitTimeout`` (unless the reply
        came meanwhile: then it is returned)."""
        pending = await self.start(kind, fds, **fields)
        return await self.finish(pending, timeout)

    async def start(self, kind: str, fds: list[int] | None = None, **fields: Any
                    ) -> _Pending:
        """Send a request; its reply is awaited with ``finish``."""
        if self._closed is not None:
            raise ConnectionLost(f"connection to the daemon is closed ({self._closed})")
        p = _Pending(kind, self._pump.conn.next_id())
        self._pending[p.rid] = p
        try:
            await self._send(kind, fds or (), id=p.rid, **fields)
        except BaseException:
            self._pending.pop(p.rid, None)
            raise
        return p

    async def finish(self, p: _Pending, timeout: float | None = None) -> dict[str, Any]:
        try:
            if timeout is None:
                await self._await_reply(p)
            else:
                with anyio.move_on_after(timeout):
                    await self._await_reply(p)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._cancel(p)
            raise
        if p.reply is None and self._closed is None:  # timed out
            with anyio.CancelScope(shield=True):
                await self._cancel(p)
            reply = p.reply
            if reply is not None and reply.kind == "ok" and \
                    (reply.get("result") or {}).get("cancelled"):
                raise WaitTimeout(f"{p.kind}: no answer within {timeout} s")
        if p.reply is None:
            assert self._closed is not None
            raise ConnectionLost(f"connection to the daemon closed: {self._closed}")
        return self._pump.result(p.reply)

    async def _send(self, kind: str, fds: Sequence[int], **fields: Any) -> None:
        """Encode and send one message (the conversation's state moves as it
        encodes, so encoding and sending happen under one lock). Cancelled
        while waiting for the lock: nothing was sent. Once the frame has
        started, the rest goes out shielded (a frame cut in half would end
        the whole conversation); usually it goes whole in one ``send``."""
        lock = self._send_lock
        if not fds and not lock.locked():
            # Nobody is part way through a frame, and nothing below awaits
            # before the frame is out or the lock is ours: no lock needed.
            data = self._pump.conn.send(kind, None, **fields)
            try:
                sent = self._raw.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise ConnectionLost(f"the daemon at {self._path} is gone: {exc}") from exc
            if sent == len(data):
                return
            lock.acquire_nowait()
            data = data[sent:]
        else:
            try:
                lock.acquire_nowait()
            except anyio.WouldBlock:
                await lock.acquire()
            try:
                data = self._pump.conn.send(kind, None, **fields)
            except BaseException:
                lock.release()
                raise
        try:
            if not fds and self._pending:
                # The daemon may be stalled sending us replies nobody reads:
                # read them while we wait to send.
                self._nudge_reader()
            with anyio.CancelScope(shield=True):
                await self._pump.stream.send_all(data, fds)
        finally:
            lock.release()

    async def _cancel(self, target: _Pending) -> None:
        """Tell the daemon to stop request ``target``; return once it has been
        answered (the daemon answers it before it answers the ``cancel``),
        or the connection is gone (then the daemon dropped it anyway)."""
        if target.reply is not None or self._closed is not None:
            return
        c = _Pending("cancel", self._pump.conn.next_id())
        self._pending[c.rid] = c
        try:
            await self._send("cancel", (), id=c.rid, target=target.rid)
        except P2PXferError:
            self._pending.pop(c.rid, None)
            return
        await self._await_reply(c)

    async def aclose(self) -> None:
        if self._closed is None:
            with contextlib.suppress(ConnectionLost, ProtocolError):
                await self._send("bye", ())
            self._fail_all(ConnectionLost("client closed"))
        with contextlib.suppress(OSError, ValueError):
            anyio.notify_closing(self._raw)  # a leader parked on it wakes up
        await self._pump.aclose()


class TrioConversation(Conversation):
    """Trio: a waiting caller leads (reads the socket and hands out the
    replies it meets); the reader task reads only for requests nobody awaits."""

    def __init__(self, stream: anyio.abc.SocketStream, max_frame: int, path: str = "") -> None:
        super().__init__(stream, max_frame, path)
        self._waiting: dict[int, _Pending] = {}  # callers waiting for a leader
        self._leader: object | None = None  # a _Pending, _READER or None
        self._wanted = anyio.Event()  # wakes the reader task

    def _nudge_reader(self) -> None:
        if self._leader is None:
            self._wanted.set()

    def _fail_all(self, exc: P2PXferError) -> None:
        super()._fail_all(exc)
        self._wanted.set()  # the reader task ends

    async def _lead(self, mine: _Pending | None) -> None:
        """Read and hand out replies until ``mine`` is answered (None: until
        no reply is due that nobody waits for), or the conversation ends."""
        try:
            while self._closed is None and (
                    mine.reply is None if mine is not None else self._unattended()):
                msg = self._take()
                if msg is not None:
                    self._deliver(msg)
                elif not self._recv_nowait():
                    try:
                        await trio.lowlevel.wait_readable(self._raw)
                    except trio.ClosedResourceError:
                        self._pump.conn.receive_data(b"")  # closed under us: the end
        except ProtocolError as exc:
            self._fail_all(ConnectionLost(f"protocol error from the daemon: {exc}"))
        except P2PXferError as exc:
            self._fail_all(exc)

    def _hand_over(self) -> None:
        """The leader left: the socket to a caller still waiting, else to the
        reader task if replies nobody awaits are due."""
        if self._closed is not None or not self._pending:
            return
        for p in self._waiting.values():
            if p.reply is None:
                p.wake()
                return
        self._wanted.set()

    async def _await_reply(self, p: _Pending) -> None:
        """Until ``p`` is answered or the conversation is over: lead if
        nobody does, else wait for the leader to hand the reply over."""
        while p.reply is None and self._closed is None:
            if self._leader is None:
                await self._lead_as(p, p)
            else:
                p.event = event = anyio.Event()
                self._waiting[p.rid] = p
                try:
                    await event.wait()
                finally:
                    del self._waiting[p.rid]

    def _unattended(self) -> bool:
        """Replies are due that no waiting caller will read."""
        return bool(self._pending) and not any(p.reply is None for p in self._waiting.values())

    async def run_reader(self) -> None:
        """Reads for requests nobody awaits right now, so their replies
        never pile up unread (the daemon would stall on a full socket)."""
        while self._closed is None:
            await self._wanted.wait()
            self._wanted = anyio.Event()
            if self._leader is None and self._unattended():
                await self._lead_as(_READER, None)

    async def _lead_as(self, leader: object, mine: _Pending | None) -> None:
        """``_lead`` as ``leader``, then the socket to whoever is next."""
        self._leader = leader
        try:
            await self._lead(mine)
        finally:
            self._leader = None
            self._hand_over()


class AsyncioConversation(Conversation):
    """asyncio: a callback of the loop reads whenever the socket is
    readable, and wakes each caller's future; no task wakes to read."""

    def __init__(self, stream: anyio.abc.SocketStream, max_frame: int, path: str = "") -> None:
        super().__init__(stream, max_frame, path)
        self._loop = asyncio.get_running_loop()

    def _nudge_reader(self) -> None:
        pass  # the loop's callback reads whenever the socket is readable

    def _on_readable(self) -> None:
        """asyncio: the socket has something; read it and hand out replies."""
        try:
            if self._recv_nowait():
                while self._closed is None and (msg := self._take()) is not None:
                    self._deliver(msg)
        except ProtocolError as exc:
            self._fail_all(ConnectionLost(f"protocol error from the daemon: {exc}"))
        except P2PXferError as exc:
            self._fail_all(exc)
        if self._closed is not None:
            self._loop.remove_reader(self._raw)  # at the end it would fire for ever

    async def _await_reply(self, p: _Pending) -> None:
        """Until ``p`` is answered or the conversation is over: the loop's
        callback (``_on_readable``) reads."""
        while p.reply is None and self._closed is None:
            p.event = future = self._loop.create_future()
            await future

    async def run_reader(self) -> None:
        """Keeps ``_on_readable`` on the loop while the conversation lasts."""
        self._loop.add_reader(self._raw, self._on_readable)
        try:
            await anyio.sleep_forever()
        finally:
            self._loop.remove_reader(self._raw)
