"""The node daemon: owns the engine, serves clients on a unix socket and peer
daemons on a TCP control port.

Clients hand memory over as memfds (SCM_RIGHTS); the daemon maps and
registers it, exports regions by name, resolves ``(peer, region)`` to
descriptors through the peer's control port, and runs writes on the engine.
A client that goes away loses its regions and memory; nobody else notices.
What must not live here: protocol rules (``p2pxfer.protocol``) and the data
path (``p2pxfer.engine``).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from typing import Any

import structlog
import trio

from p2pxfer.engine import Engine, EngineConfig, open_engine
from p2pxfer.errors import P2PXferError, TransferError
from p2pxfer.membership import (
    ClusterAuth,
    EmbeddedBackend,
    EtcdBackend,
    MemberAlive,
    MemberDead,
    MemberJoined,
    MemberLeft,
    MemberRestarted,
    MembershipBackend,
    MembershipEvent,
    MemberSuspect,
    PeerLost,
    Superseded,
)
from p2pxfer.memory import RegionDescriptor
from p2pxfer.protocol import (
    CLOSED,
    INITIATOR,
    NEED_DATA,
    RESPONDER,
    SCHEMA_VERSION,
    Connection,
    Message,
    ProtocolError,
    RemoteProtocolError,
    unpack_scatter,
)
from p2pxfer.scatter import ScatterList

from ._config import DaemonConfig, PeerAddress, parse_hostport
from ._io import RequestError, close_fds, error_code, peer_credentials, recv_with_fds
from ._metrics import DaemonMetrics, serve_metrics
from ._notes import rails, slow_paths

__all__ = ["Daemon", "serve"]

log = structlog.get_logger("p2pxfer.daemon")

PEER_TIMEOUT_S = 5.0
STOP_MEMBERSHIP_S = 3.0  # at most this long saying goodbye on the way out


class _Mem:
    """A client's memfd, mapped here and registered with the engine."""

    def __init__(self, mem_id: int, fd: int, size: int) -> None:
        st = os.fstat(fd)
        if st.st_size < size:
            raise RequestError("bad_request", f"memfd holds {st.st_size} bytes, not {size}")
        self.id = mem_id
        self.size = size
        try:
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise RequestError("bad_request", f"cannot map the shared fd read-write: "
                               f"{exc}") from exc

    def view(self, offset: int, length: int | None = None) -> memoryview:
        end = self.size if length is None else offset + length
        if offset < 0 or end > self.size or end <= offset:
            raise RequestError("out_of_range", f"[{offset}, {end}) is outside memory {self.id} "
                               f"of {self.size} bytes")
        return memoryview(self.map)[offset:end]


class Daemon:
    """State of one node daemon; run it with :func:`serve` / ``nursery.start``."""

    def __init__(self, config: DaemonConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.node = config.node
        self.incarnation = engine.config.incarnation
        self.control_address = ""
        self.peers: dict[str, PeerAddress] = {p.name: p for p in config.peers}
        self.exports: dict[str, tuple[ClientSession, RegionDescriptor]] = {}
        self.sessions: set[ClientSession] = set()
        self._links: dict[str, PeerLink] = {}
        self._resolved: dict[tuple[str, str], RegionDescriptor] = {}
        # Which peers hold a descriptor of each of our regions, to tell them
        # when it goes: a write with a dead key would break their connection.
        self._resolved_by: dict[str, set[str]] = {}
        self.writes_in_flight = 0
        self.nursery: trio.Nursery | None = None
        #: proves and checks the cluster token on control connections (None:
        #: no token configured, connections are not authenticated)
        self.auth = ClusterAuth(config.cluster_token.encode()) if config.cluster_token else None
        #: the membership backend (None: membership = "none", static peers)
        self.membership: MembershipBackend | None = None
        # Writes in flight per peer (their cancel scopes), failed with
        # ``peer_lost`` when membership says the peer died, left or restarted.
        self._writes_to: dict[str, set[trio.CancelScope]] = {}
        self._lost_reason: dict[str, str] = {}
        # Membership changes for clients that watch them (numbered; the
        # newest EVENT_LOG kept: a watcher further behind starts over).
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENT_LOG)
        self._event_seq = 0
        self._event_wake = trio.Event()
        #: Prometheus metrics (None: ``metrics`` is not configured)
        self.metrics: DaemonMetrics | None = None
        #: slow paths found at startup (``status`` shows them)
        self.notes: list[str] = []

    # -- regions and peers ----------------------------------------------------

    def local_descriptor(self, region: str) -> RegionDescriptor:
        hit = self.exports.get(region)
        if hit is None:
            raise RequestError("unknown_region", f"no region named {region!r} on {self.node}")
        return hit[1]

    async def resolve(self, peer: str, region: str) -> RegionDescriptor:
        if peer == self.node:
            return self.local_descriptor(region)
        key = (peer, region)
        if (hit := self._resolved.get(key)) is not None:
            return hit
        link = self._link(peer)
        result = await link.request("resolve", region=region)
        try:
            desc = RegionDescriptor.from_wire(result.get("descriptor"))
        except P2PXferError as exc:
            raise RequestError("peer_unreachable", f"{peer} sent a bad descriptor: {exc}") \
                from exc
        self._resolved[key] = desc
        return desc

    async def locate(self, region: str) -> list[str]:
        """The region directory: every node exporting ``region``. This node,
        and each reachable peer (running members, with membership on) asked
        at once, each within LOCATE_TIMEOUT_S; the descriptors found are kept
        like any resolved one, and dropped with their node's life."""
        if not region:
            raise RequestError("bad_request", "region name must not be empty")
        found = [self.node] if region in self.exports else []
        limiter = trio.CapacityLimiter(LOCATE_CONCURRENCY)

        async def ask(peer: str) -> None:
            async with limiter:
                with trio.move_on_after(LOCATE_TIMEOUT_S):
                    try:
                        await self.resolve(peer, region)
                    except P2PXferError:
                        return  # not there, or not answering: not a place to write to
                    found.append(peer)

        async with trio.open_nursery() as nursery:
            for peer in self.peers:
                m = self.membership.member(peer) if self.membership is not None else None
                if m is None or m.running:
                    nursery.start_soon(ask, peer)
        return sorted(found)

    def forget(self, peer: str, region: str) -> None:
        self._resolved.pop((peer, region), None)

    def region_gone(self, region: str) -> None:
        """Tell every peer that resolved ``region`` to drop it (in the background)."""
        for peer in self._resolved_by.pop(region, set()):
            if peer in self.peers and self.nursery is not None:
                self.nursery.start_soon(self._invalidate, peer, region)

    async def _invalidate(self, peer: str, region: str) -> None:
        try:
            await self._link(peer).request("invalidate", region=region)
        except P2PXferError as exc:
            log.warning("region.invalidate_failed", peer=peer, region=region, error=str(exc))

    def _link(self, peer: str) -> PeerLink:
        if peer not in self.peers:
            raise RequestError("unknown_peer", f"no peer named {peer!r} (known: "
                               f"{[*sorted(self.peers), self.node]})")
        link = self._links.get(peer)
        if link is None or link.address != self.peers[peer].address:
            link = self._links[peer] = PeerLink(self, self.peers[peer])
        return link

    async def close_idle_links(self) -> None:
        """Every LINK_IDLE_S, close peer connections unused that long: a node
        that once asked every member (``locate``) must not hold a socket to
        each of hundreds of daemons forever. The next request reconnects."""
        while True:
            await trio.sleep(LINK_IDLE_S)
            cutoff = trio.current_time() - LINK_IDLE_S
            for link in list(self._links.values()):
                if link.idle and link.last_used < cutoff:
                    await link.close()

    def add_peer(self, name: str, address: str) -> None:
        try:
            parse_hostport(address)
        except P2PXferError as exc:
            raise RequestError("bad_request", str(exc)) from exc
        self.peers[name] = PeerAddress(name, address)
        for key in [k for k in self._resolved if k[0] == name]:
            del self._resolved[key]

    def status(self) -> dict[str, Any]:
        stats = self.engine.statistics()
        return {
            "node": self.node,
            "incarnation": self.incarnation,
            "control": self.control_address,
            "socket": self.config.socket,
            "provider": self.engine.config.provider,
            "clients": len(self.sessions),
            "regions": [{"name": n, "length": d.length, "client": s.label}
                        for n, (s, d) in sorted(self.exports.items())],
            "peers": self.peer_list(),
            "membership": self.config.membership,
            "membership_stats": {} if self.membership is None else self.membership.statistics(),
            "transfers_in_flight": self.writes_in_flight,
            "completed": stats.completed,
            "failed": stats.failed,
            "nics": [asdict(n) for n in stats.nics],
            "rails": rails(self.engine),
            "links": [link.state() for link in self._links.values()],
            "notes": self.notes,
        }

    def peer_list(self) -> list[dict[str, Any]]:
        """The ``peers`` reply: static peers, or every member with its state
        when membership is on."""
        if self.membership is None:
            return [{"name": p.name, "address": p.address} for p in self.peers.values()]
        now = trio.current_time()
        return [{"name": m.name, "address": m.address, "state": str(m.state),
                 "incarnation": m.incarnation,
                 "last_heard_s": round(max(0.0, now - m.last_heard), 3)}
                for m in self.membership.members()]

    # -- membership -------------------------------------------------------------

    async def start_membership(self, nursery: trio.Nursery) -> None:
        """Join the cluster (membership enabled), bound to the control address;
        then follow it in a task of ``nursery``."""
        cfg = self.config
        token = cfg.cluster_token.encode()
        backend: MembershipBackend
        if cfg.membership == "embedded":
            seeds = [s for s in cfg.seeds if s != self.control_address]
            backend = EmbeddedBackend(self.node, self.control_address, token, seeds,
                                      incarnation=self.incarnation, join_timeout=2.0)
        else:
            backend = EtcdBackend(self.node, self.control_address, token, cfg.etcd_endpoint,
                                  incarnation=self.incarnation, ttl=cfg.etcd_ttl)
        events = backend.events()
        await backend.start(nursery)
        self.membership = backend
        for m in backend.members():
            if m.running:
                self._member_up(m.name, m.address)
        nursery.start_soon(self._follow_membership, events)

    async def stop_membership(self) -> None:
        """Leave gracefully (the others see ``left`` at once)."""
        if self.membership is not None:
            await self.membership.stop()

    async def _follow_membership(self,
                                 events: trio.MemoryReceiveChannel[MembershipEvent]) -> None:
        backend = self.membership
        assert backend is not None
        while True:
            async with events:
                async for ev in events:
                    self.on_membership_event(ev)
            if backend._done.is_set():
                return
            # Cut off (fell too far behind): subscribe again, catch up from the
            # view. Watching clients missed changes too: make them start over.
            events = backend.events()
            self._events.clear()
            self._event_seq += 1
            self._event_wake.set()
            self._event_wake = trio.Event()
            for m in backend.members():
                if m.name == self.node:
                    continue
                if m.running:
                    self._member_up(m.name, m.address)
                else:
                    self.peer_lost(m.name, f"{m.name} is {m.state}")

    def on_membership_event(self, ev: MembershipEvent) -> None:
        if isinstance(ev, Superseded):
            log.error("daemon.superseded", newer_incarnation=ev.member.incarnation)
            if self.nursery is not None:
                self.nursery.cancel_scope.cancel()
            return
        if isinstance(ev, MemberJoined | MemberAlive | MemberSuspect | MemberDead | MemberLeft |
                      MemberRestarted):
            if ev.member.name == self.node:
                return
            self._record(ev)
        if isinstance(ev, MemberJoined | MemberAlive):
            self._member_up(ev.member.name, ev.member.address)
        elif isinstance(ev, MemberDead | MemberLeft):
            what = "died" if isinstance(ev, MemberDead) else "left"
            self.peer_lost(ev.member.name, f"{ev.member.name} {what} (incarnation "
                                           f"{ev.member.incarnation})")
        elif isinstance(ev, MemberRestarted):
            self.peer_lost(ev.member.name, f"{ev.member.name} restarted (incarnation "
                                           f"{ev.previous_incarnation} -> "
                                           f"{ev.member.incarnation})")
            self._member_up(ev.member.name, ev.member.address)

    def _record(self, ev: MemberJoined | MemberAlive | MemberSuspect | MemberDead | MemberLeft
                | MemberRestarted) -> None:
        m = ev.member
        self._event_seq += 1
        entry: dict[str, Any] = {"seq": self._event_seq, "event": ev.kind,
                                 "name": m.name, "address": m.address,
                                 "state": str(m.state), "incarnation": m.incarnation}
        if isinstance(ev, MemberRestarted):
            entry["previous_incarnation"] = ev.previous_incarnation
        self._events.append(entry)
        self._event_wake.set()
        self._event_wake = trio.Event()

    async def watch(self, after: int, timeout_s: float) -> dict[str, Any]:
        """Membership changes numbered above ``after``, waiting up to
        ``timeout_s`` for one. ``after`` < 0, or older than what is kept:
        ``reset`` with every member as it is now, to start over from."""
        if self.membership is None:
            raise RequestError("bad_request", f"membership is off on {self.node}: there are "
                               "no membership events to watch (static peers)")
        if not self._missed(after):
            with trio.move_on_after(timeout_s):
                while self._event_seq <= after:
                    await self._event_wake.wait()
        if self._missed(after):  # also: the log was cleared while we waited
            return {"reset": True, "members": self.peer_list(), "events": [],
                    "next": self._event_seq}
        return {"events": [e for e in self._events if e["seq"] > after],
                "next": self._event_seq}

    def _missed(self, after: int) -> bool:
        """A watcher at ``after`` cannot be told what it missed from the log."""
        oldest = self._events[0]["seq"] if self._events else self._event_seq + 1
        return after < 0 or after > self._event_seq or \
            (after < self._event_seq and after + 1 < oldest)

    def _member_up(self, name: str, address: str) -> None:
        if name == self.node:
            return
        known = self.peers.get(name)
        if known is None or known.address != address:
            self.peers[name] = PeerAddress(name, address)
            self._drop_peer_state(name)

    def peer_lost(self, name: str, reason: str) -> None:
        """``name``'s life ended: forget its descriptors and connection, and
        fail its writes in flight with ``peer_lost``."""
        self._drop_peer_state(name)
        scopes = self._writes_to.get(name, set())
        if scopes:
            self._lost_reason[name] = reason
            log.warning("transfer.peer_lost", peer=name, writes=len(scopes), reason=reason)
        for scope in scopes:
            scope.cancel()

    def _drop_peer_state(self, name: str) -> None:
        for key in [k for k in self._resolved if k[0] == name]:
            del self._resolved[key]
        for regions in self._resolved_by.values():
            regions.discard(name)
        link = self._links.pop(name, None)
        if link is not None and self.nursery is not None:
            self.nursery.start_soon(link.close)

    def check_peer(self, peer: str) -> None:
        """With membership: refuse at once a peer known to be dead or gone."""
        if self.membership is None or peer == self.node:
            return
        m = self.membership.member(peer)
        if m is not None and not m.running:
            raise PeerLost(f"{peer} is {m.state} (incarnation {m.incarnation})")

    def check_descriptor(self, desc: RegionDescriptor) -> None:
        """With membership: refuse a descriptor of a life that is not running."""
        if self.membership is not None and desc.node and desc.node != self.node:
            self.membership.check_current(desc.node, desc.incarnation)

    @contextlib.contextmanager
    def track_write(self, peer: str) -> Iterator[None]:
        """A cancel scope for one write to ``peer``; ``peer_lost`` cancels it,
        and then this raises ``PeerLost`` with the reason."""
        scope = trio.CancelScope()
        scopes = self._writes_to.setdefault(peer, set())
        scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            scopes.discard(scope)
            if not scopes:
                self._writes_to.pop(peer, None)
        if scope.cancelled_caught:
            raise PeerLost(f"write to {peer} failed: "
                           f"{self._lost_reason.get(peer, 'peer lost')}")

    # -- listeners ------------------------------------------------------------

    async def serve_clients(self, nursery: trio.Nursery) -> trio.socket.SocketType:
        path = self.config.socket
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from an earlier run
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600, never briefly wider
        try:
            await sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(64)
        nursery.start_soon(self._accept_clients, sock)
        return sock

    async def _accept_clients(self, sock: trio.socket.SocketType) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                conn, _ = await sock.accept()
                nursery.start_soon(self._client, conn)

    async def _client(self, sock: trio.socket.SocketType) -> None:
        pid, uid, _gid = peer_credentials(sock)
        allowed = {0, os.getuid(), *self.config.allowed_uids}
        if uid not in allowed:
            log.warning("client.refused", pid=pid, uid=uid)
            sock.close()
            return
        session = ClientSession(self, sock, pid)
        self.sessions.add(session)
        try:
            await session.run()
        except Exception as exc:  # one client's failure must never reach the others
            log.error("client.failed", client=session.label, error=repr(exc))
        finally:
            self.sessions.discard(session)

    async def serve_peers(self, nursery: trio.Nursery) -> None:
        host, port = parse_hostport(self.config.control)
        listeners = await nursery.start(partial(trio.serve_tcp, host=host), self._peer, port)
        addr = listeners[0].socket.getsockname()
        self.control_address = f"{addr[0]}:{addr[1]}"

    async def _peer(self, stream: trio.SocketStream) -> None:
        conn = Connection("peer", RESPONDER, max_frame=self.config.max_frame)
        caller = _Caller(_remote(stream), authenticated=self.auth is None)
        # A caller that has not proved the token soon gets no more of our time
        # (nor a file descriptor to hold).
        proving = trio.CancelScope(deadline=trio.current_time() + AUTH_TIMEOUT_S)
        if caller.authenticated:
            proving.deadline = math.inf
        try:
            with proving:
                await self._serve_caller(stream, conn, caller, proving)
            if proving.cancelled_caught:
                log.warning("peer.auth_timeout", caller=caller.name, remote=caller.remote,
                            seconds=AUTH_TIMEOUT_S)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        except ProtocolError as exc:  # we could not answer: end this connection only
            log.warning("peer.closed_on_error", code=exc.code, error=exc.message)
            return
        finally:
            await stream.aclose()

    async def _serve_caller(self, stream: trio.SocketStream, conn: Connection,
                            caller: _Caller, proving: trio.CancelScope) -> None:
        while not caller.hang_up:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                log.warning("peer.protocol_error", code=exc.code, error=exc.message)
                await stream.send_all(conn.send_error(exc))
                if exc.fatal:
                    return
                continue
            if event is NEED_DATA:
                conn.receive_data(await stream.receive_some(1 << 16))
                continue
            if event is CLOSED:
                return
            assert isinstance(event, Message)
            await stream.send_all(self._peer_reply(conn, caller, event))
            if caller.authenticated:
                proving.deadline = math.inf

    def _peer_reply(self, conn: Connection, caller: _Caller, msg: Message) -> bytes:
        if msg.kind == "hello":
            caller.name, caller.control = msg.get("name", ""), msg.get("control", "")
            caller.nonce = msg.get("nonce", b"")
            extra: dict[str, Any] = {}
            if self.auth is not None:
                caller.our_nonce = os.urandom(NONCE_BYTES)
                extra["nonce"] = caller.our_nonce
                if _nonce_ok(caller.nonce):
                    extra["proof"] = self.auth.connection_proof(
                        "responder", caller.nonce, caller.our_nonce, self.node)
            else:
                self._caller_known(caller)
            return conn.send("welcome", extra, v=SCHEMA_VERSION, node=self.node,
                             incarnation=self.incarnation, max_frame=self.config.max_frame)
        if msg.kind == "bye":
            return b""
        if msg.kind == "auth":
            return self._check_caller(conn, caller, msg)
        if not caller.authenticated:
            log.warning("peer.auth_required", caller=caller.name, remote=caller.remote,
                        request=msg.kind)
            caller.hang_up = True
            return conn.send("error", id=msg.id, code="auth_failed",
                             message=f"{self.node} requires the cluster token: "
                                     "authenticate (auth) before any request")
        try:
            if msg.kind == "resolve":
                desc = self.local_descriptor(msg["region"])
                if caller.name:
                    self._resolved_by.setdefault(msg["region"], set()).add(caller.name)
                result: dict[str, Any] = {"descriptor": desc.to_wire()}
            elif msg.kind == "invalidate":
                self.forget(caller.name, msg["region"])
                result = {}
            elif msg.kind == "status":
                result = self.status()
            else:  # peers
                result = {"peers": self.peer_list()}
            return conn.send("ok", id=msg.id, result=result)
        except P2PXferError as exc:
            code, text = error_code(exc)
            return conn.send("error", id=msg.id, code=code, message=text)

    def _check_caller(self, conn: Connection, caller: _Caller, msg: Message) -> bytes:
        """The caller's answer to our challenge: right, and the connection may
        make requests; wrong, and it is refused, logged and closed."""
        if self.auth is None:
            return conn.send("ok", id=msg.id, result={})  # nothing to prove here
        if caller.our_nonce and _nonce_ok(caller.nonce) and self.auth.check_connection(
                "initiator", caller.nonce, caller.our_nonce, caller.name, msg["proof"]):
            caller.authenticated = True
            self._caller_known(caller)
            return conn.send("ok", id=msg.id, result={})
        log.warning("peer.auth_failed", caller=caller.name, remote=caller.remote,
                    reason="wrong proof of the cluster token")
        caller.hang_up = True
        return conn.send("error", id=msg.id, code="auth_failed",
                         message=f"{self.node}: wrong cluster token")

    def _caller_known(self, caller: _Caller) -> None:
        if caller.name and caller.control and caller.name not in self.peers \
                and self.membership is None:
            # A daemon that reached us can be reached back: no static world.
            # (With membership on, the members are the peers: a caller
            # must not add itself this way.)
            with contextlib.suppress(RequestError):
                self.add_peer(caller.name, caller.control)


NONCE_BYTES = 16
AUTH_TIMEOUT_S = 10.0  # a peer connection must have proved the token by then
LOCATE_TIMEOUT_S = 2.0  # per peer asked by ``locate``
LOCATE_CONCURRENCY = 32  # peers asked at once by ``locate``
LINK_IDLE_S = 60.0  # a peer connection unused this long is closed
EVENT_LOG = 1024  # membership changes kept for watching clients
WATCH_TIMEOUT_MAX_S = 300.0


def _nonce_ok(nonce: bytes) -> bool:
    return NONCE_BYTES <= len(nonce) <= 64


def _remote(stream: trio.SocketStream) -> str:
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return "?"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "?")


class _Caller:
    """What one incoming control connection has said about itself."""

    def __init__(self, remote: str, *, authenticated: bool) -> None:
        self.remote = remote
        self.authenticated = authenticated
        self.name = ""
        self.control = ""
        self.nonce = b""  # the caller's challenge to us
        self.our_nonce = b""  # ours to it
        self.hang_up = False  # close once the reply is sent


class PeerLink:
    """Our connection to one peer daemon's control port (requests in turn)."""

    def __init__(self, daemon: Daemon, peer: PeerAddress) -> None:
        self.daemon = daemon
        self.peer = peer
        self.address = peer.address
        self._lock = trio.Lock()
        self._stream: trio.SocketStream | None = None
        self._conn: Connection | None = None
        self.last_used = trio.current_time()
        self.last_heard: float | None = None  # trio time of the last answer
        self.last_error = ""  # why the last request failed ("" once one succeeds)
        self._failure = ""  # the state that failure leaves: "unreachable", "auth failed"

    @property
    def idle(self) -> bool:
        """Connected, and not in use right now."""
        return self._stream is not None and not self._lock.locked()

    async def request(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.last_used = trio.current_time()
        async with self._lock:
            try:
                with trio.fail_after(PEER_TIMEOUT_S):
                    result = await self._request(kind, fields)
                self.last_heard, self.last_error = trio.current_time(), ""
                return result
            except RequestError as exc:  # an answer, if a refusal
                self.last_heard = trio.current_time()
                refused = exc.code == "auth_failed"
                self.last_error, self._failure = (str(exc), "auth failed") if refused else ("", "")
                raise
            except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                    RemoteProtocolError) as exc:
                self.last_error = str(exc) or type(exc).__name__
                self._failure = "unreachable"
                await self._drop()
                raise RequestError("peer_unreachable", f"peer {self.peer.name} at "
                                   f"{self.address}: {exc or type(exc).__name__}") from exc

    async def _request(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        if self._stream is None:
            await self._connect()
        assert self._conn is not None and self._stream is not None
        rid = self._conn.next_id()
        await self._stream.send_all(self._conn.send(kind, id=rid, **fields))
        msg = await self._reply(rid)
        if msg.kind == "error":
            if msg["code"] == "auth_failed":
                await self._drop()  # the peer hangs up after saying so
            raise RequestError(msg["code"], f"{self.peer.name}: {msg['message']}")
        return dict(msg.get("result") or {})

    async def _connect(self) -> None:
        """Dial, say hello and, with a cluster token, prove it and check the
        peer's proof. The connection is kept only once all of that passed."""
        d = self.daemon
        host, port = parse_hostport(self.address)
        self._stream = await trio.open_tcp_stream(host, port)
        self._conn = Connection("peer", INITIATOR, max_frame=d.config.max_frame)
        try:
            nonce = os.urandom(NONCE_BYTES) if d.auth is not None else b""
            await self._stream.send_all(self._conn.send(
                "hello", {"nonce": nonce} if nonce else None, v=SCHEMA_VERSION, role="daemon",
                name=d.node, control=d.control_address))
            welcome = await self._reply(None)
            if d.auth is not None:
                await self._authenticate(d.auth, nonce, welcome)
        except BaseException:
            await self._drop()
            raise

    async def _authenticate(self, auth: ClusterAuth, nonce: bytes, welcome: Message) -> None:
        assert self._conn is not None and self._stream is not None
        name, theirs = welcome["node"], welcome.get("nonce", b"")
        where = f"peer {self.peer.name} at {self.address}"
        if name != self.peer.name:
            log.warning("peer.auth_failed", peer=self.peer.name, remote=self.address,
                        reason=f"the peer says it is {name!r}")
            raise RequestError("auth_failed", f"{where} says it is {name!r}")
        if not (_nonce_ok(theirs) and auth.check_connection(
                "responder", nonce, theirs, name, welcome.get("proof", b""))):
            log.warning("peer.auth_failed", peer=self.peer.name, remote=self.address,
                        reason="the peer did not prove the cluster token")
            raise RequestError("auth_failed", f"{where} did not prove the cluster token")
        rid = self._conn.next_id()
        proof = auth.connection_proof("initiator", nonce, theirs, self.daemon.node)
        await self._stream.send_all(self._conn.send("auth", id=rid, proof=proof))
        reply = await self._reply(rid)
        if reply.kind == "error":
            raise RequestError(reply["code"], f"{where}: {reply['message']}")

    async def _reply(self, rid: int | None) -> Message:
        assert self._conn is not None and self._stream is not None
        while True:
            event = self._conn.next_event()
            if event is NEED_DATA:
                data = await self._stream.receive_some(1 << 16)
                self._conn.receive_data(data)
                continue
            if event is CLOSED:
                raise trio.BrokenResourceError("peer closed the control connection")
            assert isinstance(event, Message)
            if rid is None or event.id == rid:
                if rid is None and event.kind == "error":
                    raise RequestError(event["code"], event["message"])
                return event

    def state(self) -> dict[str, Any]:
        """For ``status``: the control connection's state and when the peer
        last answered (None: never)."""
        state = (self._failure if self.last_error else "connected" if self._stream is not None
                 else "idle" if self.last_heard is not None else "not contacted")
        heard = (None if self.last_heard is None
                 else round(trio.current_time() - self.last_heard, 3))
        return {"name": self.peer.name, "address": self.address, "state": state,
                "last_heard_s": heard, "error": self.last_error}

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def _drop(self) -> None:
        if self._stream is not None:
            with trio.CancelScope(shield=True):
                await self._stream.aclose()
        self._stream = self._conn = None


class ClientSession:
    """One connected client: its memory, its exports, its requests in flight."""

    def __init__(self, daemon: Daemon, sock: trio.socket.SocketType, pid: int) -> None:
        self.daemon = daemon
        self.sock = sock
        self.label = f"pid:{pid}"
        self.conn = Connection("client", RESPONDER, max_frame=daemon.config.max_frame)
        self.mems: dict[int, _Mem] = {}
        self.exports: set[str] = set()
        self._fds: deque[int] = deque()
        self._send_lock = trio.Lock()
        self._next_mem = 1
        self._export_mem: dict[str, int] = {}  # region name -> memory backing it

    async def run(self) -> None:
        log.info("client.connected", client=self.label)
        try:
            async with trio.open_nursery() as nursery:
                try:
                    await self._serve(nursery)
                finally:
                    nursery.cancel_scope.cancel()  # pending writes finish, shielded
        finally:
            with trio.CancelScope(shield=True):
                self._release()
                self.sock.close()
            log.info("client.gone", client=self.label)

    async def _serve(self, nursery: trio.Nursery) -> None:
        while True:
            try:
                event = self.conn.next_event()
            except RemoteProtocolError as exc:
                log.warning("client.protocol_error", client=self.label, code=exc.code,
                            error=exc.message)
                await self._send(lambda exc=exc: self.conn.send_error(exc))
                if exc.fatal:
                    return
                continue
            if event is NEED_DATA:
                try:
                    data, fds = await recv_with_fds(self.sock)
                except OSError:
                    return
                self._fds.extend(fds)
                self.conn.receive_data(data)
                continue
            if event is CLOSED:
                return
            assert isinstance(event, Message)
            if event.kind == "bye":
                return
            if event.kind == "hello":
                await self._send(self._welcome)
            elif event.kind in ("write", "wait_imm", "watch", "locate"):
                nursery.start_soon(self._answer, event)
            else:
                await self._answer(event)

    def _welcome(self) -> bytes:
        d = self.daemon
        return self.conn.send("welcome", v=SCHEMA_VERSION, node=d.node,
                              incarnation=d.incarnation, max_frame=d.config.max_frame)

    async def _send(self, encode: Any) -> None:
        async with self._send_lock:
            try:
                data = encode()  # encode under the lock: the connection's state moves
            except ProtocolError as exc:
                # We cannot say this (too big, not encodable...): this client's
                # conversation is over; nobody else's is.
                log.warning("client.closed_on_error", client=self.label, code=exc.code,
                            error=exc.message)
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                return
            if data:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[await self.sock.send(view):]
                except OSError:
                    pass  # the client is gone; the receive side notices

    async def _answer(self, msg: Message) -> None:
        try:
            result = await self._handle(msg)
        except trio.Cancelled:
            raise
        except Exception as exc:  # every failure becomes an answer, never a crash
            code, text = error_code(exc)
            if code == "internal":
                log.error("request.crashed", client=self.label, kind=msg.kind, error=text)
            where = {k: msg.get(k) for k in ("peer", "region", "name") if msg.get(k) is not None}
            log.info("request.failed", client=self.label, kind=msg.kind, **where, code=code,
                     error=text)
            await self._send(lambda: self.conn.send("error", id=msg.id, code=code, message=text))
            return
        await self._send(lambda: self.conn.send("ok", id=msg.id, result=result))

    async def _handle(self, msg: Message) -> dict[str, Any]:
        d = self.daemon
        kind = msg.kind
        if kind == "share":
            return self._share(msg)
        if kind == "unshare":
            mem = self._mem(msg["mem"])
            if mem.id in self._export_mem.values():
                raise RequestError("bad_request", f"memory {mem.id} still backs an export")
            d.engine.deregister(mem.map)
            del self.mems[mem.id]
            _close_map(mem)
            return {}
        if kind == "export":
            return self._export(msg)
        if kind == "unexport":
            name = msg["name"]
            if name not in self.exports:
                raise RequestError("unknown_region", f"this client exported no {name!r}")
            self._unexport(name)
            return {}
        if kind == "write":
            return await self._write(msg)
        if kind == "wait_imm":
            await d.engine.wait_imm(msg["imm"], msg["count"])
            return {}
        if kind == "status":
            return d.status()
        if kind == "peers":
            return {"peers": d.peer_list()}
        if kind == "add_peer":
            d.add_peer(msg["name"], msg["address"])
            return {}
        if kind == "locate":
            return {"nodes": await d.locate(msg["region"])}
        if kind == "watch":
            timeout_ms = msg.get("timeout_ms", 30_000)
            if timeout_ms < 0:
                raise RequestError("bad_request", f"timeout_ms must be >= 0, got {timeout_ms}")
            return await d.watch(msg["after"], min(timeout_ms / 1000, WATCH_TIMEOUT_MAX_S))
        raise RequestError("unexpected", f"no handler for {kind!r}")

    def _mem(self, mem_id: int) -> _Mem:
        mem = self.mems.get(mem_id)
        if mem is None:
            raise RequestError("unknown_mem", f"no shared memory {mem_id} on this connection")
        return mem

    def _share(self, msg: Message) -> dict[str, Any]:
        if not self._fds:
            raise RequestError("bad_request", "share came without a file descriptor")
        fd = self._fds.popleft()
        try:
            size = msg["size"]
            if size <= 0:
                raise RequestError("bad_request", f"share size must be > 0, got {size}")
            mem = _Mem(self._next_mem, fd, size)
        finally:
            os.close(fd)
        self._next_mem += 1
        self.mems[mem.id] = mem
        self.daemon.engine.register(mem.map, writable=True)
        log.info("memory.shared", client=self.label, mem=mem.id, nbytes=size)
        return {"mem": mem.id}

    def _export(self, msg: Message) -> dict[str, Any]:
        d = self.daemon
        name = msg["name"]
        if not name:
            raise RequestError("bad_request", "region name must not be empty")
        if name in d.exports:
            raise RequestError("name_taken", f"a region named {name!r} is already exported "
                               f"on {d.node}")
        mem = self._mem(msg["mem"])
        view = mem.view(msg["offset"], msg["length"])
        desc = d.engine.export(view, name)
        d.exports[name] = (self, desc)
        self.exports.add(name)
        self._export_mem[name] = mem.id
        log.info("region.exported", client=self.label, region=name, nbytes=desc.length)
        return {"descriptor": desc.to_wire()}

    def _unexport(self, name: str) -> None:
        self.daemon.region_gone(name)
        self.daemon.engine.unexport(name)
        self.daemon.exports.pop(name, None)
        self.exports.discard(name)
        self._export_mem.pop(name, None)

    async def _write(self, msg: Message) -> dict[str, Any]:
        d = self.daemon
        mem = self._mem(msg["mem"])
        src = mem.view(msg["offset"])
        s, t, n = unpack_scatter(msg["scatter"])
        scatter = ScatterList(s, t, n)
        peer, region = msg["peer"], msg["region"]
        if d.membership is None:
            desc = await d.resolve(peer, region)
            return await self._write_desc(msg, src, scatter, peer, region, desc)
        d.check_peer(peer)
        with d.track_write(peer):
            desc = await d.resolve(peer, region)
            try:
                d.check_descriptor(desc)
            except PeerLost:
                d.forget(peer, region)
                raise
            return await self._write_desc(msg, src, scatter, peer, region, desc)
        raise AssertionError("unreachable")  # track_write raised PeerLost

    async def _write_desc(self, msg: Message, src: memoryview, scatter: ScatterList,
                          peer: str, region: str, desc: RegionDescriptor) -> dict[str, Any]:
        d = self.daemon
        d.writes_in_flight += 1
        t0 = time.perf_counter()
        ok = False
        try:
            pieces = await d.engine.write(src, desc, scatter, imm=msg.get("imm"))
            ok = True
        except TransferError as exc:
            log.warning("transfer.failed", client=self.label, peer=peer, region=region,
                        nbytes=scatter.nbytes, error=str(exc))
            # The region (or its owner) may be gone: look it up afresh, so the
            # caller hears "unknown_region" rather than a transport error.
            d.forget(peer, region)
            d.check_peer(peer)
            unreachable = False
            with trio.move_on_after(PEER_TIMEOUT_S) as asking:
                try:
                    await d.resolve(peer, region)
                except RequestError as exc:
                    if exc.code != "peer_unreachable" or d.membership is None:
                        raise
                    unreachable = True
            # No answer at all (a host gone or cut off) is unreachable too.
            unreachable = unreachable or asking.cancelled_caught
            if unreachable and d.membership is not None:
                # The peer's daemon is unreachable too: it probably died. Say
                # so to membership (SWIM suspects it now, not at its next
                # failed probe) and let it rule: inside track_write, a verdict
                # of dead, left or restarted turns this into PeerLost; without
                # one in time, the transport's error stands.
                d.membership.suspect(peer)
                await trio.sleep(d.membership.detection_bound())
            raise
        finally:
            d.writes_in_flight -= 1
            if d.metrics is not None:
                d.metrics.observe_write(time.perf_counter() - t0, ok)
        log.debug("transfer.complete", client=self.label, peer=peer, region=region,
                  nbytes=scatter.nbytes, pieces=pieces, seconds=time.perf_counter() - t0)
        return {"pieces": pieces}

    def _release(self) -> None:
        """The client is gone: drop its exports, registrations and mappings."""
        for name in list(self.exports):
            try:
                self._unexport(name)
            except P2PXferError as exc:
                log.warning("region.unexport_failed", region=name, error=str(exc))
        for mem in self.mems.values():
            with contextlib.suppress(P2PXferError):
                self.daemon.engine.deregister(mem.map)
            _close_map(mem)
        self.mems.clear()
        close_fds(list(self._fds))
        self._fds.clear()


def _close_map(mem: _Mem) -> None:
    # A view still alive somewhere keeps the mapping; it goes with the view.
    with contextlib.suppress(BufferError):
        mem.map.close()


async def serve(config: DaemonConfig, *, handle_signals: bool = False,
                task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a daemon until cancelled (or, with ``handle_signals``, until SIGINT
    or SIGTERM, then return normally). ``nursery.start(serve, config)``
    returns the :class:`Daemon` once both listeners are up."""
    engine_cfg = EngineConfig(
        provider=config.provider, node=config.fabric_node or None,
        interfaces=config.interfaces or None, node_name=config.node,
        incarnation=time.time_ns(),
    )
    sock = None
    try:
        async with open_engine(engine_cfg) as engine, trio.open_nursery() as nursery:
            daemon = Daemon(config, engine)
            daemon.nursery = nursery
            daemon.notes = slow_paths(engine, config.provider)
            await daemon.serve_peers(nursery)
            nursery.start_soon(daemon.close_idle_links)
            if config.metrics:
                daemon.metrics = DaemonMetrics(daemon)
                await nursery.start(serve_metrics, daemon.metrics, config.metrics)
            if config.membership != "none":
                await daemon.start_membership(nursery)
            sock = await daemon.serve_clients(nursery)
            log.info("daemon.ready", node=daemon.node, socket=config.socket,
                     control=daemon.control_address, provider=config.provider,
                     membership=config.membership)
            try:
                task_status.started(daemon)
                if handle_signals:
                    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        async for signum in signals:
                            log.info("daemon.stopping", signal=signal.Signals(signum).name)
                            break
                else:
                    await trio.sleep_forever()
            finally:
                # Say goodbye (members see "left" at once), even when cancelled.
                with trio.CancelScope(shield=True), trio.move_on_after(STOP_MEMBERSHIP_S):
                    await daemon.stop_membership()
                nursery.cancel_scope.cancel()
    finally:
        # Only now, with the accept loop gone, close and remove the socket.
        if sock is not None:
            sock.close()
        with contextlib.suppress(OSError):
            os.unlink(config.socket)
