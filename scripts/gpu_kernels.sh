#!/usr/bin/env bash
# GPU correctness tests and both kernel benchmarks, for the GPU machine.
#   bash scripts/gpu_kernels.sh [OUT_DIR]     (default: $OUT, else ./out)
# Each stage has its own time limit and log, so one failing stage still leaves the others'
# results. Set SWEEP=1 to also time alternative attention tilings.
set -u
STAGES=""  # every stage runs
source "$(dirname "$0")/gpu_env.sh" "$@"
# pytest is pure Python; use a carried copy when the machine has none.
if ! $PY -c "import pytest" 2>/dev/null && [ -d .whl/pylib ]; then
    export PYTHONPATH="$PWD/.whl/pylib${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    $PY -c "from kvtier.kernels._memcpy_batch import memcpy_batch; import torch; torch.zeros(1, device='cuda'); b = memcpy_batch(); print('cudaMemcpyBatchAsync runtime:', b and b.runtime_version)"
} 2>&1 | tee "$OUT_DIR/env.log"

echo "== GPU tests" | tee "$OUT_DIR/gpu_tests.log"
# Only this package's conftest-free tests: other packages' fixtures may need what this
# machine lacks (lmdb).
timeout "${TEST_TIMEOUT:-140}" $PY -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
    -m gpu -rs tests/kernels \
    --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee -a "$OUT_DIR/gpu_tests.log"

echo "== swap benchmark" | tee "$OUT_DIR/bench_swap.log"
timeout "${SWAP_BENCH_TIMEOUT:-150}" $PY -m kvtier.cli.main bench swap --json \
    > "$OUT_DIR/bench_swap.json" 2>>"$OUT_DIR/bench_swap.log"; echo "rc=$?" >> "$OUT_DIR/bench_swap.log"

echo "== kernel benchmarks" | tee "$OUT_DIR/bench_kernels.log"
SWEEP_FLAG=""
if [ "${SWEEP:-0}" != "0" ]; then SWEEP_FLAG="--sweep"; fi
timeout "${KERNEL_BENCH_TIMEOUT:-140}" $PY -m kvtier.cli.main bench kernels --json $SWEEP_FLAG \
    > "$OUT_DIR/bench_kernels.json" 2>> "$OUT_DIR/bench_kernels.log"
tail -c 3000 "$OUT_DIR/bench_kernels.json"
