"""Which of our rails can reach which rail of a peer.

``pair_rails`` turns our rails' endpoint addresses and a peer's into the
``(our rail, peer rail)`` pairs a write is striped over: rails pair by
reachability (same subnet, or the kernel's route leaves from that rail's
address), not by index, and loopback rails pair only within one host. It
asks the kernel (a bind, a UDP connect, an ioctl; nothing is sent) once per
destination: ``RailGroup`` caches the answer.

What must not live here: fabric calls, posting, or splitting bytes (that is
``plan_stripes``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import sys
from collections.abc import Sequence

__all__ = ["is_local_address", "pair_rails", "reaches", "sockaddr_ip"]

_SIOCGIFNETMASK = 0x891B  # linux/sockios.h


def sockaddr_ip(address: bytes) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP inside an endpoint address that is a ``struct sockaddr_in`` or
    ``sockaddr_in6`` (tcp, verbs over IP); None for any other address (shm)."""
    family = int.from_bytes(address[:2], sys.byteorder) if len(address) >= 2 else -1
    if family == socket.AF_INET and len(address) >= 8:
        return ipaddress.IPv4Address(address[4:8])
    if family == socket.AF_INET6 and len(address) >= 24:
        return ipaddress.IPv6Address(address[8:24])
    return None


def is_local_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True when ``ip`` is an address of this host (network namespace): a
    socket can bind it. Nothing is sent."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError:
            return False
    return True


def _netmask(ifname: str) -> ipaddress.IPv4Address | None:
    """An IPv4 interface's netmask (SIOCGIFNETMASK); None if it has none."""
    if not ifname or len(ifname) >= 16:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            out = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK,
                              struct.pack("256s", ifname.encode()))
        except OSError:
            return None
    return ipaddress.IPv4Address(out[20:24])


def _route_source(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The source address the kernel would pick to reach ``ip`` (a UDP
    ``connect`` sends nothing); None when there is no route."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((str(ip), 9))
        except OSError:
            return None
        return str(s.getsockname()[0])


def reaches(local: ipaddress.IPv4Address | ipaddress.IPv6Address, ifname: str,
            peer: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether our rail at ``local`` (interface ``ifname``) should carry writes
    to a peer rail at ``peer``: same family; loopback only to loopback (the
    caller checks the peer is on this host); else the same subnet, or the
    kernel's route to ``peer`` leaves from ``local``."""
    if local.version != peer.version:
        return False
    if local.is_loopback or peer.is_loopback:
        return local.is_loopback and peer.is_loopback
    if local.version == 4 and (mask := _netmask(ifname)) is not None:
        net = ipaddress.IPv4Network(f"{local}/{mask}", strict=False)
        if peer in net:
            return True
    return _route_source(peer) == str(local)


def pair_rails(local: Sequence[tuple[bytes, str]], peer: Sequence[bytes]) -> list[tuple[int, int]]:
    """Pairs ``(our rail, peer rail)`` to stripe a write over, such that every
    peer rail we can reach takes traffic and every one of our rails that
    reaches one carries some. ``local`` is our rails' (endpoint address,
    interface name), ``peer`` the peer rails' endpoint addresses, in order.

    Rails are paired by reachability, not by index (see :func:`reaches`); a
    peer's loopback rail counts only when the peer is on this host (one of
    its other addresses is ours, or it has only loopback rails), so ``lo`` is
    never a rail towards a remote peer. Addresses that are not IP (shm) pair
    every rail with every peer rail in turn. Empty when nothing reaches."""
    nl, npeer = len(local), len(peer)
    lips = [sockaddr_ip(a) for a, _ in local]
    pips = [sockaddr_ip(a) for a in peer]
    if any(ip is None for ip in lips) or any(ip is None for ip in pips):
        return [(j % nl, j % npeer) for j in range(max(nl, npeer))]
    others = [ip for ip in pips if ip is not None and not ip.is_loopback]
    peer_is_here = not others or any(is_local_address(ip) for ip in others)
    reach = [[lip is not None and pip is not None
              and (peer_is_here or not pip.is_loopback)
              and reaches(lip, local[li][1], pip)
              for pip in pips] for li, lip in enumerate(lips)]
    pairs: list[tuple[int, int]] = []
    used: set[int] = set()
    for p in range(npeer):
        cands = [li for li in range(nl) if reach[li][p]]
        if cands:
            li = next((c for c in cands if c not in used), cands[p % len(cands)])
            pairs.append((li, p))
            used.add(li)
    for li in range(nl):
        cands = [p for p in range(npeer) if reach[li][p]]
        if li not in used and cands:
            pairs.append((li, cands[li % len(cands)]))
            used.add(li)
    return pairs
