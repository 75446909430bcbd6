"""The client library: talk to the node daemon over its unix socket.

Works under trio and asyncio alike (anyio). Memory is shared with the daemon
without copies: ``alloc`` creates a memfd, maps it here and passes the fd to
the daemon with SCM_RIGHTS, which maps and registers the same pages. Errors
the daemon reports come back as the class ``p2pxfer.protocol.ERRORS`` names
for their code (each carries its ``code``); a connection to the daemon that
ends while a request waits raises ``ConnectionLost``.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt

from p2pxfer.buffers import RegionDescriptor, SharedBuffer
from p2pxfer.errors import (
    ConnectionLost,
    DaemonError,
    InvalidArgument,
    P2PXferError,
    WaitTimeout,
)
from p2pxfer.kv_plan import KVLayout
from p2pxfer.log import get_logger
from p2pxfer.protocol import check_reason, pack_scatter
from p2pxfer.scatter import ScatterList

from ._devshare import DeviceShared, device_memory_of, device_share
from ._kv import KVPool, KVPush, open_pool, start_push
from ._wire import Conversation, open_conversation

__all__ = ["Client", "DaemonError", "DeviceShared", "KVPool", "KVPush", "MemberUpdate",
           "SharedMemory", "connect"]

log = get_logger("p2pxfer.client")

#: how long past a ``wait_imm`` timeout the client waits for the daemon's own
#: "timed out" answer before giving up on the daemon itself
WAIT_MARGIN_S = 5.0


@dataclass(frozen=True)
class MemberUpdate:
    """A membership change as the node's daemon saw it (:meth:`Client.watch_members`).

    ``event``: ``"present"`` (a member as it is when watching starts, or starts
    over after falling behind), ``"joined"``, ``"alive"`` (a suspect proved
    alive, or a degraded member answers on every rail again), ``"degraded"``
    (alive, but some of its rails do not answer; still current),
    ``"suspect"``, ``"dead"``, ``"left"`` or ``"restarted"`` (a new life:
    whatever ``previous_incarnation`` exported is void). ``state``: one of
    ``"alive"``, ``"degraded"``, ``"suspect"``, ``"dead"``, ``"left"``."""

    event: str
    name: str
    address: str
    state: str
    incarnation: int
    previous_incarnation: int | None = None

    @classmethod
    def _from_wire(cls, event: str, m: dict[str, Any]) -> MemberUpdate:
        return cls(event, str(m["name"]), str(m["address"]), str(m["state"]),
                   int(m["incarnation"]), m.get("previous_incarnation"))


class SharedMemory:
    """Memory shared with the daemon: ``array`` is a writable uint8 numpy view."""

    def __init__(self, buf: SharedBuffer, mem_id: int) -> None:
        self.buffer = buf
        self.mem_id = mem_id
        #: the device copies of a device KV pool over this memory (its host
        #: mirror): closed (unpinned) before the memory is unmapped
        self.stage: Any = None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return self.buffer.array

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def close(self) -> None:
        try:
            if self.stage is not None:
                stage, self.stage = self.stage, None
                stage.close()
        finally:
            self.buffer.close()


class Client:
    """A connection to the node daemon. Use :func:`connect`."""

    def __init__(self, conversation: Conversation) -> None:
        #: the conversation with the daemon, of this loop's regime
        self._conv = conversation
        self._mems: list[SharedMemory | DeviceShared] = []
        #: ``status``'s ``device_memory``, once asked (``takes_device_memory``)
        self._takes_device: tuple[bool | None] | None = None

    # -- API ------------------------------------------------------------------

    async def alloc(self, nbytes: int, name: str = "p2pxfer") -> SharedMemory:
        """Shared memory of ``nbytes``, mapped here and registered by the daemon."""
        with new_buffer(nbytes, name) as buf:
            result = await self._conv.request("share", fds=[buf.fd], size=nbytes, name=name)
        mem = SharedMemory(buf, int(result["mem"]))
        self._mems.append(mem)
        return mem

    async def takes_device_memory(self) -> bool | None:
        """Whether the daemon takes device memory as is (``status``'s
        ``device_memory``, asked once per connection); None for a daemon
        that predates :meth:`share_device`."""
        if self._takes_device is None:
            self._takes_device = (device_memory_of(await self.status()),)
        return self._takes_device[0]

    async def share_device(self, obj: Any) -> DeviceShared:
        """Hand device memory (a CUDA tensor, ``__cuda_array_interface__``
        or DLPack object) to the daemon as is: it opens the allocation from
        a CUDA IPC handle and registers it, so writes land in it and
        pushes read from it with no host copy. ``DeviceError`` where the
        daemon cannot (its provider registers no device memory: status
        ``device_memory``), or where CUDA cannot hand this memory over
        (memory of the virtual memory API, e.g. torch's expandable
        segments). Give it back with :meth:`free`."""
        dev, fields = await anyio.to_thread.run_sync(device_share, obj)
        result = await self._conv.request("share_device", **fields)
        shared = DeviceShared(dev, int(result["mem"]))
        self._mems.append(shared)
        return shared

    async def free(self, mem: SharedMemory | DeviceShared) -> None:
        """Give shared memory back: the daemon deregisters and unmaps it (it
        must not back an export), then it is unmapped here."""
        await self._conv.request("unshare", mem=mem.mem_id)
        self._forget(mem)

    def _forget(self, mem: SharedMemory | DeviceShared) -> None:
        if mem in self._mems:
            self._mems.remove(mem)
        mem.close()

    async def export(self, name: str, mem: SharedMemory, offset: int = 0,
                     length: int | None = None, *,
                     writers: Iterable[int] | None = None) -> RegionDescriptor:
        """Let peers write into ``mem[offset:offset+length]`` as region ``name``.
        Clients of this node may write into it only under our uid, root or
        the daemon's, or a uid in ``writers``."""
        length = mem.nbytes - offset if length is None else length
        fields: dict[str, Any] = {} if writers is None else {"writers": list(writers)}
        result = await self._conv.request("export", name=name, mem=mem.mem_id, offset=offset,
                                     length=length, **fields)
        return RegionDescriptor.from_wire(result["descriptor"])

    async def unexport(self, name: str, *, reason: str | None = None) -> None:
        """Withdraw the region ``name``: once this returns, no byte lands in
        its memory. With ``reason``, a writer that comes later (for up to
        ten minutes) hears ``RegionWithdrawn`` with it instead of
        ``UnknownRegion``: one that waits for the region to appear can stop
        waiting."""
        await self._conv.request("unexport", name=name, **unexport_fields(reason))

    async def withdraw(self, name: str, reason: str) -> None:
        """Say that the region ``name`` (a name this client may export, not
        exported now) will not come: for ten minutes, or until it is
        exported, a writer that names it hears ``RegionWithdrawn`` with
        ``reason`` instead of ``UnknownRegion``, as after ``unexport`` with
        a reason."""
        check_reason(reason)
        await self._conv.request("withdraw", name=name, reason=reason)

    async def write(self, peer: str, region: str, scatter: ScatterList, *, src: SharedMemory,
                    src_offset: int = 0, imm: int | None = None, notify: bool = False,
                    timeout: float | None = None) -> int:
        """Write ``scatter`` from ``src`` (offsets relative to ``src_offset``)
        into ``region`` on node ``peer``; returns once every piece has
        completed, with how many immediates the region's owner will count
        for it (``wait_imm(imm, n)``): the pieces written, each carrying
        ``imm``, or with ``notify=True`` 1: ``imm`` arrives once, after every
        byte of the write is in the target's memory. Prefer ``notify``: the
        receiver need not know how the write was striped, and such a write
        fails over to another rail when one breaks under it (a per-piece
        write fails then, as its count could no longer be exact).

        Cancellation (like the engine's ``write``): the daemon is told, stops
        posting, waits for the pieces already posted, then answers; only then
        does this raise, so ``src`` may be refilled at once. What landed of a
        cancelled write is a prefix of its pieces, whole pieces only.
        ``timeout`` (seconds) cancels the write that way, then raises
        ``WaitTimeout``. The daemon gives every write a deadline of its own
        (its config's ``write_timeout_s``, 60 s by default) and answers
        ``transfer_failed`` when it passes."""
        if not isinstance(scatter, ScatterList):
            raise InvalidArgument(f"scatter must be a ScatterList, got {type(scatter).__name__}")
        if timeout is not None and (not isinstance(timeout, (int, float))
                                    or isinstance(timeout, bool) or not timeout > 0):
            raise InvalidArgument(f"timeout must be a number of seconds > 0, got {timeout!r}")
        packed = pack_scatter(scatter.src, scatter.dst, scatter.length)
        with anyio.move_on_after(timeout) as scope:
            extra: dict[str, Any] = {"notify": True} if notify else {}
            result = await self._conv.request("write", peer=peer, region=region, mem=src.mem_id,
                                         offset=src_offset, scatter=packed, imm=imm, **extra)
        if scope.cancelled_caught:
            raise WaitTimeout(f"write to {region!r} on {peer!r} did not finish within "
                              f"{timeout:g} s")
        return int(result["pieces"])

    async def wait_imm(self, imm: int, count: int, *, region: str | None = None,
                       timeout: float | None = None) -> None:
        """Return once ``count`` pieces carrying ``imm`` have landed in
        ``region`` (one of this client's exports), or, without ``region``, in
        any region this client exported; they are consumed (the two views
        count apart). Pieces for other clients' regions never count here,
        nor do counts left by clients gone. ``imm`` is at most 20 bits wide
        on every fabric (``status()["imm_value_bits"]``; ``bad_request``
        beyond): where the CQ data has 8 bytes the rest carries the region
        slot's secret tag (``docs/security.md``).
        ``WaitTimeout`` after ``timeout`` seconds. A wait that times out or is
        cancelled leaves nothing behind in the daemon: the pieces it had not
        consumed count for the next wait."""
        fields: dict[str, Any] = {"region": region} if region is not None else {}
        if timeout is None:
            await self._conv.request("wait_imm", imm=imm, count=count, **fields)
            return
        # The daemon keeps the deadline, so it can say how many arrived; ours
        # is the backstop for a daemon that does not answer at all.
        result = await self._conv.request("wait_imm", imm=imm, count=count,
                                     timeout_ms=max(0, round(timeout * 1000)),
                                     timeout=timeout + WAIT_MARGIN_S, **fields)
        if result.get("timed_out"):
            raise wait_timed_out(result, imm, count, region, timeout)

    async def ping(self, peer: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """Check the way to ``peer`` through this daemon, step by step: a
        control round trip, then a small verified write over each of the
        peer's rails (every rail pair that reaches it). The result says
        ``ok``; where a step failed, ``failed`` names it and, where a port
        did not answer, the port. ``timeout`` bounds each step."""
        return await self._conv.request("ping", peer=peer, timeout_ms=max(1, round(timeout * 1000)),
                                   timeout=None)

    async def kv_pool(self, name: str, layout: KVLayout, *, receive: bool = True,
                      writers: Iterable[int] | None = None, device: Any = None,
                      memory: SharedMemory | None = None, direct: bool | None = None
                      ) -> KVPool:
        """A paged KV pool of ``layout`` in memory shared with the daemon.
        ``receive``: exported as ``name`` so peers can push into it (the
        decode side); otherwise only a source to push from (prefill).
        ``writers``: other uids of this node that may push into it.
        ``device``: the pool is this device memory (a CUDA tensor,
        ``__cuda_array_interface__`` or DLPack object laid out as
        ``layout``): taken as is where the daemon can (:meth:`share_device`;
        ``direct``, ``kind`` ``"cuda"``: peers write into it, pushes read
        it), else staged through shared memory (``p2pxfer.devmem``; its
        waits then take ``blocks=``). ``direct``: None tries direct, then
        stages; True insists (``DeviceError`` where the daemon cannot);
        False always stages. ``memory``: lay the pool over shared
        memory this client allocated already (``alloc``; e.g. where an
        engine placed its KV tensors) instead of allocating its own; it
        stays the caller's if the pool cannot be opened."""
        return await open_pool(self, name, layout, receive, writers, device, memory, direct)

    async def kv_push(self, peer: str, pool: str, src: KVPool, src_blocks: Any,
                      dst_blocks: Any, *, request: int, layers: Iterable[int] | None = None,
                      deadline: float = 30.0) -> KVPush:
        """Push blocks ``src_blocks`` of ``src`` into blocks ``dst_blocks``
        of pool ``pool`` on node ``peer``, one transfer per layer (all
        layers, or ``layers``), in layer order; returns once the push is
        sent to the daemon, with a handle to ``await push.wait()``. The
        receiver may wait on ``request`` (an int >= 0 both sides agree on,
        e.g. the decode side's) as layers land. Everything is checked before
        anything is posted; the receiver gives up on the request after
        ``deadline`` seconds (``WaitTimeout`` there)."""
        return await start_push(self, peer, pool, src, src_blocks, dst_blocks, request,
                                layers, deadline)

    async def kv_abandon(self, peer: str, pool: str, request: int, *,
                         reason: str = "") -> bool:
        """Tell node ``peer`` that this node pushes no more of ``request``
        into its pool ``pool`` (aborted here, or its push failed): the
        receiver's waits on it end now with ``TransferAborted`` quoting
        ``reason`` (at most 1024 characters), not at the push's deadline,
        and later pushes of it are refused there until the receiver forgets
        it. Allowed to whoever may push into the pool. True if that ended
        the request; False if it was over already (every layer landed,
        given up, ended)."""
        check_reason(reason)
        r = await self._conv.request("kv_abandon", peer=peer, pool=pool, request=request,
                                     reason=reason)
        return bool(r.get("ended"))

    async def status(self) -> dict[str, Any]:
        return await self._conv.request("status")

    async def peers(self) -> list[dict[str, Any]]:
        return list((await self._conv.request("peers"))["peers"])

    async def lookup(self, name: str) -> dict[str, Any] | None:
        """The member (or static peer) called ``name`` as this node's daemon
        sees it: address and, with membership, state, incarnation and seconds
        since last heard. None if the daemon knows no such node."""
        return next((p for p in await self.peers() if p["name"] == name), None)

    async def locate(self, region: str) -> list[str]:
        """The nodes that export a region called ``region`` (this one
        included), as far as this node's daemon can reach right now."""
        return [str(n) for n in (await self._conv.request("locate", region=region))["nodes"]]

    async def watch_members(self, *, poll_s: float = 30.0) -> AsyncIterator[MemberUpdate]:
        """Membership changes, as they happen, for as long as you iterate:
        first a ``"present"`` update per member (this node included), then
        one per change. If this watcher falls so far behind that the daemon
        dropped changes it had not seen, it starts over with ``"present"``
        updates. Needs membership on the daemon (``bad_request`` otherwise).
        Each round trip waits up to ``poll_s`` for news (a long poll)."""
        after = -1
        while True:
            result = await self._conv.request("watch", after=after, timeout_ms=int(poll_s * 1000))
            if result.get("reset"):
                for m in result["members"]:
                    yield MemberUpdate._from_wire("present", m)
            for e in result["events"]:
                yield MemberUpdate._from_wire(e["event"], e)
            after = int(result["next"])

    async def add_peer(self, name: str, address: str) -> None:
        await self._conv.request("add_peer", name=name, address=address)

    @property
    def node(self) -> str:
        """The daemon's node name (from its welcome)."""
        return self._conv.node

    @property
    def incarnation(self) -> int:
        """The daemon's life (from its welcome)."""
        return self._conv.incarnation

    async def aclose(self) -> None:
        await self._conv.aclose()
        for mem in self._mems:
            mem.close()
        self._mems.clear()


def unexport_fields(reason: str | None) -> dict[str, Any]:
    """An ``unexport``'s optional fields (its reason checked)."""
    if reason is None:
        return {}
    check_reason(reason)
    return {"reason": reason}


@contextlib.contextmanager
def new_buffer(nbytes: int, name: str) -> Iterator[SharedBuffer]:
    """Memory to offer the daemon (``share``); closed if the offer fails."""
    buf = SharedBuffer(nbytes, name)
    try:
        yield buf
    except BaseException:
        buf.close()
        raise


def wait_timed_out(result: dict[str, Any], imm: int, count: int, region: str | None,
                   timeout: float) -> WaitTimeout:
    """A ``wait_imm`` the daemon ended at its deadline, saying how many came."""
    where = f"on region {region!r}" if region is not None else "on this client's regions"
    return WaitTimeout(f"{result.get('arrived', 0)} of {count} arrivals for imm {imm} "
                       f"{where} within {timeout:g} s")


def unreachable(path: str, exc: OSError) -> str:
    """Why the daemon's socket at ``path`` could not be reached, and what to
    do next: no socket, or a socket nobody listens on (left by a daemon that
    died) both mean no daemon runs there."""
    text = f"cannot reach the p2pxfer daemon at {path}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
        stale = " (a socket left by a daemon that stopped)" if exc.errno == \
            errno.ECONNREFUSED else ""
        return (f"{text}{stale}; is the daemon running? start it with `p2pxfer daemon "
                f"--socket {path} ...` (or `p2pxfer daemon --config FILE`), or pass the "
                f"socket it listens on (--socket)")
    if exc.errno == errno.EACCES:
        return (f"{text}; the socket is mode 0600 for the daemon's uid: run as that uid, "
                f"or list yours in the daemon's allowed_uids")
    return text


@asynccontextmanager
async def connect(path: str, *, max_frame: int = 16 << 20) -> AsyncIterator[Client]:
    """Connect to the daemon at ``path`` for the duration of the block."""
    try:
        stream = await anyio.connect_unix(path)
    except OSError as exc:
        raise ConnectionLost(unreachable(path, exc)) from exc
    client = Client(open_conversation(stream, max_frame, path))
    try:
        await client._conv.handshake()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client._conv.run_reader)
                try:
                    yield client
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The reader's task group wraps what the caller's block raised:
            # ``except WaitTimeout`` around the block must still catch it.
            raise _one_of(group) from None
    finally:
        with anyio.CancelScope(shield=True):
            await client.aclose()


def _one_of(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception a caller should see for ``group``: its only leaf, else
    the first that is not a cancellation (ours before others), else the
    group itself."""
    found: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                walk(sub)
        else:
            found.append(exc)

    walk(group)
    if len(found) == 1:
        return found[0]
    cancelled = anyio.get_cancelled_exc_class()
    real = [e for e in found if not isinstance(e, cancelled)]
    ours = [e for e in real if isinstance(e, P2PXferError)]
    return (ours or real or [group])[0]
