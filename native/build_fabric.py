"""Builds ``p2pxfer._fabric``: the cffi API-mode binding over libfabric.

API mode (a compiled extension), never ABI mode: libfabric's data-path calls
(``fi_write``, ``fi_cq_read``, ...) are ``static inline`` in its headers and do
not exist as symbols to ``dlopen``. Declarations live in ``cdefs/*.h`` split by
area; constants there are ``...`` so the compiler fills in the real values.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
# Paths below are relative to the project root, where setuptools runs this.
CDEFS = ("types.h", "constants.h", "calls.h", "helpers.h")

ffibuilder = FFI()
ffibuilder.cdef("\n".join((HERE / "cdefs" / name).read_text() for name in CDEFS))
ffibuilder.set_source(
    "p2pxfer._fabric",
    """
    #include <rdma/fabric.h>
    #include <rdma/fi_domain.h>
    #include <rdma/fi_endpoint.h>
    #include <rdma/fi_rma.h>
    #include <rdma/fi_eq.h>
    #include <rdma/fi_errno.h>
    #include <rdma/fi_cm.h>
    #include <string.h>
    #include "p2p.h"
    #include "baseline.h"
    """,
    sources=["native/src/p2p.c", "native/src/baseline.c"],
    include_dirs=["native/src"],
    libraries=["fabric"],
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
