"""Retired client memory (``daemon._retire``): a late write into a retired
mapping lands in private pages, never in the client's memfd, and never
crashes the daemon."""

from __future__ import annotations

import ctypes
import mmap
import os

from p2pxfer.daemon._retire import held, retire
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
