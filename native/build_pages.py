"""Builds ``p2pxfer._pages``: the C loops over page lists that need no fabric
(``native/src/pages.c``: validate a scatter list, copy one within a process).

Its own extension, linked against nothing but libc, so that the client
library (``p2pxfer.client``) checks the scatter lists it sends without
loading libfabric and the providers it drags in.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((HERE / "cdefs" / "pages.h").read_text())
ffibuilder.set_source(
    "p2pxfer._pages",
    '#include "pages.h"',
    sources=["native/src/pages.c"],
    include_dirs=["native/src"],
    extra_compile_args=["-O2", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
