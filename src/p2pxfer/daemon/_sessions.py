"""Client sessions: the unix socket, one ``ClientSession`` per client.

A session holds its client's memory (memfds mapped here and registered with
the engine) and its exports (each over a mapping of its own, retired at
unexport), and serves its requests through ``_handlers.HANDLERS``. Requests
that wait (``write``, ``wait_imm``, ``watch``, ``locate``) run as tasks, so
one client can have many in flight, within its caps (``_limits``). A client
that goes away loses its regions and memory; nobody else notices. A local
write into another uid's region, an export of a name outside the client's
uid's scope and ``add_peer`` from an unprivileged uid are refused. What must
not live here: the listener (``_listener``), mapping shared memory
(``_shared``), the region directory's rules (``_regions``), the write path
(``_writes``) or the caps' arithmetic (``_limits``).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import trio

from p2pxfer._pump import Pump, bounded, where_raised
from p2pxfer.errors import (
    DeviceError,
    Forbidden,
    InvalidArgument,
    P2PXferError,
    UnknownRegion,
    UnregisteredMemory,
)
from p2pxfer.log import get_logger
from p2pxfer.protocol import (
    RESPONDER,
    SCHEMA_VERSION,
    Connection,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    wire_error,
)

from ._device import DeviceShare, check_share, gpu_of, takes_device_memory
from ._exports import Export
from ._handlers import HANDLERS
from ._imms import ImmCounts
from ._io import UnixFdStream
from ._kv import Pool
from ._shared import SharedMap

if TYPE_CHECKING:
    from ._daemon import Daemon

__all__ = ["HANDLERS", "ClientSession"]

log = get_logger("p2pxfer.daemon")

#: requests served as tasks of the session (they wait); the rest in turn
CONCURRENT = frozenset({"write", "wait_imm", "watch", "locate", "cancel", "kv_push",
                        "kv_wait", "kv_abandon"})
#: what a request stopped by the client's ``cancel`` is answered
CANCELLED: dict[str, Any] = {"cancelled": True}
HELLO_TIMEOUT_S = 10.0  # a client that has not said hello by then is closed
#: an export of a name whose owner has hung up waits this long for its release
RELEASE_WAIT_S = 5.0
#: requests a session serves before it yields to the rest of the daemon even
#: when it never had to wait (reading, answering): a client that pipelines
#: requests must not starve the others
FAIR_REQUESTS = 16

MAX_WRITERS = 64  # uids one export may grant


def check_writers(writers: Any) -> frozenset[int]:
    """An export's ``writers``: other uids that may write into it from this
    node (a list of ints >= 0, at most ``MAX_WRITERS``)."""
    if writers is None:
        return frozenset()
    if (not isinstance(writers, list) or len(writers) > MAX_WRITERS
            or not all(type(u) is int and 0 <= u < 1 << 32 for u in writers)):
        raise InvalidArgument(f"writers must be a list of at most {MAX_WRITERS} numeric "
                              f"uids, got {bounded(repr(writers), 100)}")
    return frozenset(writers)


class ClientSession:
    """One connected client: its memory, its exports, its requests in flight."""

    def __init__(self, daemon: Daemon, sock: socket.socket | trio.socket.SocketType, pid: int,
                 uid: int = -1) -> None:
        self.daemon = daemon
        self.label = f"pid:{pid}"
        self.uid = uid
        self.stream = UnixFdStream(sock, self.label)
        self.pump = Pump(Connection("client", RESPONDER, max_frame=daemon.config.max_frame),
                         self.stream, f"client {self.label}")
        self.mems: dict[int, SharedMap | DeviceShare] = {}
        #: immediates landed in this session's regions (they die with it)
        self.counts = ImmCounts(self.label, max_waiters=daemon.config.max_waiters_per_client)
        self.kv_pools: dict[str, Pool] = {}  # this client's KV pools, by name
        self._next_mem = 1
        self._greeting = trio.CancelScope()  # until hello (deadline set in run)
        # Requests running as tasks, by id: ``cancel`` stops one (its scope)
        # and waits until it has been answered (its event).
        self.running: dict[int, tuple[trio.CancelScope, trio.Event]] = {}
        self.released = trio.Event()  # its exports, registrations and mappings are gone

    async def run(self) -> None:
        log.info("client.connected", client=self.label)
        # A connection that never says hello holds a descriptor and a slot of
        # max_clients: not for long.
        self._greeting.deadline = trio.current_time() + HELLO_TIMEOUT_S
        try:
            async with trio.open_nursery() as nursery:
                try:
                    with self._greeting:
                        await self._serve(nursery)
                    if self._greeting.cancelled_caught:
                        log.warning("client.hello_timeout", client=self.label,
                                    seconds=HELLO_TIMEOUT_S)
                finally:
                    nursery.cancel_scope.cancel()  # pending writes finish, shielded
        finally:
            with trio.CancelScope(shield=True):
                if self.stream.flooded:
                    log.warning("client.fd_flood", client=self.label,
                                error="sent more file descriptors than share requests allow")
                await self._release()
                self.released.set()
                await self.stream.aclose()
            log.info("client.gone", client=self.label)

    async def _serve(self, nursery: trio.Nursery) -> None:
        served = 0
        while True:
            served += 1
            if served >= FAIR_REQUESTS:
                served = 0
                await trio.lowlevel.checkpoint()
            try:
                if (idle_s := self.daemon.limits.idle_s(self)) is None:
                    msg = await self.pump.receive()
                else:
                    # It holds nothing: a slot of max_clients is all it costs,
                    # and it cannot keep that for ever by saying nothing.
                    msg = None
                    with trio.move_on_after(idle_s) as idle:
                        msg = await self.pump.receive()
                    if idle.cancelled_caught:
                        log.warning("limit.idle", client=self.label, uid=self.uid,
                                    seconds=idle_s)
                        return
            except RemoteProtocolError as exc:
                log.warning("client.protocol_error", client=self.label, code=exc.code,
                            error=bounded(exc.message))
                if exc.kind == "share":
                    # Its descriptor came with it: refused with the frame, or
                    # the client's next share would map this one's memory.
                    self.stream.drop_fd()
                await self._send(self.pump.send_error(exc))
                if exc.fatal:
                    return
                continue
            if msg is None or msg.kind == "bye":
                return
            if msg.kind == "error":  # the client ends the connection, saying why
                log.info("client.error_received", client=self.label,
                         code=bounded(str(msg.get("code")), 100),
                         error=bounded(str(msg.get("message"))))
                return
            if msg.kind == "hello":
                d = self.daemon
                await self._send(self.pump.send("welcome", v=SCHEMA_VERSION, node=d.node,
                                                incarnation=d.incarnation,
                                                max_frame=d.config.max_frame))
                # Its credentials passed at accept: full-size frames from now on.
                self.pump.conn.lift_frame_limit()
                self._greeting.deadline = math.inf
            elif msg.kind in CONCURRENT or (msg.kind == "kv_forget" and msg.get("refuse")):
                # A forget that refuses waits for pushes under way: it must
                # not hold up the client's other requests. Its refusal holds
                # from now on, whatever becomes of the wait (with room of its
                # own beside the cap, as a ``cancel`` has).
                try:
                    if msg.kind == "kv_forget":
                        self.daemon.kv.refuse(self, msg["pool"], msg["request"])
                    self.daemon.limits.request(self, "cancel" if msg.kind == "kv_forget"
                                               else msg.kind)
                except P2PXferError as exc:
                    await self._send(self.pump.answer(msg.id, exc))
                    continue
                # Registered before the task starts: a ``cancel`` right behind
                # this request must find it.
                if msg.id is not None:
                    self.running[msg.id] = (trio.CancelScope(), trio.Event())
                nursery.start_soon(self._answer_task, msg)
            else:
                await self._answer(msg)

    async def _send(self, sending: Awaitable[None]) -> None:
        try:
            await sending
        except LocalProtocolError as exc:
            # We cannot say this (too big, not encodable...): this client's
            # conversation is over; nobody else's is.
            log.warning("client.closed_on_error", client=self.label, code=exc.code,
                        error=bounded(exc.message))
            self.stream.shutdown()
        except P2PXferError:
            pass  # the client is gone; the receive side notices

    async def _answer_task(self, msg: Message) -> None:
        """A concurrent request: ``cancel`` may stop it. A stopped request is
        answered ``CANCELLED`` once its handler has returned (a write only
        after its posted pieces have finished: the client's buffer is then
        no longer read)."""
        rid = msg.id
        scope, answered = self.running.get(rid, (trio.CancelScope(), trio.Event())) \
            if rid is not None else (trio.CancelScope(), trio.Event())
        try:
            await self._answer(msg, scope)
        finally:
            if rid is not None and self.running.get(rid, (None,))[0] is scope:
                del self.running[rid]
            answered.set()

    async def _answer(self, msg: Message, scope: trio.CancelScope | None = None) -> None:
        """Serve ``msg`` and answer it. A request served as a task runs in
        ``scope``, which its ``cancel`` cancels; one answered in turn needs
        none (entering a scope cost a no-op a tenth of its daemon time)."""
        outcome: dict[str, Any] | BaseException = CANCELLED
        if scope is None:
            outcome = await self._outcome(msg)
        else:
            with scope:
                try:
                    outcome = await self._outcome(msg)
                except trio.Cancelled:
                    if not scope.cancel_called:
                        raise  # the session is ending, not this request
                    log.info("request.cancelled", client=self.label, kind=msg.kind, id=msg.id)
                    raise
        await self._send(self.pump.answer(msg.id, outcome))

    async def _outcome(self, msg: Message) -> dict[str, Any] | BaseException:
        """The handler's result, or the exception it failed with."""
        try:
            return await HANDLERS[msg.kind](self, msg)
        except Exception as exc:  # every failure becomes an answer, never a crash
            if not isinstance(exc, P2PXferError):
                log.error("request.crashed", client=self.label, kind=msg.kind,
                          error=bounded(f"{type(exc).__name__}: {exc}"), where=where_raised(exc))
            where = {k: msg.get(k) for k in ("peer", "region", "name")
                     if msg.get(k) is not None}
            log.info("request.failed", client=self.label, kind=msg.kind, **where,
                     code=wire_error(exc)[0], error=bounded(str(exc)))
            return exc

    async def cancel(self, target: int) -> None:
        """Stop request ``target`` (if it still runs) and return once it has
        been answered."""
        running = self.running.get(target)
        if running is None:
            return  # answered already (or never a request that waits)
        scope, answered = running
        scope.cancel()
        await answered.wait()

    # -- memory and exports -----------------------------------------------------

    @property
    def privileged(self) -> bool:
        """Root or the daemon's own uid: may change node-wide state."""
        return self.uid in (0, os.getuid())

    @property
    def exports(self) -> dict[str, Export]:
        """This client's exports, by name (held by the daemon's ``Exports``)."""
        return self.daemon.exports.owned_by(self)

    def may_write_into(self, region: str) -> None:
        """``Exports.check_writer`` for this client: ``UnknownRegion`` for a
        region of this daemon its uid may not write into."""
        self.daemon.exports.check_writer(region, self.uid, self.privileged, self.label)

    @property
    def mapped(self) -> int:
        """Bytes of this client's memory mapped here (exports map their
        ranges once more)."""
        return sum(m.size for m in self.mems.values()) \
            + sum(e.own.size for e in self.exports.values())

    def may_name(self, name: str) -> None:
        """Region names are scoped by uid, so no uid can take a name another
        uid's service expects (before it starts, or while it reconnects) and
        receive the remote writes meant for it: ``~U/...`` belongs to uid U
        alone; every other name to root and the daemon's uid, whose regions
        remote peers reach by plain names. ``Forbidden`` otherwise."""
        if name.startswith("~"):
            if not name.startswith(f"~{self.uid}/"):
                raise Forbidden(f"uid {self.uid} may not export {bounded(name, 100)!r}: a name "
                                f"under '~UID/' belongs to that uid (this client's: "
                                f"'~{self.uid}/')")
        elif not self.privileged:
            raise Forbidden(f"uid {self.uid} may export names under '~{self.uid}/' only, not "
                            f"{bounded(name, 100)!r}: names without '~' belong to root and the "
                            f"daemon's uid ({os.getuid()})")

    def mem(self, mem_id: int) -> SharedMap | DeviceShare:
        mem = self.mems.get(mem_id)
        if mem is None:
            raise UnregisteredMemory(f"no shared memory {mem_id} on this connection")
        return mem

    def share(self, size: int) -> int:
        if (fd := self.stream.take_fd()) is None:
            raise InvalidArgument("share came without a file descriptor")
        try:
            if size <= 0:
                raise InvalidArgument(f"share size must be > 0, got {size}")
            self.daemon.limits.share(self, size)
            mem = SharedMap(self._next_mem, fd, size, self.uid)
        finally:
            os.close(fd)
        self._next_mem += 1
        self.mems[mem.id] = mem
        self.daemon.engine.register(mem.map, writable=True)
        log.info("memory.shared", client=self.label, mem=mem.id, nbytes=size)
        return mem.id

    async def share_device(self, handle: bytes, offset: int, size: int, gpu: bytes) -> int:
        """Device memory of the client's, by its CUDA IPC handle (``_device``):
        opened here and registered as is. ``DeviceError`` (before any CUDA
        call) where this daemon's engine cannot register device memory."""
        d = self.daemon
        check_share(handle, offset, size, gpu)
        if not takes_device_memory(d.engine):
            raise DeviceError(
                f"this daemon does not take device memory: provider {d.config.provider!r} "
                + ("was not offered with FI_HMEM (a libfabric built without CUDA, or a "
                   "provider that never moves device memory, as tcp)" if d.config.hmem else
                   "is not opened for it (config hmem = false)")
                + "; stage it through shared memory instead")
        device = await gpu_of(gpu)
        d.limits.share(self, size)  # after the wait: what others mapped meanwhile counts
        mem = DeviceShare(d.ipc_maps, self._next_mem, handle, offset, size, device, self.uid)
        self._next_mem += 1
        self.mems[mem.id] = mem
        log.info("memory.shared", client=self.label, mem=mem.id, nbytes=size, kind=mem.kind,
                 device=mem.device)
        return mem.id

    def unshare(self, mem_id: int) -> None:
        mem = self.mem(mem_id)
        if self.daemon.exports.backing(self, mem.id) or any(p.mem_id == mem.id
                                                            for p in self.kv_pools.values()):
            raise InvalidArgument(f"memory {mem.id} still backs an export or a KV pool")
        if isinstance(mem, DeviceShare):
            if mem.busy:
                raise InvalidArgument(f"memory {mem.id} is being copied from or into by "
                                      f"{mem.busy} write(s): give it back once they are over")
        else:
            self.daemon.engine.deregister(mem.map)  # a share's own; a device share's goes
        del self.mems[mem.id]                       # with its allocation's last (``_device``)
        mem.close()

    def hung_up(self) -> bool:
        """The client closed its end (its session may not have read the end
        of the stream yet)."""
        if self.released.is_set():
            return True
        try:  # a peek on a duplicate: the session's socket may be trio's (async recv)
            with socket.socket(fileno=os.dup(self.stream.sock.fileno())) as peek:
                return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    async def name_freed(self, name: str) -> None:
        """Before exporting ``name``: ``Exports.freed`` (a client that hung
        up and still holds it releases it first)."""
        await self.daemon.exports.freed(name, self, RELEASE_WAIT_S)

    def export(self, name: str, mem_id: int, offset: int, length: int,
               writers: Any = None) -> dict[str, Any]:
        d = self.daemon
        grants = check_writers(writers)
        self.may_name(name)
        d.exports.check_free(name)
        d.limits.export(self, length)
        export = d.exports.add(self, name, self.mem(mem_id), offset, length, grants,
                               self.counts.sink(name))
        return export.desc.to_wire()

    async def unexport(self, name: str, reason: str | None = None) -> None:
        """Unexport ``name`` (``Exports.remove``; ``reason``: withdrawn, and
        later writers hear why): once this returns no byte lands in the
        region's memory from here."""
        if name not in self.exports:
            raise UnknownRegion(f"this client exported no {name!r}")
        await self.daemon.exports.remove(name, reason)

    def withdraw(self, name: str, reason: str) -> None:
        """A tombstone for ``name``, a name this client may export but that
        is not exported now (one it will never export: a writer waiting
        for it to appear hears ``reason``, ``Exports.absent``)."""
        self.may_name(name)
        self.daemon.exports.check_free(name)
        self.daemon.exports.withdraw(name, reason, self.uid, frozenset())

    async def _release(self) -> None:
        """The client is gone: drop its exports (once copies into them have
        stopped), registrations and mappings. Runs shielded."""
        for name in list(self.exports):
            try:
                await self.unexport(name)
            except P2PXferError as exc:
                log.warning("region.unexport_failed", region=name, error=bounded(str(exc)))
        self.kv_pools.clear()
        for mem in self.mems.values():
            with contextlib.suppress(P2PXferError):
                if isinstance(mem, SharedMap):
                    self.daemon.engine.deregister(mem.map)
                mem.close()
        self.mems.clear()
