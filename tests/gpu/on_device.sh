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
timeout 300 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" || rc=1
timeout 240 python3 -m p2pxfer bench --device cuda --provider shm --provider 'tcp;ofi_rxm' \
    --iterations 5 --json "$out/gpu_bench.json" 2>&1 | tee "$out/bench.log" || rc=1
exit $rc
