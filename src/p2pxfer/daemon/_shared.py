"""Client memory mapped in the daemon: a sealed memfd, shared over the unix
socket, mapped read-write here and retired (``_retire``) when released.

Shared memory must be a memfd sealed against shrinking: a client that
truncated its file under our mapping would turn the next incoming write into
a SIGBUS of the whole daemon. What must not live here: registrations (the
engine's) or sessions.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

from p2pxfer.errors import InvalidArgument, ScatterError

from ._retire import discard, map_file, retire, retire_range

__all__ = ["ExportMap", "SharedMap", "seal_shared"]

def seal_shared(fd: int) -> None:
    """Make sure the client can never shrink the file under our mapping (a
    write into pages past its end would kill the daemon with SIGBUS): the
    memfd must carry ``F_SEAL_SHRINK``, or take it now. Anything that cannot
    carry seals (not a memfd) is refused."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise InvalidArgument("share takes a memfd (memfd_create with MFD_ALLOW_SEALING); "
                              f"this descriptor cannot carry seals ({exc.strerror})") from exc
    if seals & fcntl.F_SEAL_SHRINK:
        return
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        raise InvalidArgument("the shared memfd is not sealed against shrinking "
                              "(F_SEAL_SHRINK) and cannot be: create it with "
                              f"MFD_ALLOW_SEALING ({exc.strerror})") from exc


class SharedMap:
    """A client's memfd, sealed against shrinking, mapped here and registered
    with the engine."""

    kind = "host"

    def __init__(self, mem_id: int, fd: int, size: int, owner: int | None = None) -> None:
        seal_shared(fd)  # before the size check: the size cannot go down after it
        st = os.fstat(fd)
        if st.st_size < size:
            raise InvalidArgument(f"memfd holds {st.st_size} bytes, not {size}")
        self.id = mem_id
        self.size = size
        self.owner = owner  # the client's uid: its range stays charged to it while held
        try:
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot map the shared fd read-write: {exc}") from exc
        self._fd = os.dup(fd)  # exports map their ranges apart (``export_map``)

    def export_map(self, offset: int, length: int) -> ExportMap:
        """``[offset, offset + length)`` mapped on its own, for one export to
        register: its unexport retires exactly this mapping (``_retire``), so
        a peer's write still streaming in when it answered lands in private
        pages, never in the client's memory, which stays mapped and in use."""
        self.view(offset, length)  # out_of_range if it does not fit
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            return ExportMap(self._fd, start, offset - start, length, self.owner)
        except OSError as exc:
            raise InvalidArgument(f"cannot map [{offset}, {offset + length}) of memory "
                                  f"{self.id} for its export: {exc}") from exc

    def view(self, offset: int, length: int | None = None) -> memoryview:
        end = self.size if length is None else offset + length
        if offset < 0 or end > self.size or end <= offset:
            raise ScatterError(f"[{offset}, {end}) is outside memory {self.id} of "
                               f"{self.size} bytes")
        return memoryview(self.map)[offset:end]

    def close(self) -> None:
        # Not unmapped at once: a peer's write may still be streaming into
        # these pages (see ``_retire``).
        retire(self.map, self.owner)
        os.close(self._fd)


class ExportMap:
    """One export's own mapping of its range (``SharedMap.export_map``),
    made without a Python ``mmap`` (``_retire.map_file``): retired, private
    pages replace the client's at once and nothing here holds its memfd,
    while the export's keys may still take late writes there
    (``Exports.remove``)."""

    #: the engine registered this mapping for the export alone
    registered_apart = True

    def __init__(self, fd: int, start: int, skip: int, length: int,
                 owner: int | None) -> None:
        self.size = skip + length  # mapped from ``start``, page aligned
        self.owner = owner
        self.address = map_file(fd, start, self.size)
        buf = (ctypes.c_char * length).from_address(self.address + skip)
        self.view = memoryview(buf).cast("B")
        self._retired = False

    def retire(self) -> bool:
        """Private pages in under it now, the range held a while
        (``_retire.retire_range``); for good if a view of it is still
        exported (it may be read after any hold). False if the pages could
        not be replaced (the range is unmapped: keys over it must close
        now). Idempotent."""
        if self._retired:
            return True
        self._retired = True
        try:
            self.view.release()
        except BufferError:
            return retire_range(self.address, self.size, self.owner, for_good=True)
        return retire_range(self.address, self.size, self.owner)

    def discard(self) -> None:
        """Once its keys are closed: the pages late writes dirtied go."""
        discard(self.address, self.size)
