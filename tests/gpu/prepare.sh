#!/bin/bash
# Prepares .dev/ (ignored by git) for tests/gpu/on_device.sh: Debian 12's
# libfabric and the shared libraries it needs as .debs, and the Python
# wheels an accelerator machine's image lacks (cp312), for a machine that
# reaches no package registry. Run here, from the repository root, on a
# Debian 12 machine that reaches apt and PyPI (after deploy/setup.sh, which
# builds the extensions that travel with the working tree).
set -euo pipefail
mkdir -p .dev/debs .dev/whl
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
(cd .dev/debs && apt-get download libfabric1 libfabric-bin libibverbs1 librdmacm1 \
    ibverbs-providers libpsm2-2 libpsm-infinipath1 libnl-3-200 libnl-route-3-200 libnuma1 \
    libatomic1 libuuid1)
py=.venv/bin/python
version() { "$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
for name in cffi pycparser trio outcome sniffio structlog pytest-trio cryptography; do
    v=$(version "$name")
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .dev/whl "$name${v:+==$v}"
done
du -sh .dev
