"""A rail (one NIC's domain, CQ, AV and endpoint), and ``StallWatch``.

Posting a ``WriteBatch`` (``_batch.py``) and ``Poller.progress``
(``_poller.py``, the poller that drains rails) are the two calls on the data
path; both run a C loop (``native/src/p2p.c``) over whole arrays and return.
Nothing here keeps per-transfer state: that belongs to the layers above.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from types import TracebackType
from typing import Any, Self, TypeVar

from p2pxfer.errors import FabricError
from p2pxfer.log import get_logger

from ._batch import WriteBatch
from ._bell import Bells, Doorbell
from ._binding import ffi, lib
from ._info import DELIVERY_COMPLETE, FabricInfo, getinfo
from ._objects import (
    AddressVector,
    CompletionQueue,
    Domain,
    Endpoint,
    Fabric,
    MemoryRegion,
    check_shm_peer,
)
from ._sockets import Knocks, dialed, label, link_carries, parse_sockaddr, reset_connections

__all__ = ["Rail", "StallWatch"]

log = get_logger("p2pxfer.fabric")
#: core providers whose RMA writes are copies made by the provider's code
VIRTUAL_KEY_PROVIDERS = frozenset({"tcp", "shm", "sockets", "udp"})

ENABLE_TRIES = 3  # fi_enable of an endpoint whose port was taken meanwhile

_T = TypeVar("_T")


class Rail:
    """Everything p2pxfer opens on one NIC. Close it (or use ``with``) to release
    registrations, endpoint, AV, CQ, domain and fabric, in that order."""

    def __init__(self, info: FabricInfo, *, cq_size: int = 0) -> None:
        self.info = info
        self._closing: list[Any] = []
        self.doorbell: Doorbell | None = None
        self._bells: Bells | None = None
        try:
            self.fabric = self._own(Fabric(info))
            self.domain = self._own(Domain(self.fabric, info))
            self.cq = self._own(CompletionQueue(self.domain, cq_size))
            self.av = self._own(AddressVector(self.domain))
            self.endpoint = self._own(self._enabled_endpoint(info))
            self.address: bytes = self.endpoint.address
            #: pieces without an immediate per RMA write (``_batch.py``). One
            #: where every write is delivery-complete by default (fi_writemsg's
            #: own flags would leave that out), and on shm: there a write of
            #: several pieces goes through the target's command queue for it
            #: to copy, where a one-piece write is placed by its poster (CMA)
            #: before it completes: a plain write's return would no longer
            #: mean its bytes are there
            self.group = 1 if (info.tx_op_flags & DELIVERY_COMPLETE
                               or self.av.is_shm) else min(info.write_iovs,
                                                           int(lib.P2P_GROUP_MAX))
            # shm targets nap (no CQ wait fd): peers ring this to wake our
            # poller, and we ring theirs (``_bell.py``).
            if self.av.is_shm:
                self.doorbell = Doorbell(self.address)
                self._bells = Bells(every=bool(info.tx_op_flags & DELIVERY_COMPLETE))
        except BaseException:
            self.close()
            raise
        self._mrs: set[MemoryRegion] = set()
        self._knocks = Knocks()
        self.imm_bytes = info.cq_data_size
        #: writes to one peer are placed in order (``FabricInfo.ordered_writes``)
        self.ordered = info.ordered_writes
        #: a completion read means landed or queued ahead of later writes
        self.completions_ordered = info.completions_order_writes
        #: bytes at each piece's end sent apart with its immediate
        #: (``FabricInfo.imm_tail``; 0: pieces go whole)
        self.imm_tail = info.imm_tail
        # Its connections are kernel TCP sockets we can see (``disconnect``).
        parts = info.provider.split(";")
        self._rxm_over_tcp = "ofi_rxm" in parts and "tcp" in parts
        #: the provider's own code copies what a peer writes through our keys
        #: into the registered *virtual* addresses as it arrives (tcp, shm):
        #: pages replaced under a registration (``MAP_FIXED``) take the late
        #: bytes instead. A NIC writes into the pages pinned at registration,
        #: whatever is mapped there later.
        self.keys_are_virtual = bool(set(parts) & VIRTUAL_KEY_PROVIDERS)
        #: held by whoever reads this rail's CQ outside the thread that calls
        #: ``disconnect``, and by ``disconnect`` (a shard shares one)
        self.progress_guard = threading.Lock()
        log.debug(
            "rail.open", provider=info.provider, domain=info.domain_name,
            address=self.address.hex(), mr_mode=info.mr_mode.names(),
        )

    def _enabled_endpoint(self, info: FabricInfo) -> Endpoint:
        """The endpoint, enabled. Its listening port is the kernel's pick
        (or one of ``FI_TCP_PORT_*_RANGE``'s): a pick taken by the time the
        provider binds it (seen once under a full test suite, ``fi_enable``:
        EADDRINUSE) is picked again, a few times at most."""
        for attempt in range(1, ENABLE_TRIES):
            try:
                return Endpoint(self.domain, info, self.cq, self.av)
            except FabricError as exc:
                if exc.code != -errno.EADDRINUSE:
                    raise
                log.warning("rail.enable_retry", domain=info.domain_name, attempt=attempt,
                            error=str(exc))
        return Endpoint(self.domain, info, self.cq, self.av)

    def _own(self, obj: _T) -> _T:
        self._closing.append(obj)
        return obj

    @classmethod
    def open(cls, provider: str, *, node: str | None = None, domain: str | None = None) -> Rail:
        """Open the first interface of ``provider`` that matches."""
        return cls(getinfo(provider, node=node, domain=domain)[0])

    @property
    def provider(self) -> str:
        return self.info.provider

    @property
    def name(self) -> str:
        return self.info.domain_name

    @property
    def hmem(self) -> bool:
        """Device memory can be registered here (the provider offered FI_HMEM)."""
        return self.info.hmem

    def register(self, address: int, length: int, access: int, device: int = -1
                 ) -> MemoryRegion:
        mr = MemoryRegion(self.domain, address, length, access, endpoint=self.endpoint,
                          device=device)
        self._mrs.add(mr)
        return mr

    def deregister(self, mr: MemoryRegion) -> None:
        self._mrs.discard(mr)
        mr.close()

    def refuses(self, address: bytes, timeout: float = 0.5) -> bool:
        """True when the peer endpoint at ``address`` is known to be gone: an
        IP provider's address whose port refuses TCP connections (its process
        exited). False when it answers, or when that cannot be told (other
        providers; no answer within ``timeout``). Asked only about a write
        that has stalled (see ``StallWatch``): tcp;ofi_rxm answers -FI_EAGAIN
        forever for a peer whose connection is refused and reports nothing."""
        peer = parse_sockaddr(self.av.straddr(address))
        if peer is None:
            return False
        try:
            with socket.create_connection((str(peer[0]), peer[1]), timeout=timeout):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def peer(self, address: bytes) -> int:
        """The ``fi_addr_t`` of a peer endpoint address (inserted on first use).
        On shm, checked on every call: libfabric 1.17's shm crashes the process
        when it posts to a peer whose segment is gone, and a peer may die
        between two writes."""
        if self.av.is_shm:
            check_shm_peer(address)
        return self.av.insert(address)

    def bell_of(self, address: bytes) -> Any:
        """The doorbell to ring after posting to the peer at ``address``
        what needs its progress (a ``struct p2p_bell *``); NULL where peers
        have none (not shm)."""
        if self._bells is None or not address:
            return ffi.NULL
        return self._bells.of(address)

    @property
    def rings(self) -> int:
        """Doorbell datagrams sent to this rail's peers, lifetime."""
        return self._bells.rings() if self._bells is not None else 0

    def disconnect(self, address: bytes) -> list[str]:
        """Forget the peer endpoint at ``address`` and drop what is queued
        for it: on an IP provider, this process's TCP connections to it are
        reset first (``reset_connections``; ``fi_av_remove`` alone leaves
        them and their queued writes, which go out whenever the link lets
        them), then the address leaves the AV. The next write to the peer
        (``peer`` inserts it again) connects anew. Returns the connections
        reset.

        On tcp;ofi_rxm the address leaves the AV only when we hold a
        connection we dialed to the peer: libfabric 1.17's ofi_rxm keeps a
        connection it closed on the peer's "already connected" reject (the
        peer still has our old one: a reset that never reached it) indexed
        without its endpoint, and ``fi_av_remove``'s cleanup closes that
        endpoint again, a NULL dereference that killed the process. Such a
        connection has no socket and nothing queued; one the peer dialed
        is reset above when the peer is on another host, and the provider
        fails what it had queued on it (same host: docs, "Known gaps").
        ``progress_guard`` keeps CQ reads of other threads (which can turn
        a connecting connection into a refused one) out of that look.

        On shm nothing leaves the AV: there is no connection to reset, and
        libfabric 1.17's ``fi_av_remove`` cancels nothing already in the
        peer's queue while it blanks (or, for a peer in another process,
        unmaps) the region its pending responses are read from, which no
        lock of the provider keeps from a concurrent CQ read, nor from the
        ``fi_av_insert`` of the next write to the peer: a NULL dereference
        in ``smr_progress_resp`` (the thread-safety stress's crash). A peer
        that is gone is caught by the express path's segment check and by
        the provider's own errors."""
        reset: list[str] = []
        if self.av.is_shm:
            if self._bells is not None:
                self._bells.forget(address)
            return reset
        remove = True
        with self.progress_guard:
            if self.av.holds(address):
                ours = parse_sockaddr(self.av.straddr(self.address))
                peer = parse_sockaddr(self.av.straddr(address))
                if ours is not None and peer is not None:
                    conns = reset_connections(ours, peer, skip=self._knocks.fds())
                    self._knocks.add(conns, time.monotonic())
                    reset = [label(*c) for c in conns]
                    remove = dialed(ours, conns) or not self._rxm_over_tcp
            if remove:
                self.av.remove(address)
        if self._bells is not None:
            self._bells.forget(address)
        return reset

    def link_carries(self, address: bytes, quiet_s: float) -> bool | None:
        """The kernel's word on the link to the peer endpoint at ``address``
        (``_sockets.link_carries``): True if it carries, False if it has
        been silent with data outstanding for ``quiet_s``, None where there
        is no TCP connection to ask (shm, RDMA providers, none yet)."""
        if self.av.is_shm or not self.av.holds(address):
            return None
        ours = parse_sockaddr(self.av.straddr(self.address))
        peer = parse_sockaddr(self.av.straddr(address))
        if ours is None or peer is None:
            return None
        return link_carries(ours, peer, quiet_s)

    def knock(self, now: float) -> None:
        """Help the peers of connections ``disconnect`` reset notice it once
        their link is back (``Knocks``); call it every few 100 ms."""
        if self._knocks:
            self._knocks.run(now)

    def close(self, *, process_exits: bool = False) -> None:
        """Close everything, registrations first. With ``process_exits`` (the
        caller's process ends next) a tcp;ofi_rxm endpoint and what it holds
        are left for the kernel to close at exit: libfabric 1.17's ofi_rxm
        dies (NULL dereference, in ``fi_close`` of the endpoint) when one of
        its connections is in the middle of receiving a peer's write, as when
        the peer's link went silent mid-message, and a daemon stopping then
        must exit 0, not SIGSEGV. Registrations are still closed, so nothing
        lands in our memory meanwhile."""
        if hasattr(self, "_knocks"):
            self._knocks.close()
        bell = getattr(self, "doorbell", None)
        if bell is not None:
            bell.close()
        for mr in list(getattr(self, "_mrs", ())):
            mr.close()
        if process_exits and getattr(self, "_rxm_over_tcp", False):
            log.debug("rail.left_to_exit", domain=self.info.domain_name)
            self._closing.clear()
            return
        errors = []
        while self._closing:
            obj = self._closing.pop()
            try:
                obj.close()
            except FabricError as exc:  # keep closing the rest
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# Posting that has not moved for this long makes StallWatch ask whether the
# peer is gone (and not more often than that).
STALL_PROBE_S = 0.5


class StallWatch:
    """Tells a write stuck on a departed peer from one that is merely slow.

    A TX queue that keeps refusing (-FI_EAGAIN) is normally back-pressure;
    but tcp;ofi_rxm answers that forever, reporting nothing, when the peer's
    connection is refused. Once a batch's posting has not moved for
    ``STALL_PROBE_S``, ``check`` asks each stuck rail whether its peer
    refuses connections (``Rail.refuses``), at most once per period."""

    def __init__(self) -> None:
        self._left = -1
        self._since = time.monotonic()

    def check(self, batch: WriteBatch) -> str | None:
        """Why ``batch`` can never be posted, or None."""
        left, now = batch.unposted(), time.monotonic()
        if left != self._left:
            self._left, self._since = left, now
            return None
        if now - self._since < STALL_PROBE_S:
            return None
        self._since = now
        for rail, address in batch.stuck_peers():
            # Briefly: a live host refuses at once, and this runs on the
            # poller thread, which every other peer's writes wait for.
            if rail.refuses(address, timeout=0.05):
                return (f"peer {rail.av.straddr(address)} refuses connections: its "
                        f"endpoint is gone")
        return None
