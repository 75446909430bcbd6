"""The daemon's peers and its links to them.

``PeerTable`` knows every peer daemon by name (configured, added with
``add_peer``, learnt from an authenticated caller's hello, or a running
member) and keeps one ``PeerLink`` per peer it talks to: a control connection
opened by ``dial_peer`` on first use, requests in turn, closed after
``LINK_IDLE_S`` unused. Every failure to talk to a peer becomes
``PeerUnreachable`` (``peer_unreachable``) naming it; the peer's own answers
come back as the exceptions of their codes. What must not live here: what
the answers mean (regions, membership).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import trio

from p2pxfer._pump import Pump, bounded
from p2pxfer.address import format_hostport, parse_hostport
from p2pxfer.errors import (
    AuthenticationFailed,
    ConnectionLost,
    InvalidArgument,
    PeerUnreachable,
    UnknownPeer,
)
from p2pxfer.log import get_logger
from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import Message, error_from_wire, is_fatal

from ._config import PeerAddress
from ._dial import dial_peer
from ._tls import TlsCredentials

__all__ = ["LINK_IDLE_S", "PEER_TIMEOUT_S", "PeerLink", "PeerTable", "deadline_after",
           "seconds_left"]

log = get_logger("p2pxfer.daemon")

PEER_TIMEOUT_S = 5.0
LINK_IDLE_S = 60.0  # a peer connection unused this long is closed


def deadline_after(timeout_s: float | None) -> float:
    """The trio time a write (or KV push) taken now must be done by: one
    deadline for asking peers and for the engine alike."""
    return trio.current_time() + (timeout_s or math.inf)


def seconds_left(until: float) -> float | None:
    """Seconds from now to ``until`` for the engine (None: no deadline); a
    deadline already past leaves the engine a moment to say so itself."""
    if until == math.inf:
        return None
    return max(until - trio.current_time(), 1e-3)


class PeerLink:
    """Our connection to one peer daemon's control port (requests in turn)."""

    def __init__(self, table: PeerTable, peer: PeerAddress) -> None:
        self.table = table
        self.peer = peer
        self.address = peer.address
        self._lock = trio.Lock()
        self._pump: Pump | None = None
        self.last_used = trio.current_time()
        self.last_heard: float | None = None  # trio time of the last answer
        self.last_error = ""  # why the last request failed ("" once one succeeds)
        self._failure = ""  # the state that failure leaves: "unreachable", "auth failed"

    @property
    def connected(self) -> bool:
        return self._pump is not None

    @property
    def idle(self) -> bool:
        """Connected, and not in use right now."""
        return self._pump is not None and not self._lock.locked()

    async def request(self, kind: str, *, until: float | None = None,
                      **fields: Any) -> dict[str, Any]:
        """One request and its result. ``PeerUnreachable`` when the peer cannot
        be asked within ``PEER_TIMEOUT_S``, or by ``until`` (trio time: the
        deadline of the write the request is made for, however far);
        ``AuthenticationFailed`` when
        the two of us cannot prove the token (or TLS refused a certificate);
        the peer's error answers as their exceptions (a fatal one also drops
        the connection)."""
        self.last_used = trio.current_time()
        # A write's deadline also bounds its wait for the link (another
        # request in turn); a plain request waits its turn, then has its time.
        with trio.move_on_at(math.inf if until is None else until) as queued:
            await self._lock.acquire()
        if until is None:
            until = trio.current_time() + PEER_TIMEOUT_S
        if queued.cancelled_caught:
            raise PeerUnreachable(f"peer {self.peer.name} at {bounded(self.address, 100)}: no "
                               "turn on its control connection in time (others' requests "
                               "held it)")
        try:
            try:
                with trio.fail_at(until):
                    msg = await self._exchange(kind, fields)
            except AuthenticationFailed as exc:
                self.last_heard = trio.current_time()  # an answer, if a refusal
                self.last_error, self._failure = str(exc), "auth failed"
                await self._drop()
                raise
            except Exception as exc:  # any failure to talk is "unreachable", never a crash
                self.last_error = bounded(str(exc) or type(exc).__name__, 200)
                self._failure = "unreachable"
                await self._drop()
                raise PeerUnreachable(f"peer {self.peer.name} at {bounded(self.address, 100)}: "
                                   f"{bounded(str(exc) or type(exc).__name__, 200)}") from exc
            except BaseException:
                # Cancelled mid-request: a frame may be half sent. Start afresh.
                await self._drop()
                raise
            self.last_heard, self.last_error = trio.current_time(), ""
            if msg.kind == "error" and is_fatal(msg["code"]):
                await self._drop()  # the peer hangs up after saying so
            if msg.kind == "error":
                raise error_from_wire(msg["code"], msg["message"], self.peer.name)
            return dict(msg.get("result") or {})
        finally:
            self._lock.release()

    def state(self) -> dict[str, Any]:
        """For ``status``: the control connection's state and when the peer
        last answered (None: never)."""
        state = (self._failure if self.last_error else "connected" if self._pump is not None
                 else "idle" if self.last_heard is not None else "not contacted")
        heard = (None if self.last_heard is None
                 else round(trio.current_time() - self.last_heard, 3))
        return {"name": self.peer.name, "address": self.address, "state": state,
                "last_heard_s": heard, "error": self.last_error}

    async def _exchange(self, kind: str, fields: dict[str, Any]) -> Message:
        fresh = self._pump is None
        if self._pump is None:
            self._pump = await self._dial()
        try:
            return await self._pump.exchange(kind, **fields)
        except ConnectionLost:
            if fresh:
                raise
        # A link from before may have been closed by the peer meanwhile (it
        # restarted, or hung up): that says nothing about the peer now. Dial
        # again, once; a fresh link that fails is the answer.
        log.info("peer.redial", peer=self.peer.name, address=bounded(self.address, 100))
        await self._drop()
        self._pump = await self._dial()
        return await self._pump.exchange(kind, **fields)

    async def _dial(self) -> Pump:
        t = self.table
        return await dial_peer(self.address, name=t.node, expect=self.peer.name, auth=t.auth,
                               tls=t.tls, control=t.control_address, max_frame=t.max_frame)

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def _drop(self) -> None:
        pump, self._pump = self._pump, None
        if pump is not None:
            await pump.aclose()


class PeerTable:
    """Peers by name, and the links to them."""

    def __init__(self, node: str, peers: tuple[PeerAddress, ...], *,
                 auth: ClusterAuth | None, max_frame: int, max_peers: int = 4096,
                 tls: TlsCredentials | None = None) -> None:
        self.node = node
        self.max_peers = max_peers
        self.auth = auth
        self.tls = tls
        self.max_frame = max_frame
        self.control_address = ""  # ours, once listening: said in every hello
        self.peers: dict[str, PeerAddress] = {p.name: p for p in peers}
        self._links: dict[str, PeerLink] = {}
        #: called with a peer's name when what we knew of it is void (a new
        #: address, a new life): the region cache drops its descriptors
        self.on_forget: Callable[[str], None] = lambda name: None
        #: the control link to a peer now goes another way (``reroute``)
        self.on_reroute: Callable[[str], None] = lambda name: None
        self.nursery: trio.Nursery | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.peers

    def names(self) -> list[str]:
        return list(self.peers)

    def link(self, peer: str) -> PeerLink:
        """The link to ``peer`` (made on first use); ``UnknownPeer`` if there
        is no such peer."""
        if peer not in self.peers:
            raise UnknownPeer(f"no peer named {peer!r} (known: "
                              f"{[*sorted(self.peers), self.node]})")
        link = self._links.get(peer)
        if link is None or link.address != self.peers[peer].address:
            link = self._links[peer] = PeerLink(self, self.peers[peer])
        return link

    async def request(self, peer: str, kind: str, *, until: float | None = None,
                      **fields: Any) -> dict[str, Any]:
        """``PeerLink.request`` on ``peer``'s link."""
        return await self.link(peer).request(kind, until=until, **fields)

    def add(self, name: str, address: str) -> None:
        """A peer at ``address`` (``host:port``, checked: ``InvalidArgument``
        naming what is wrong, or when the table already holds ``max_peers``);
        a known one's descriptors are forgotten."""
        host, port = parse_hostport(address, port_zero=False)
        if name not in self.peers and len(self.peers) >= self.max_peers:
            raise InvalidArgument(f"the peer table is full ({self.max_peers} peers); "
                                  f"not adding {bounded(name, 100)!r}")
        self.peers[name] = PeerAddress(name, format_hostport(host, port))
        self.on_forget(name)

    def up(self, name: str, address: str, addresses: tuple[str, ...] = ()) -> None:
        """A running member at ``address``: known from now on; if it moved,
        what we knew of it is void. From another of its own ``addresses``
        (back from a rail that failed) it did not move: :meth:`reroute`."""
        if name == self.node:
            return
        known = self.peers.get(name)
        if known is not None and known.address != address and known.address in addresses:
            self.reroute(name, address)
        elif known is None or known.address != address:
            self.peers[name] = PeerAddress(name, address)
            self.drop(name)

    def reroute(self, name: str, address: str) -> None:
        """The same life of ``name``, its control port now reached at
        ``address`` (another of its rails: the one we used stopped
        answering): the link dials there from now on. What we know of it
        (descriptors, tickets it holds for us) stays valid."""
        known = self.peers.get(name)
        if name == self.node or known is None or known.address == address:
            return
        log.info("peer.rerouted", peer=name, old=known.address, new=address)
        self.peers[name] = PeerAddress(name, address)
        link = self._links.pop(name, None)
        if link is not None and self.nursery is not None:
            self.nursery.start_soon(link.close)
        self.on_reroute(name)

    def drop(self, name: str) -> None:
        """Forget ``name``'s descriptors and close its link (in the background)."""
        self.on_forget(name)
        link = self._links.pop(name, None)
        if link is not None and self.nursery is not None:
            self.nursery.start_soon(link.close)

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

    def link_states(self) -> list[dict[str, Any]]:
        """Each link's :meth:`PeerLink.state` (for ``status``)."""
        return [link.state() for link in self._links.values()]

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": p.name, "address": p.address} for p in self.peers.values()]
