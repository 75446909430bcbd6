"""Retiring a client's shared memory without letting a late write hurt anyone.

When a client unexports a region or goes away, a write a peer started
before that can still be streaming in (tcp copies a message into the target
address as its bytes arrive, long after the key was checked), and an
export's keys even stay open a while on purpose (``Engine.unexport_later``:
a late write through a closed key makes tcp drop the whole connection).
Unmapping the pages at once would turn those bytes into a SIGSEGV of the
whole daemon, and letting the kernel hand the address range to the next
mapping would let them land in another client's memory.

An export's own mapping is made here (``map_file``, no Python ``mmap``) and
retired in one step (``retire_range``): private pages replace the file's
under it, the keys still open write there, and the file is not held a
moment longer; once the keys close, ``discard`` drops what late writes
dirtied. A client's whole mapping (a Python ``mmap``, ``retire``) goes as
follows.

A retired mapping is first replaced, in place, by private anonymous pages
(``MAP_FIXED``; untouched pages cost nothing): late bytes land there, visible
to no one. Then the Python ``mmap`` is closed (it holds a dup of the memfd,
which must go so the client's memory is freed) and the range is taken again
at once (``MAP_FIXED_NOREPLACE``), held for ``HOLD_S``, then unmapped. At most
``MAX_HELD`` ranges are held; the oldest goes first when more are retired.
(Between the close and the new reservation a late byte would still fault:
microseconds, where unmapping at once left the whole rest of the message.)

What must not live here: registrations (the engine's) or anything about
sessions.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from collections import deque

from p2pxfer.errors import P2PXferError
from p2pxfer.log import get_logger
from p2pxfer.memory import buffer_span

__all__ = ["HOLD_S", "MAX_HELD", "MIN_HOLD_S", "discard", "held", "held_bytes", "map_file",
           "retire", "retire_range"]

log = get_logger("p2pxfer.daemon")

#: how long a retired range stays reserved (a stalled tcp message can resume
#: once its connection recovers; minutes cover a flapping link)
HOLD_S = 600.0
#: at most this many retired ranges are held (each is one mapping of the process)
MAX_HELD = 4096
#: ... but each at least this long, whatever the count (longer than an
#: unexported region's keys linger: ``_exports.KEY_LINGER_S``)
MIN_HOLD_S = 60.0

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10  # Linux; mmap does not export these two
_MAP_FIXED_NOREPLACE = 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTNEED = 4

#: (unmap after, address, size, owner's uid) of the ranges held
_held: deque[tuple[float, int, int, int | None]] = deque()


def _anonymous(address: int, size: int, fixed: int) -> None:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | fixed
    r = _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if r == _MAP_FAILED or r != address:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot hold {size} bytes at {address:#x}: {os.strerror(err)}")


def map_file(fd: int, offset: int, size: int) -> int:
    """``size`` bytes of ``fd`` from ``offset`` (page aligned), mapped shared
    read-write here without a Python ``mmap`` (which would keep a dup of the
    fd, and so the file, until it is closed): its address. ``retire_range``
    undoes it."""
    r = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
    if r is None or r == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {size} bytes at offset {offset}: {os.strerror(err)}")
    return int(r)


def retire_range(address: int, size: int, owner: int | None = None, *,
                 for_good: bool = False) -> bool:
    """Replace what ``map_file`` mapped at ``address`` with private pages in
    one step (``MAP_FIXED``: the file leaves, no moment unmapped) and hold
    the range ``HOLD_S`` (counted against ``owner``), then unmap it; with
    ``for_good`` never unmap it (a Python view of it may outlive any hold).
    False if the pages could not be replaced (logged): the range is unmapped
    then, and keys over it must close at once."""
    now = time.monotonic()
    try:
        _anonymous(address, size, _MAP_FIXED)
    except OSError as exc:
        log.warning("memory.retire_failed", error=str(exc))
        _libc.munmap(address, size)  # the file must go: the late-write hazard, logged
        return False
    if not for_good:
        _held.append((now + HOLD_S, address, size, owner))
        _expire(now)
    return True


def discard(address: int, size: int) -> None:
    """Give back the pages late writes dirtied in a retired range (its keys
    are closed): they read as zeros again and cost nothing."""
    if _libc.madvise(address, size, _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        log.warning("memory.discard_failed", error=os.strerror(err))


def retire(m: mmap.mmap, owner: int | None = None) -> None:
    """Detach ``m``'s pages from the client's memfd now, close ``m`` (and its
    fd), and keep its address range reserved for a while (counted against
    ``owner``, a uid, meanwhile: ``held_bytes``)."""
    now = time.monotonic()
    try:
        span = buffer_span(m)
        _anonymous(span.address, span.nbytes, _MAP_FIXED)
    except (OSError, ValueError, BufferError, P2PXferError) as exc:
        # Could not swap the pages (closed already, or the kernel said no):
        # unmap now, as before; logged because it leaves the late-write hazard.
        log.warning("memory.retire_failed", error=str(exc))
        with contextlib.suppress(BufferError):
            m.close()
        return
    try:
        m.close()
    except BufferError:
        # A view still alive keeps the (now anonymous) mapping and the fd;
        # both go with the view.
        return
    try:
        _anonymous(span.address, span.nbytes, _MAP_FIXED_NOREPLACE)
    except OSError as exc:  # something else took the range in between
        log.warning("memory.retire_unheld", error=str(exc))
        return
    _held.append((now + HOLD_S, span.address, span.nbytes, owner))
    _expire(now)


def _expire(now: float) -> None:
    # Past MAX_HELD the oldest go first, but never one retired less than
    # MIN_HOLD_S ago: an export's keys may still write into it.
    while _held and (_held[0][0] <= now or (len(_held) > MAX_HELD
                                            and _held[0][0] - HOLD_S + MIN_HOLD_S <= now)):
        _, address, size, _owner = _held.popleft()
        _libc.munmap(address, size)


def held_bytes(owner: int) -> int:
    """Bytes of address space held for ranges ``owner`` (a uid) released."""
    _expire(time.monotonic())
    return sum(size for _, _, size, who in _held if who == owner)


def held() -> int:
    """Retired ranges still reserved (for tests and ``status``)."""
    return len(_held)
