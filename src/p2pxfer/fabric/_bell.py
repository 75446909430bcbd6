"""Doorbells: an initiator wakes a shm target that naps.

shm's CQs have no wait fd (``FI_WAIT_FD`` fails at ``fi_cq_open``), so an
idle shm target's poller naps a growing back-off between looks at its CQ (up
to ``EngineConfig.backoff_max_ns``, longer in deep idle) to stay near 0% CPU.
A piece whose completion needs the target's progress (the delivery-complete
tail of a write, or any piece carrying an immediate) waited out that nap: the
first write after a pause took milliseconds where the provider needs
microseconds. So each shm rail listens on an abstract unix datagram socket
named after its endpoint address (``Doorbell``), and its poller sleeps on it
too; an initiator rings it right after posting such a piece (in C,
``native/src/p2p.c``: at most once per ``P2P_RING_GAP_NS`` per peer). A woken
target spins while the piece arrives.

A bell that cannot be rung (the peer in another network namespace, or gone)
costs nothing and changes nothing: the target's back-off still bounds the
wait. The datagrams carry nothing but their sender's credentials
(``SO_PASSCRED``): the poller takes a ring only from our own user or root,
the only ones who can be shm peers (segments are 0600). Anyone else who can
reach the name (a local process in the same network namespace) only makes
the poller read and drop datagrams, one read per datagram sent, instead of
a spin of ``bell_spin_ns`` per ring (``Poller.bells_refused`` counts them).

What must not live here: posting, polling (C), the back-off policy
(``engine/_poller_loop.py``).
Threads: a ``Doorbell`` is made and closed with its rail; ``Bells`` hands out
one C bell per peer address to whichever thread posts (the trio thread's
express path, the poller thread); whoever hands a bell to C keeps it alive
(``WriteBatch``, ``ExpressCursor``), so ``Bells`` may forget one at any time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from typing import Any

from p2pxfer.log import get_logger

from ._binding import ffi, lib
from ._objects import shm_segment

__all__ = ["Bells", "Doorbell", "bell_name"]

log = get_logger("p2pxfer.fabric")

#: a rail keeps this many peers' bells, then starts over (a cursor keeps
#: the bell it points at alive itself)
MAX_BELLS = 4096
_PREFIX = b"\0p2pxfer-bell-"


def bell_name(address: bytes) -> bytes:
    """The abstract socket name of the doorbell of the shm endpoint at
    ``address`` (its raw endpoint address, as exchanged in descriptors).
    Its segment file's identity is in it too: shm addresses are made of
    process ids, and two containers that share a network namespace but not
    /dev/shm (nor process ids) could hold the same address."""
    h = hashlib.blake2b(address.rstrip(b"\0"), digest_size=16)
    path = shm_segment(address)
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    if st is not None:
        h.update(f"{st.st_dev}:{st.st_ino}".encode())
    return _PREFIX + h.hexdigest().encode()


@functools.cache
def _sending_socket() -> socket.socket:
    """This process's socket for ringing (unbound, non-blocking, never
    closed: a C bell may hold its descriptor as long as the process lives)."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                         | socket.SOCK_CLOEXEC)


class Doorbell:
    """A shm rail's doorbell: the socket its poller sleeps on. ``fd`` is -1
    where the name could not be bound (taken: logged, and the rail naps as
    before)."""

    def __init__(self, address: bytes) -> None:
        self._sock: socket.socket | None = None
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                 | socket.SOCK_CLOEXEC)
            # Each ring says who sent it: the poller takes only our user's
            # and root's (a shm peer is one of them: segments are 0600).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(bell_name(address))
        except OSError as exc:  # out of descriptors, or the name is taken
            log.warning("rail.doorbell_unavailable", error=str(exc))
            if sock is not None:
                sock.close()
            return
        self._sock = sock

    @property
    def fd(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Bells:
    """The C bells of one rail's peers, by endpoint address. ``every``: every
    piece needs the target's progress (delivery-complete on every transmit),
    so any post rings."""

    def __init__(self, *, every: bool = False) -> None:
        self._bells: dict[bytes, Any] = {}
        self._every = every
        # Made with the first shm rail, not at the first ring: what a process
        # holds is settled once its rails are open.
        self._fd = _sending_socket().fileno()

    def of(self, address: bytes) -> Any:
        """The C bell (``struct p2p_bell *``) to ring after posting to the
        shm peer at ``address``. Whoever hands it to C keeps this object
        alive as long as C may use it (``WriteBatch``, ``ExpressCursor``)."""
        bell = self._bells.get(address)
        if bell is not None:
            return bell
        if len(self._bells) >= MAX_BELLS:
            self._bells.clear()  # many peers came and went: start over
        bell = ffi.new("struct p2p_bell *")
        name = bell_name(address)
        if lib.p2p_bell_init(bell, self._fd, name, len(name), int(self._every)) < 0:
            return ffi.NULL
        # Two threads may get here for one peer: both use the one stored.
        return self._bells.setdefault(address, bell)

    def forget(self, address: bytes) -> None:
        """The peer left (its address out of the AV)."""
        self._bells.pop(address, None)

    def rings(self) -> int:
        """Datagrams sent to this rail's peers, lifetime."""
        return sum(int(b.rings) for b in list(self._bells.values()))
