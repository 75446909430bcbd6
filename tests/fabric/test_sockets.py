"""``fabric._sockets``: finding this process's TCP connections to a peer
endpoint by address and resetting them (what ``Rail.disconnect`` does to a
given-up write's connections), on loopback sockets of the test's own."""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest

from p2pxfer.fabric._sockets import (
    _proc_endpoint,
    link_carries,
    parse_sockaddr,
    reset_connections,
)

LO = ipaddress.ip_address("127.0.0.1")


def test_addresses_parse_as_the_provider_and_the_kernel_write_them() -> None:
    assert parse_sockaddr("fi_sockaddr_in://10.77.1.2:36635") == (
        ipaddress.ip_address("10.77.1.2"), 36635)
    assert parse_sockaddr("fi_sockaddr_in6://[fe80::1]:7") == (
        ipaddress.ip_address("fe80::1"), 7)
    assert parse_sockaddr("fi_shm://1234") is None
    # /proc/net/tcp: the address as 32-bit words in host order, port in hex.
    assert _proc_endpoint("0100007F:1F90") == (LO, 8080)
    assert _proc_endpoint("0000000000000000FFFF00000100007F:0016") == (LO, 22)


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    server, _ = listener.accept()
    server.settimeout(5)
    return client, server


def test_a_peer_endpoints_connections_are_reset_and_no_other() -> None:
    with socket.create_server(("127.0.0.1", 0)) as peer, \
            socket.create_server(("127.0.0.1", 0)) as other:
        to_peer, at_peer = _pair(peer)
        to_other, at_other = _pair(other)
        try:
            # Our endpoint listens elsewhere (port 1: nothing of ours there).
            done = reset_connections((LO, 1), (LO, peer.getsockname()[1]))
            assert done == [((LO, to_peer.getsockname()[1]), (LO, peer.getsockname()[1]))]
            with pytest.raises(OSError):  # ECONNRESET, then EPIPE
                to_peer.sendall(b"x" * 4096)
                to_peer.sendall(b"x" * 4096)
            with pytest.raises(ConnectionResetError):  # the reset reached the peer
                at_peer.recv(1)
            to_other.sendall(b"still here")
            assert at_other.recv(64) == b"still here"
        finally:
            for s in (to_peer, at_peer, to_other, at_other):
                s.close()


def test_the_kernel_says_whether_a_link_carries() -> None:
    # A peer that reads nothing for a while (a starved process) still has a
    # link that carries: its kernel ACKs what arrives, and once its buffer is
    # full it answers window probes. That must never read as a broken rail;
    # only a link with no ACK for that long does (a cut cable: the namespace
    # tests cut one).
    with socket.create_server(("127.0.0.1", 0)) as peer:
        to_peer, at_peer = _pair(peer)
        try:
            ours = (LO, to_peer.getsockname()[1])
            there = (LO, peer.getsockname()[1])
            assert link_carries(ours, there, 1.5) is True  # the handshake's ACK, just now
            to_peer.setblocking(False)
            sent = 0
            with pytest.raises(BlockingIOError):
                for _ in range(100_000):  # until both buffers are full: bounded
                    sent += to_peer.send(b"x" * 65536)
            assert sent > 0
            assert link_carries(ours, there, 1.5) is True  # the peer is slow, not gone
            assert link_carries(ours, (LO, 1), 1.5) is None  # no connection to judge by
            time.sleep(0.5)  # window probes go on, and are answered
            assert link_carries(ours, there, 1.5) is True
        finally:
            to_peer.close()
            at_peer.close()
        # A connection that heard no ACK for longer than asked, with nothing
        # of ours outstanding: a peer process too starved to answer at all
        # looks like this, and so does a cut link. The peer's host decides:
        # it answers a knock (its kernel runs), so the link carries. (A cut
        # link answers nothing: the namespace failover tests cut rails.)
        to_peer, at_peer = _pair(peer)
        try:
            time.sleep(0.3)
            ours = (LO, to_peer.getsockname()[1])
            assert link_carries(ours, there, 0.1) is True
        finally:
            to_peer.close()
            at_peer.close()
