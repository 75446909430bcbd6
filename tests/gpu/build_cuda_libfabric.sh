#!/bin/bash
# Builds .dev/fabcuda for tests/gpu/on_device.sh: a libfabric built with CUDA
# (loaded with dlopen, so it builds without a GPU or a CUDA toolkit) from a
# libfabric source tree, and p2pxfer's binding built against it. Debian's
# libfabric has no CUDA, so only with this does the direct path (device
# memory registered as is, dma-buf from libfabric 1.20 on) run anywhere
# without an RDMA NIC and a site libfabric. Run here, from the repository
# root, after deploy/setup.sh:
#     bash tests/gpu/build_cuda_libfabric.sh LIBFABRIC_SOURCE_DIR
# e.g. a release tarball of https://github.com/ofiwg/libfabric unpacked, or a
# checkout (then autoconf, automake and libtool are needed for autogen.sh).
# The CUDA headers come from NVIDIA's wheels on PyPI. About 2 minutes on 2 cores.
set -euo pipefail
src=$(cd "${1:?usage: build_cuda_libfabric.sh LIBFABRIC_SOURCE_DIR}" && pwd)
root=$(pwd)
dest=$root/.dev/fabcuda
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
py=$root/.venv/bin/python
mkdir -p "$root/.dev"
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude

# cuda.h and cuda_runtime.h (runtime wheel), crt/ (nvcc wheel), nvml.h.
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$work/whl" \
    nvidia-cuda-runtime-cu12==12.9.79 nvidia-nvml-dev-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86
mkdir -p "$work/cuda/include"
for w in "$work"/whl/*.whl; do
    (cd "$work" && python3 -m zipfile -e "$w" unz)
done
for d in cuda_runtime nvml_dev cuda_nvcc; do
    cp -rn "$work/unz/nvidia/$d/include/." "$work/cuda/include/"
done

cp -r "$src" "$work/src"
cd "$work/src"
[[ -x configure ]] || ./autogen.sh
# The logs stay (under .dev/) where a step fails.
./configure --prefix="$dest" --enable-only --enable-shm=yes --enable-tcp=yes --enable-rxm=yes \
    --with-cuda="$work/cuda" --enable-cuda-dlopen --disable-static \
    > "$root/.dev/fabcuda-configure.log" 2>&1
make -j"$(nproc)" > "$root/.dev/fabcuda-make.log" 2>&1
rm -rf "$dest"
make install > /dev/null
rm -rf "$dest/lib/libfabric.la" "$dest/share"

# The binding against this libfabric's headers (abi3: it loads in 3.12 too).
cd "$root"
mkdir -p "$work/bind" && cp -r native "$work/bind/"
(cd "$work/bind" && PKG_CONFIG_PATH="$dest/lib/pkgconfig" "$py" -c "
import sys; sys.path.insert(0, 'native')
import build_fabric
print(build_fabric.ffibuilder.compile(tmpdir='.'))")
cp "$work"/bind/p2pxfer/_fabric.*.so "$dest/_fabric.abi3.so"
rm -rf "$dest/lib/pkgconfig" "$dest/include"
echo "built $dest: $("$dest/bin/fi_info" --version | tr '\n' ' ')"
