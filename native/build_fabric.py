"""Builds the three cffi API-mode extensions: ``p2pxfer._fabric`` (the
binding over libfabric and the engine's C helpers), ``p2pxfer._pages`` (the
page-list loops that need no libfabric) and ``p2pxfer.bench._cref`` (the
bench's C reference loops).

API mode (a compiled extension), never ABI mode: libfabric's data-path calls
(``fi_write``, ``fi_cq_read``, ...) are ``static inline`` in its headers and do
not exist as symbols to ``dlopen``. Declarations live in ``cdefs/*.h`` split by
area; constants there are ``...`` so the compiler fills in the real values.

Which libfabric: the one ``pkg-config libfabric`` names, so a site install
(an EFA installer's ``/opt/amazon/efa``, a source build in ``/opt/libfabric``)
is used by putting its ``lib/pkgconfig`` on ``PKG_CONFIG_PATH`` before
building; its library directory is also recorded as the extension's rpath, so
the same libfabric is loaded at run time. Without pkg-config, or with the
system's libfabric, the compiler's default paths apply.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
# Paths below are relative to the project root, where setuptools runs this.
CDEFS = ("types.h", "constants.h", "calls.h", "helpers.h")



def site_libfabric() -> tuple[list[str], list[str]]:
    """(include dirs, library dirs) of the libfabric ``pkg-config`` names;
    empty lists when there is no pkg-config or no libfabric.pc (or it points
    at the compiler's default paths, which pkg-config leaves out)."""
    exe = shutil.which("pkg-config")
    if exe is None:
        return [], []
    try:
        incs = subprocess.run([exe, "--cflags-only-I", "libfabric"], check=True,
                              capture_output=True, text=True).stdout.split()
        libs = subprocess.run([exe, "--libs-only-L", "libfabric"], check=True,
                              capture_output=True, text=True).stdout.split()
    except subprocess.CalledProcessError:
        return [], []
    return ([f[2:] for f in incs if f.startswith("-I")],
            [f[2:] for f in libs if f.startswith("-L")])


SITE_INCLUDE, SITE_LIB = site_libfabric()

def builder(module: str, cdefs: tuple[str, ...], source: str, sources: list[str], *,
            fabric: bool) -> FFI:
    """One cffi API-mode extension: ``cdefs`` (files in ``cdefs/``) declared,
    ``source`` its C preamble; linked against libfabric when ``fabric``."""
    ffi = FFI()
    ffi.cdef("\n".join((HERE / "cdefs" / name).read_text() for name in cdefs))
    link: dict[str, list[str]] = ({"libraries": ["fabric"], "library_dirs": SITE_LIB,
                                   "runtime_library_dirs": SITE_LIB} if fabric else {})
    ffi.set_source(module, source, sources=sources,
                   include_dirs=["native/src", *(SITE_INCLUDE if fabric else [])],
                   extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"], **link)
    return ffi


ffibuilder = builder("p2pxfer._fabric", CDEFS, """
    #include <rdma/fabric.h>
    #include <rdma/fi_domain.h>
    #include <rdma/fi_endpoint.h>
    #include <rdma/fi_rma.h>
    #include <rdma/fi_eq.h>
    #include <rdma/fi_errno.h>
    #include <rdma/fi_cm.h>
    #include <string.h>
    #include "p2p.h"
    """, ["native/src/p2p.c"], fabric=True)

# The loops over page lists that need no fabric: linked against nothing but
# libc, so the client library checks what it sends without loading libfabric.
pages_builder = builder("p2pxfer._pages", ("pages.h",), '#include "pages.h"',
                        ["native/src/pages.c"], fabric=False)

# The C-to-C reference loops every bench ratio is measured against: none of
# the engine's code, and nothing but the bench loads them. The fabric objects
# they take are opaque pointers handed over from p2pxfer._fabric.
cref_builder = builder("p2pxfer.bench._cref", ("reference.h",), '#include "baseline.h"',
                       ["native/src/baseline.c"], fabric=True)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
