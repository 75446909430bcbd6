"""Resetting the kernel TCP connections an IP provider keeps to one peer
(``reset_connections``), for ``Rail.disconnect``, and knocking on them
afterwards until the peer's end is gone too (``Knocks``).

Why: libfabric 1.17's ``fi_av_remove`` on tcp;ofi_rxm leaves the peer's
connection as it is (unless ``FI_AV_REMOVE_CLEANUP`` is set), and its queued
writes go out whenever the link lets them, reading the source buffer then:
bytes of a write its owner gave up land later, over newer data. A connection
reset here (``p2p_tcp_reset``: the kernel drops the socket's send queue) makes
the provider see the socket fail: it flushes what it had queued with errors
and connects anew for the next write.

Which sockets: this process's (``/proc/self/fd``), looked up by inode in
``/proc/self/net/tcp`` and ``tcp6``: those connected *to* the peer endpoint's
address, and those our endpoint accepted (local port = its listening port)
from the peer's IP where that IP is not this host's (several peers on one
host share an IP, and an accepted connection names only the peer's ephemeral
port). Never listening sockets, never sockets of other ports (the daemon's
control connections). What must not live here: anything provider-specific
beyond addresses, or AV bookkeeping (``AddressVector``).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import select
import socket
import struct
from collections.abc import Iterator

from p2pxfer.log import get_logger

from ._binding import lib

__all__ = ["Knocks", "connections", "dialed", "link_carries", "parse_sockaddr",
           "reset_connections"]

log = get_logger("p2pxfer.fabric")

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Endpoint = tuple[IP, int]

_SOCKADDR = re.compile(r"fi_sockaddr_in6?://\[?([0-9A-Fa-f.:]+?)\]?:(\d+)$")
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]$")
_LISTEN = "0A"


def parse_sockaddr(text: str) -> Endpoint | None:
    """(IP, port) of an IP provider's ``fi_av_straddr`` text; None for others."""
    m = _SOCKADDR.match(text)
    if m is None:
        return None
    try:
        return _plain(ipaddress.ip_address(m.group(1))), int(m.group(2))
    except ValueError:
        return None


def _plain(ip: IP) -> IP:
    """IPv4-mapped IPv6 addresses as the IPv4 address they map."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _proc_endpoint(field: str) -> Endpoint:
    """``/proc/net/tcp*``'s ``HEX:PORT``: the address as the kernel's 32-bit
    words in host (little-endian) order."""
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(packed)), int(port, 16)


def _connections() -> dict[int, tuple[Endpoint, Endpoint]]:
    """inode -> (local, remote) of every TCP socket of this network
    namespace that is not listening."""
    out: dict[int, tuple[Endpoint, Endpoint]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] == _LISTEN:
                continue
            out[int(fields[9])] = (_proc_endpoint(fields[1]), _proc_endpoint(fields[2]))
    return out


def _socket_fds() -> dict[int, int]:
    """inode -> fd of this process's sockets."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            m = _SOCKET_LINK.match(os.readlink(f"/proc/self/fd/{entry}"))
        except OSError:  # closed meanwhile
            continue
        if m is not None:
            out[int(m.group(1))] = int(entry)
    return out


def _same_host(ip: IP, ours: IP) -> bool:
    return ip == ours or ip.is_loopback or ip.is_unspecified


def label(local: Endpoint, remote: Endpoint) -> str:
    return f"{local[0]}:{local[1]}->{remote[0]}:{remote[1]}"


def _pair_sockets(ours: Endpoint, peer: Endpoint, skip: frozenset[int] = frozenset(),
                  ) -> Iterator[tuple[int, Endpoint, Endpoint]]:
    """(fd, local, remote) of this process's TCP connections between our
    endpoint ``ours`` (its listening address) and the peer endpoint ``peer``
    (see the module doc), less the descriptors in ``skip``."""
    ours_ip, ours_port = ours
    peer_ip, _ = peer
    accepted_too = not _same_host(peer_ip, ours_ip)
    fds = _socket_fds()
    for inode, (local, remote) in _connections().items():
        fd = fds.get(inode)
        if fd is None or fd in skip:
            continue
        ours_too = ours_ip.is_unspecified or local[0] == ours_ip
        mine = local[1] == ours_port and ours_too
        # Dialed: from our address (another rail's connection to the same
        # peer endpoint is not ours to reset), or accepted by our endpoint.
        if (remote == peer and ours_too) or (accepted_too and mine and remote[0] == peer_ip):
            try:
                if os.fstat(fd).st_ino != inode:  # closed and reused since the listing
                    continue
            except OSError:
                continue
            yield fd, local, remote


def connections(ours: Endpoint, peer: Endpoint, skip: frozenset[int] = frozenset(),
                ) -> list[tuple[Endpoint, Endpoint]]:
    """(local, remote) of this process's TCP connections between ``ours``
    and ``peer`` (see the module doc), less the descriptors in ``skip``."""
    return [(local, remote) for _, local, remote in _pair_sockets(ours, peer, skip)]


def dialed(ours: Endpoint, conns: list[tuple[Endpoint, Endpoint]]) -> bool:
    """Whether one of ``conns`` is a connection our endpoint dialed (not
    one it accepted: those name only the peer's ephemeral port)."""
    return any(local[1] != ours[1] for local, _ in conns)


def reset_connections(ours: Endpoint, peer: Endpoint, skip: frozenset[int] = frozenset(),
                      ) -> list[tuple[Endpoint, Endpoint]]:
    """Reset this process's TCP connections between ``ours`` and ``peer``
    (not the descriptors in ``skip``: our own knocks); returns (local,
    remote) of each one reset."""
    done = []
    for fd, local, remote in _pair_sockets(ours, peer, skip):
        rc = lib.p2p_tcp_reset(fd)
        if rc:
            log.warning("rail.reset_failed", connection=label(local, remote),
                        error=os.strerror(-rc))
        else:
            done.append((local, remote))
    return done


# struct tcp_info (linux/tcp.h): offsets of the fields read below.
_TCPI_STATE, _TCPI_UNACKED, _TCPI_LAST_ACK_RECV = 0, 24, 56
_TCPI_BYTES = 64
_TCP_ESTABLISHED = 1
#: how long ``link_carries`` waits for the peer's host to answer a knock:
#: a link's round trip is far shorter; a starved process's kernel answers
ANSWER_S = 0.2


def link_carries(ours: Endpoint, peer: Endpoint, quiet_s: float) -> bool | None:
    """What the kernel knows of the link under our connections to ``peer``:
    True when one of them is established and heard an ACK within
    ``quiet_s`` (the link carries: ACKs of our data, or of the window
    probes a peer that reads nothing gets, arrive), or when none of them
    has anything of ours unacknowledged and the peer's host answers a
    connection right now (``_answers``: a starved peer process sends
    nothing, so nothing is ACKed, but its kernel still answers); False
    when there is no such evidence; None without any connection to judge
    by. A pair without completions on a link that carries waits on a busy
    or slow process, not on the rail."""
    verdict: bool | None = None
    outstanding = False
    for fd, _, _ in _pair_sockets(ours, peer):
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES)
        except OSError:
            continue
        if len(info) < _TCPI_BYTES:
            continue
        last_ack_ms, = struct.unpack_from("I", info, _TCPI_LAST_ACK_RECV)
        unacked, = struct.unpack_from("I", info, _TCPI_UNACKED)
        if info[_TCPI_STATE] == _TCP_ESTABLISHED and last_ack_ms < quiet_s * 1000:
            return True
        outstanding = outstanding or unacked > 0 or info[_TCPI_STATE] != _TCP_ESTABLISHED
        verdict = False
    if verdict is False and not outstanding:
        return _answers(ours, peer, min(ANSWER_S, quiet_s))
    return verdict


def _answers(ours: Endpoint, peer: Endpoint, timeout: float) -> bool:
    """Whether the peer's host answers a connection from our address within
    ``timeout``: a SYN-ACK, or a reset (its process is gone, but the link
    carries). Blocks that long at most."""
    family = socket.AF_INET6 if peer[0].version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.bind((str(ours[0]), 0))
            sock.connect((str(peer[0]), peer[1]))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return True


class _Knock:
    """One old connection's address pair, and the socket knocking from it."""

    def __init__(self, local: Endpoint, remote: Endpoint, until: float) -> None:
        self.local, self.remote, self.until = local, remote, until
        self.sock: socket.socket | None = None
        self.since = 0.0
        self.err = 0  # connect's own error, when it failed at once

    def step(self, now: float) -> bool:
        """Knock again or look how the last knock went; True once done: the
        connection from this address pair was answered (the peer's listener,
        so the peer's old end is gone), refused, the pair is in use again
        (by a live connection), or it is too late."""
        if self.sock is not None:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or self.err
            if err == 0 and self._connected():
                return self.close()  # answered by the listener
            if err == errno.ECONNREFUSED:
                return self.close()  # the peer's endpoint is gone: nothing to knock on
            if err == 0 and now - self.since < KNOCK_RETRY_S:
                return False  # the kernel resends the SYN meanwhile
            if err != 0 and now - self.since < Knocks.KNOCK_EVERY_S:
                return False
            self.close()
        if now >= self.until:
            return True
        family = socket.AF_INET6 if self.local[0].version == 6 else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.since = now
        try:
            self.sock.setblocking(False)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Closing it resets it: the peer's listener drops what it accepted.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.bind((str(self.local[0]), self.local[1]))
            rc = self.sock.connect_ex((str(self.remote[0]), self.remote[1]))
        except OSError:  # the address pair is taken again: a live connection
            return self.close()
        # Unreachable right away (the link is down here): knock again later.
        self.err = 0 if rc in (0, errno.EINPROGRESS) else rc
        return False

    def _connected(self) -> bool:
        if self.sock is None or not select.select([], [self.sock], [], 0)[1]:
            return False
        try:
            self.sock.getpeername()
        except OSError:  # writable because it failed, not connected
            return False
        return True

    def close(self) -> bool:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        return True


KNOCK_RETRY_S = 2.0  # a knock unanswered this long is sent anew


class Knocks:
    """Connections we reset whose reset may not have reached the peer (its
    link was cut, or its packets dropped): the peer's end then stays open,
    idle, for ever, and ofi_rxm at the peer refuses our new connections as
    duplicates of it ("simultaneous" connection from the same process). So
    each old connection's address pair is knocked from, a connection attempt
    (a SYN) from its own local address to the peer's, until the peer's
    listener answers (or ``KNOCK_FOR_S`` passed): the peer's old end answers
    a SYN with an ACK, which our kernel (no socket of that pair any more)
    answers with a reset the peer accepts, and the next SYN reaches its
    listener; we reset what it accepted."""

    KNOCK_EVERY_S = 0.5
    KNOCK_FOR_S = 900.0

    def __init__(self) -> None:
        self._knocks: list[_Knock] = []
        self._next = 0.0

    def __bool__(self) -> bool:
        return bool(self._knocks)

    def fds(self) -> frozenset[int]:
        """The descriptors of the knocks under way (connections of ours,
        not the provider's)."""
        return frozenset(k.sock.fileno() for k in self._knocks if k.sock is not None)

    def add(self, reset: list[tuple[Endpoint, Endpoint]], now: float) -> None:
        for local, remote in reset:
            self._knocks.append(_Knock(local, remote, now + self.KNOCK_FOR_S))

    def run(self, now: float) -> None:
        if not self._knocks or now < self._next:
            return
        self._next = now + self.KNOCK_EVERY_S
        self._knocks = [k for k in self._knocks if not k.step(now)]

    def close(self) -> None:
        for k in self._knocks:
            k.close()
        self._knocks.clear()
