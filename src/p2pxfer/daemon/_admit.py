"""Who gets a control connection: caps that hold against callers who never
authenticate, from one address or from many of one range.

A connection is *pending* from accept until its caller is authenticated
(proved the token, or showed its certificate; on an open daemon, said
hello), then *authenticated*. Pending connections may take at most
``max_pending_connections`` of the ``max_connections`` slots (the rest are
kept for authenticated peers), and at most ``max_pending_per_range`` from one
source range: an IPv4 /24, an IPv6 /64, all of loopback (127.0.0.0/8 and
::1) as one, so rotating addresses within a host's range buys nothing. When
a pending cap is reached, the oldest pending connection in its scope is
closed to make room rather than the new one refused: a real peer finishes
its handshake in milliseconds, so a half-open flood has to outpace that
handshake to keep it out, where refusing newcomers let one slow flood hold
every slot. ``max_connections_per_host`` still caps each address, pending or
not, and authenticated connections are never closed to make room.

Runs in the daemon's trio thread only. What must not live here: the
handshakes (``_control``, ``_auth``, ``_tls``).
"""

from __future__ import annotations

import ipaddress
from collections import Counter, OrderedDict

import trio

from ._config import DaemonConfig

__all__ = ["Admission", "Ticket", "source_range"]


def source_range(host: str) -> str:
    """The range a caller's address counts in for the pending caps."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    prefix = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class Ticket:
    """One admitted connection: its scope (cancelled to close it) and where
    it counts."""

    __slots__ = ("evicted", "host", "pending", "range", "scope")

    def __init__(self, host: str) -> None:
        self.host = host
        self.range = source_range(host)
        self.scope = trio.CancelScope()
        self.pending = True
        self.evicted = False


class Admission:
    """The control port's connections, pending and authenticated."""

    def __init__(self, config: DaemonConfig) -> None:
        self.c = config
        self.per_host: Counter[str] = Counter()
        self._pending: OrderedDict[Ticket, None] = OrderedDict()  # oldest first
        self._pending_in: dict[str, OrderedDict[Ticket, None]] = {}
        self.total = 0
        self.evictions = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def admit(self, host: str) -> Ticket | None:
        """A ticket for a new connection from ``host``, closing the oldest
        pending one where a pending cap is reached; None: refused (its
        address is at its cap, or every slot is authenticated)."""
        c = self.c
        if self.per_host[host] >= c.max_connections_per_host:
            return None
        ticket = Ticket(host)
        mine = self._pending_in.get(ticket.range)
        if mine is not None and len(mine) >= c.max_pending_per_range:
            self._evict(next(iter(mine)))
        if len(self._pending) >= c.max_pending_connections:
            self._evict(next(iter(self._pending)))
        if self.total >= c.max_connections:
            if not self._pending:
                return None
            self._evict(next(iter(self._pending)))
        self.per_host[host] += 1
        self.total += 1
        self._pending[ticket] = None
        self._pending_in.setdefault(ticket.range, OrderedDict())[ticket] = None
        return ticket

    def authenticated(self, ticket: Ticket) -> None:
        """Its caller proved who it is: it keeps its slot from now on."""
        if ticket.pending:
            self._unpend(ticket)

    def release(self, ticket: Ticket) -> None:
        if ticket.pending:
            self._unpend(ticket)
        self.total -= 1
        self.per_host[ticket.host] -= 1
        if self.per_host[ticket.host] <= 0:
            del self.per_host[ticket.host]

    def _evict(self, ticket: Ticket) -> None:
        # Out of the pending counts now: its task ends at its next checkpoint
        # and releases the rest.
        self._unpend(ticket)
        ticket.evicted = True
        ticket.scope.cancel()
        self.evictions += 1

    def _unpend(self, ticket: Ticket) -> None:
        ticket.pending = False
        self._pending.pop(ticket, None)
        mine = self._pending_in.get(ticket.range)
        if mine is not None:
            mine.pop(ticket, None)
            if not mine:
                del self._pending_in[ticket.range]
