#!/bin/bash
# The GPU checks, on an accelerator machine that has only this working tree
# (no package registry): see docs/gpu.md. Run from the repository root, with
# .dev/ prepared by tests/gpu/prepare.sh on a machine that has one:
#     bash tests/gpu/on_device.sh [OUT_DIR]
# Writes machine.txt, gpu_tests.log, gpu_bench.json and bench.log to OUT_DIR.
set -o pipefail
out=${1:-${OUT:-/tmp/p2pxfer-gpu}}
mkdir -p "$out"
# shellcheck source=/dev/null
source tests/gpu/boot.sh || exit 1
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    fi_info --version | head -2
} 2>&1 | tee "$out/machine.txt"
rc=0
timeout 200 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" || rc=1
timeout 120 python3 -m p2pxfer bench --device cuda --provider shm --provider 'tcp;ofi_rxm' \
    --iterations 5 --json "$out/gpu_bench.json" 2>&1 | tee "$out/bench.log" || rc=1
# Through two daemons asked for FI_HMEM: host pools, staged device pools, and
# (where the daemons' libfabric registers CUDA memory: the pass below) direct.
timeout 90 python3 bench/device_daemons.py --provider shm --rounds 3 \
    --json "$out/device_daemons.json" > "$out/device_daemons.log" 2>&1 || rc=1

# A libfabric built with CUDA, where .dev/fabcuda holds one (lib/, bin/) and
# the binding built against it (_fabric.abi3.so): the direct path (device
# memory registered as is) must then be taken on shm, and the bench adds its
# rows. Debian's libfabric has no CUDA, so without it the direct path only
# falls back.
if [[ -d .dev/fabcuda/lib ]]; then
    cudart=$(find /opt /usr/local /usr/lib -name 'libcudart.so.[0-9]*' 2>/dev/null | sort | tail -1)
    mkdir -p /tmp/cudalib && ln -sfn "$cudart" /tmp/cudalib/libcudart.so
    # Never save the CUDA build as Debian's (a run killed midway leaves it in
    # place), and put Debian's back however this ends.
    if cmp -s .dev/fabcuda/_fabric.abi3.so src/p2pxfer/_fabric.abi3.so; then
        echo "on_device.sh: src/p2pxfer/_fabric.abi3.so is the CUDA build: carry the" \
             "Debian build again" >&2
        exit 1
    fi
    cp src/p2pxfer/_fabric.abi3.so /tmp/_fabric.debian.so
    trap 'cp /tmp/_fabric.debian.so src/p2pxfer/_fabric.abi3.so' EXIT
    cp .dev/fabcuda/_fabric.abi3.so src/p2pxfer/_fabric.abi3.so
    (
        export LD_LIBRARY_PATH="$PWD/.dev/fabcuda/lib:/tmp/cudalib:$LD_LIBRARY_PATH"
        export PATH="$PWD/.dev/fabcuda/bin:$PATH" P2PXFER_EXPECT_HMEM=shm
        {
            echo "cudart: $cudart"
            fi_info --version | head -2
            FI_LOG_LEVEL=warn fi_info -p shm -c FI_HMEM 2>&1 | head -12
        } 2>&1 | tee "$out/machine-fabcuda.txt"
        # Only these (and the daemons' direct path, test_device_direct: two
        # processes): on libfabric 2.x two shm endpoints of one process move
        # every write through bounce buffers the target's progress drains (no
        # CMA between them), which the other in-process tests' napping
        # engines turn into minutes (docs/gpu.md).
        timeout 180 python3 -m pytest tests/gpu -rA -q -p no:cacheprovider \
            -k "hmem or device_to_device_in_process or test_device_direct" 2>&1 \
            | tee "$out/gpu_tests_fabcuda_full.log" | grep -E '^(PASSED|FAILED|ERROR)|passed|failed' \
            | tee "$out/gpu_tests_fabcuda.log"
        grep -q ' passed' "$out/gpu_tests_fabcuda.log" && ! grep -qE 'failed|^ERROR' "$out/gpu_tests_fabcuda.log" \
            || exit 1
        timeout 120 python3 -m p2pxfer --log-level DEBUG bench --device cuda --hmem \
            --provider shm --iterations 5 --json "$out/gpu_bench_hmem.json" \
            > "$out/bench_hmem.log" 2>&1; brc=$?
        grep -E 'device_registered|dmabuf|pool_staged|rror' "$out/bench_hmem.log" \
            | cut -c1-300 | sort | uniq -c | sort -rn | head -12
        grep -vE '\[(debug|info) ' "$out/bench_hmem.log" | tail -30
        timeout 90 python3 bench/device_daemons.py --provider shm --rounds 3 \
            --json "$out/device_daemons_hmem.json" > "$out/device_daemons_hmem.log" 2>&1 \
            || brc=1
        exit $brc
    ) || rc=1
fi
exit $rc
