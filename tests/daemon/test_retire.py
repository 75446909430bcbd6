"""Retired client memory (``daemon._retire``): a late write into a retired
mapping lands in private pages, never in the client's memfd, and never
crashes the daemon."""

from __future__ import annotations

import ctypes
import mmap
import os

from p2pxfer.daemon._retire import held, retire
from p2pxfer.daemon._shared import ExportMap
from p2pxfer.memory import buffer_span


def test_a_late_write_after_retire_misses_the_memfd() -> None:
    size = 1 << 20
    fd = os.memfd_create("retire-test")
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[:4] = b"live"
        address = buffer_span(m).address
        before = held()
        retire(m)
        assert held() == before + 1
        assert m.closed  # and with it the mmap's own dup of the memfd
        with open("/proc/self/maps") as maps:
            assert not [line for line in maps if "retire-test" in line]
        # What a provider still copying a message would do: write the old address.
        ctypes.memmove(address, b"late" * 1024, 4096)
        assert os.pread(fd, 4, 0) == b"live"
        assert os.pread(fd, 4096, 4096) == bytes(4096)
    finally:
        os.close(fd)


def test_an_export_map_retires_in_one_step_and_lets_go_of_the_memfd() -> None:
    """An export's own mapping (``ExportMap``: no Python ``mmap``) retired:
    private pages replace the memfd's at once (its keys may still write
    there: ``Exports.remove``), nothing maps or holds the memfd any more,
    and once the keys are closed ``discard`` gives back what late writes
    dirtied."""
    size = 1 << 20
    fd = os.memfd_create("export-map-test")
    try:
        os.ftruncate(fd, size)
        own = ExportMap(fd, 0, 4096, 8192, owner=None)
        assert (own.view.nbytes, own.view.format, own.view.readonly) == (8192, "B", False)
        own.view[:4] = b"live"
        assert os.pread(fd, 4, 4096) == b"live"  # shared with the client's memfd
        address = own.address + 4096
        before = held()
        assert own.retire() and own.retire()  # idempotent
        assert held() == before + 1
        with open("/proc/self/maps") as maps:
            assert not [line for line in maps if "export-map-test" in line]
        ctypes.memmove(address, b"late" * 1024, 4096)  # a key still open writes here
        assert os.pread(fd, 4, 4096) == b"live"
        assert ctypes.string_at(address, 4) == b"late"
        own.discard()
        assert ctypes.string_at(address, 4096) == bytes(4096)
    finally:
        os.close(fd)
