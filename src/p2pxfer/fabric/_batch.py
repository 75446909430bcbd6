"""``WriteBatch``: the per-rail cursors of one transfer, posted in C.

Each cursor (``struct p2p_cursor``) covers pieces ``[start, end)`` of three
``int64`` arrays and carries its own operation context: the transfer id with
the cursor's index in the top bits (``context_of`` / ``split_context``), so a
completion says which cursor, and with it which (rail, peer rail) pair, it
belongs to. Pieces without an immediate go out up to the rail's
``group`` per RMA write (``p2p.h``: ``P2P_GROUP_MAX``); the piece count of
such a write rides in two bits below the cursor's (``GROUP_SHIFT``), which
the completion reader takes out again: contexts and counts above this
module are per piece, whatever was grouped. Cursors can be added after
posting began (a write failing over to another rail pair, its notification)
and stopped for good (``kill``).

What must not live here: per-transfer bookkeeping beyond the cursors (the
engine's), or any Python loop over pieces.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import P2PXferError

from ._binding import ffi, fi_strerror, lib

if TYPE_CHECKING:
    from ._rail import Rail

__all__ = ["CURSOR_SHIFT", "GROUP_SHIFT", "MAX_CURSORS", "PEER_GONE", "TID_MASK", "ExpressCursor",
           "WriteBatch", "context_of", "group_of", "split_context"]

I64 = npt.NDArray[np.int64]
#: a cursor's index sits above this bit of its operation context; cursor 0's
#: context is the transfer id itself
CURSOR_SHIFT = 56
MAX_CURSORS = 1 << (64 - CURSOR_SHIFT)
#: a grouped write's piece count less one sits in the two bits from here
#: (``P2P_GROUP_SHIFT``), below the cursor's index
GROUP_SHIFT = 54
#: the transfer id's bits of an operation context
TID_MASK = (1 << GROUP_SHIFT) - 1
_NO_DC = (1 << 63) - 1
_IMM_TAILS = int(lib.P2P_IMM_TAILS)
#: ``ExpressCursor.post``: the peer's segment is gone, nothing posted
PEER_GONE = int(lib.P2P_PEER_GONE)


def context_of(tid: int, cursor: int) -> int:
    return tid | (cursor << CURSOR_SHIFT)


def split_context(context: int) -> tuple[int, int]:
    """(transfer id, cursor index) of an operation context."""
    return context & TID_MASK, context >> CURSOR_SHIFT


def group_of(context: int) -> tuple[int, int]:
    """(the context without its group bits, pieces its write carried) of an
    operation context as the provider hands it back (an error entry's)."""
    return context & ~(3 << GROUP_SHIFT), ((context >> GROUP_SHIFT) & 3) + 1


class WriteBatch:
    """The per-rail cursors of one transfer, posted by ``Poller.post`` in C.

    Each cursor covers pieces ``[start, end)`` of the same three arrays (or,
    for a notification, arrays of its own); its ``next`` advances as pieces go
    out. The arrays are kept alive here.
    """

    def __init__(self, src_off: I64, dst_off: I64, length: I64, context: int,
                 imm: int | None, capacity: int, *, imm_tails: bool = False) -> None:
        self._arrays = (src_off, dst_off, length)
        self._ptrs = tuple(ffi.from_buffer("int64_t[]", a) for a in self._arrays)
        self._keep: list[Any] = []  # other cursors' arrays (``add``), kept alive here
        self._capacity = capacity = max(capacity, 1)
        self._c = ffi.new("struct p2p_cursor[]", capacity)
        self.context = context
        self.imm = imm
        #: each entry of the arrays goes as a head and a tail (``Rail.imm_tail``,
        #: ``P2P_IMM_TAILS``): cursor indices count both, only tails carry ``imm``
        self.imm_tails = imm_tails
        self.unposted_at_cancel = 0  # pieces a cancellation kept from going out
        self.rails: list[int] = []
        self.starts: list[int] = []
        # Where each cursor really ends: ``window`` may hold a cursor's ``end``
        # in C below it (a per-peer bound on pieces in flight).
        self.ends: list[int] = []
        #: where each cursor's share ended when added (its delivery-complete tail)
        self.tails: list[int] = []
        self.peers: list[tuple[Rail, bytes]] = []
        self._epochs: list[int] = []
        #: cursors stopped for good (``kill``): their completions mean nothing
        self.dead: set[int] = set()

    def add(self, rail_index: int, rail: Rail, dest: int, start: int, end: int,
            src_base: int, src_desc: Any, dst_base: int, dst_key: int,
            address: bytes = b"", *, dc_from: int | None = None, imm: int | None = None,
            arrays: tuple[I64, I64, I64] | None = None, epoch: int | None = None) -> int:
        """One rail's share; returns the cursor's index. ``address`` is the
        peer endpoint's (to reconnect after a teardown, and for
        ``StallWatch``). Pieces from index ``dc_from`` on are posted with
        FI_DELIVERY_COMPLETE; ``imm`` overrides the batch's immediate;
        ``arrays`` (src, dst, length) replace the batch's for this cursor;
        ``epoch``: the rail's AV epoch read before ``dest`` was looked up
        (default: now)."""
        i = len(self.rails)
        if i >= MAX_CURSORS:
            raise ValueError(f"a write cannot have more than {MAX_CURSORS} cursors")
        if i >= self._capacity:
            self._grow(max(2 * self._capacity, i + 1))
        if arrays is None:
            ptrs = self._ptrs
        else:
            ptrs = tuple(ffi.from_buffer("int64_t[]", a) for a in arrays)
            self._keep.extend((*arrays, *ptrs))
        with_imm = 0 if imm is None and self.imm is None else 1
        if with_imm and imm is None and arrays is None and self.imm_tails:
            with_imm = int(lib.P2P_IMM_TAILS)
        if imm is None:
            imm = self.imm
        bell = rail.bell_of(address)
        if bell != ffi.NULL:
            self._keep.append(bell)  # C points at it while this batch lives
        lib.p2p_cursor_set(self._c, i, rail.endpoint.handle, dest, *ptrs, start, end,
                           src_base, src_desc, dst_base, dst_key, imm or 0, with_imm,
                           self.context | (i << CURSOR_SHIFT),
                           _NO_DC if dc_from is None else dc_from, bell, rail.group)
        self.rails.append(rail_index)
        self.starts.append(start)
        self.ends.append(end)
        self.tails.append(end)
        self.peers.append((rail, address))
        self._epochs.append(rail.av.epoch if epoch is None else epoch)
        return i

    def _grow(self, capacity: int) -> None:
        new = ffi.new("struct p2p_cursor[]", capacity)
        ffi.memmove(new, self._c, ffi.sizeof("struct p2p_cursor") * len(self.rails))
        self._c, self._capacity = new, capacity

    def refresh(self) -> None:
        """Point cursors at their peers afresh where the rail's AV dropped
        addresses since (``AddressVector.remove`` tore a connection down): a
        removed ``fi_addr_t`` must never be posted to. Re-inserting the
        address makes the provider connect anew. A peer that cannot be
        inserted again (a shm peer gone) fails its cursor, as a failed post
        does (``failures``), instead of raising in whichever thread posts."""
        for i, (rail, address) in enumerate(self.peers):
            if self._epochs[i] != rail.av.epoch and address and i not in self.dead:
                try:
                    self._c[i].dest = rail.peer(address)
                except P2PXferError:
                    self.fail(i)
                self._epochs[i] = rail.av.epoch

    def fail(self, i: int, code: int = errno.EHOSTUNREACH) -> None:
        """Cursor ``i`` cannot post (its peer cannot be reached): it fails as
        a post that returned ``-code`` does (``failures``)."""
        c = self._c[i]
        c.err = -code
        c.end = c.next

    def window(self, room: list[int]) -> bool:
        """Let each cursor post at most ``room[i]`` more pieces (held back in C
        until the next call); True if some cursor may post now."""
        can = False
        for i, c in enumerate(self._c[0:len(self.rails)]):
            c.end = self._whole(i, min(self.ends[i], c.next + max(room[i], 0)))
            can = can or (c.end > c.next and not c.err)
        return can

    def posted_by_cursor(self) -> list[int]:
        """Pieces each cursor has posted so far."""
        return [int(c.next) - s for s, c in zip(self.starts, self._c[0:len(self.rails)],
                                                 strict=True)]

    def __len__(self) -> int:
        return len(self.rails)

    def post_once(self) -> bool:
        """One posting pass without reading any CQ (for a thread that does not
        own them); True if pieces are left because a TX queue was full."""
        return bool(lib.p2p_post_once(self._c, len(self.rails)))

    @property
    def posted(self) -> bool:
        """Every piece is out (or its cursor failed)."""
        return all(c.next >= e or c.err
                   for c, e in zip(self._c[0:len(self.rails)], self.ends, strict=True))

    def unposted(self) -> int:
        return sum(e - int(c.next)
                   for c, e in zip(self._c[0:len(self.rails)], self.ends, strict=True))

    def progress(self) -> list[tuple[int, int, int]]:
        """(rail index, pieces posted, bytes posted) per cursor so far."""
        return [(r, int(c.next) - s, int(c.bytes_posted))
                for r, s, c in zip(self.rails, self.starts, self._c[0:len(self.rails)],
                                   strict=True)]

    def failures(self) -> list[str]:
        out = []
        for r, c in zip(self.rails, self._c[0:len(self.rails)], strict=True):
            if c.err:
                out.append(f"posting piece {int(c.next)} on rail {r} failed: "
                           f"{fi_strerror(int(c.err))} [{int(c.err)}]")
        return out

    def stuck_peers(self) -> list[tuple[Rail, bytes]]:
        """(rail, peer address) of every cursor with pieces still to post."""
        return [p for p, c, e in zip(self.peers, self._c[0:len(self.rails)], self.ends,
                                     strict=True)
                if c.next < e and not c.err and p[1]]

    def kill(self, i: int) -> int:
        """Stop cursor ``i`` for good (its pair failed): returns how many of
        its pieces will now never be posted."""
        c = self._c[i]
        n = self.ends[i] - int(c.next)
        c.end = c.next
        self.ends[i] = int(c.next)
        self.dead.add(i)
        return n

    def cancel(self) -> int:
        """Stop posting: returns how many pieces will now never be posted.
        A head posted keeps its tail: it carries the piece's immediate."""
        n = 0
        for i, c in enumerate(self._c[0:len(self.rails)]):
            stop = self._whole(i, int(c.next))
            n += self.ends[i] - stop
            c.end = stop
            self.ends[i] = stop
        return n

    def _whole(self, i: int, at: int) -> int:
        """Where cursor ``i`` may stop at or after ``at``: never between a
        head and its tail (``P2P_IMM_TAILS``; its pieces start even)."""
        if at & 1 and self._c[i].with_imm == lib.P2P_IMM_TAILS:
            return min(self.ends[i], at + 1)
        return at


class ExpressCursor:
    """The one cursor a shard's express writes (``engine/_express.py``) are
    posted from: aimed at a plan's peer and memory once (``aim``), then
    posted with one C call per write, no ``WriteBatch`` made. Used by the
    trio thread only, one write at a time."""

    def __init__(self) -> None:
        self._c = ffi.new("struct p2p_cursor[1]")
        self._keep: tuple[Any, ...] = ()
        self._bell: Any = None
        #: what the cursor is aimed at (``aim``'s caller's key), or None
        self.aimed: Any = None

    def aim(self, key: Any, ep: Any, dest: int, src_base: int, src_desc: Any, dst_base: int,
            dst_key: int, bell: Any, group: int) -> None:
        """Point the cursor at endpoint ``ep`` (``Rail.endpoint.handle``),
        peer ``dest`` and the memory at both ends: what every write of one
        plan shares. ``bell``: the peer's doorbell (``Rail.bell_of``), rung
        after a piece that needs its progress; ``group``: the rail's pieces
        per RMA write (``Rail.group``). ``key`` is remembered as ``aimed``."""
        self._bell = bell  # the C cursor points at it until aimed elsewhere
        lib.p2p_cursor_set(self._c, 0, ep, dest, ffi.NULL, ffi.NULL, ffi.NULL, 0, 0,
                           src_base, src_desc, dst_base, dst_key, 0, 0, 0, _NO_DC, bell, group)
        self.aimed = key

    def post(self, poller: Any, src_off: I64, dst_off: I64, length: I64, imm: int | None,
             context: int, imm_tails: bool = False, alive_fd: int = -1) -> int:
        """Hold ``poller``'s CQs (``Poller.handle``; the caller lets go) and
        post every piece where ``aim`` pointed: 0 once all were, 1 if some
        are left (a full TX queue) or one failed to post (``failed``),
        ``PEER_GONE`` if the file open at ``alive_fd`` (a shm peer's segment,
        ``open_shm_segment``) has lost its name: then nothing was held or
        posted.
        ``imm_tails``: each entry goes as a head and a tail, and only the
        tails carry ``imm`` (``WriteBatch.imm_tails``)."""
        keep = self._keep
        if keep and keep[0] is src_off and keep[1] is dst_off and keep[2] is length:
            # The same arrays as the last write (a scatter list written again;
            # its arrays are read-only copies of its own): the same pointers.
            ptrs = keep[3:]
        else:
            ptrs = (ffi.from_buffer("int64_t[]", src_off),
                    ffi.from_buffer("int64_t[]", dst_off), ffi.from_buffer("int64_t[]", length))
            # the C cursor points at them until the next write
            self._keep = (src_off, dst_off, length, *ptrs)
        with_imm = 0 if imm is None else _IMM_TAILS if imm_tails else 1
        return int(lib.p2p_express_post(poller, self._c, *ptrs, len(length) << imm_tails,
                                        imm or 0, with_imm, context, alive_fd))

    def hand_to(self, batch: WriteBatch) -> None:
        """Carry how far posting got into ``batch``'s cursor 0, which covers
        the same pieces: the write goes on as a regular one."""
        mine, theirs = self._c[0], batch._c[0]
        theirs.next, theirs.err, theirs.bytes_posted = mine.next, mine.err, mine.bytes_posted
