"""The one door to the compiled binding: ``ffi``/``lib`` and the return-code check.

Only modules inside ``p2pxfer.fabric`` import this. Every libfabric return code
is checked by :func:`check`, so each failure becomes a :class:`FabricError`
carrying the call name, the code and ``fi_strerror``'s words.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

from p2pxfer.errors import FabricError

# Read by libfabric once, when it first initialises (the first fi_getinfo),
# so before anything here calls it: with it, fi_av_remove on tcp;ofi_rxm
# closes the peer's connection and flushes the operations queued on it
# (FI_ECANCELED); without it (1.17's default) the connection stays, its
# queued writes go out whenever the link lets them, and a write posted after
# the address is inserted again goes into that same connection
# (``Rail.disconnect``). A value set by the user is kept.
os.environ.setdefault("FI_AV_REMOVE_CLEANUP", "1")

from ._signals import kept_signals

try:
    # Loading libfabric loads libinfinipath, which takes SIGINT, SIGTERM,
    # SIGSEGV & co. for itself (see ``_signals``): they are given back.
    with kept_signals():
        from p2pxfer._fabric import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "p2pxfer's native binding is not built: install the package with "
        "`pip install -e .` on a machine with libfabric-dev"
    ) from exc

__all__ = ["check", "ffi", "fi_strerror", "lib", "raise_fabric_error", "raw_address"]


def raw_address(pointer: Any) -> int:
    """The address a binding pointer holds, for C code built apart from this
    binding (the bench's reference loops), whose cffi types are its own."""
    return int(ffi.cast("uintptr_t", pointer))


def fi_strerror(code: int) -> str:
    """libfabric's words for a (positive or negative) error code."""
    return str(ffi.string(lib.fi_strerror(abs(int(code)))).decode(errors="replace"))


def raise_fabric_error(
    call: str, code: int, context: str | None = None, cls: type[FabricError] = FabricError
) -> NoReturn:
    raise cls(call, int(code), fi_strerror(code), context)


def check(rc: Any, call: str, context: str | None = None) -> int:
    """Return ``rc`` if it is not an error, else raise :class:`FabricError`."""
    rc = int(rc)
    if rc < 0:
        raise_fabric_error(call, rc, context)
    return int(rc)
