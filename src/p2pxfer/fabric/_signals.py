"""Keep the process's signal dispositions as they were across loading libfabric.

Debian's libfabric links its psm providers, and with them ``libinfinipath``,
whose load-time constructor installs C handlers for SIGINT, SIGTERM, SIGSEGV,
SIGBUS, SIGILL and SIGABRT: after ``import p2pxfer`` a Ctrl-C would end the
process at once with status 1 (no ``KeyboardInterrupt``, no ``finally``), and
a crash would skip ``faulthandler``. ``kept_signals`` snapshots every
signal's raw ``struct sigaction`` (handler, mask and flags, whatever
installed them: Python, faulthandler, the embedding program) before the load
and puts back each one that changed. libc is reached through ``ctypes``
because the cffi binding is exactly what is being loaded.

Owns no state beyond the snapshot of one ``with`` block; any thread, but only
around a library load (signal dispositions are process-wide).
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["kept_signals"]

# Larger than any libc's struct sigaction (glibc x86_64/aarch64: 152 bytes):
# only sigaction() reads or writes it.
_SIGACTION_BYTES = 512
_SA_RESTORER = 0x04000000
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def _meaning(raw: bytes) -> bytes:
    """The parts of a glibc ``struct sigaction`` the kernel keeps: the
    handler, the first 64 signals of the mask and the flags (libc leaves
    the rest of its 1024-bit mask as its stack had it), less SA_RESTORER,
    which libc adds by itself to whatever it installs."""
    flags = int.from_bytes(raw[136:140], sys.byteorder) & ~_SA_RESTORER
    return raw[0:16] + flags.to_bytes(4, sys.byteorder)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - a platform without dlopen(NULL)
        return None


def _snapshot(libc: ctypes.CDLL) -> dict[int, bytes]:
    out = {}
    for sig in range(1, signal.NSIG):
        if sig in _UNCATCHABLE:
            continue
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(sig, None, buf) == 0:
            out[sig] = buf.raw
    return out


@contextmanager
def kept_signals() -> Iterator[list[int]]:
    """Run the block, then restore every signal disposition it changed; the
    list it yields is filled with the signals that were put back."""
    restored: list[int] = []
    libc = _libc()
    before = _snapshot(libc) if libc is not None else {}
    try:
        yield restored
    finally:
        if libc is not None:
            for sig, raw in _snapshot(libc).items():
                old = before.get(sig)
                if old is not None and _meaning(old) != _meaning(raw):
                    libc.sigaction(sig, ctypes.create_string_buffer(old, len(old)), None)
                    restored.append(sig)
