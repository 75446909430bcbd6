"""Builds ``p2pxfer.bench._cref``: the C-to-C reference loops every bench
ratio is measured against (``native/src/baseline.c``).

Kept out of the production binding (``p2pxfer._fabric``): they share none of
the engine's code, and nothing but the bench loads them. The fabric objects
they take are opaque pointers handed over from ``p2pxfer._fabric``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from build_fabric import SITE_INCLUDE, SITE_LIB  # noqa: E402

ffibuilder = FFI()
ffibuilder.cdef((HERE / "cdefs" / "reference.h").read_text())
ffibuilder.set_source(
    "p2pxfer.bench._cref",
    '#include "baseline.h"',
    sources=["native/src/baseline.c"],
    include_dirs=["native/src", *SITE_INCLUDE],
    libraries=["fabric"],
    library_dirs=SITE_LIB,
    runtime_library_dirs=SITE_LIB,
    extra_compile_args=["-O2", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
