#!/usr/bin/env bash
# GPU correctness tests of the kernels and both kernel benchmarks, for the GPU machine.
#   bash benchmarks/gpu_kernels.sh [OUT_DIR]     (default: $OUT, else ./out)
# Each stage has its own time limit and log, so one failing stage still leaves the others'
# results. SWEEP=1 also times alternative attention tilings.
set -u
STAGES=""  # every stage runs
source "$(dirname "$0")/gpu_env.sh" "$@"

env_report 2>&1 | tee "$OUT_DIR/env.log"
echo "== GPU tests" | tee "$OUT_DIR/gpu_tests.log"
# Only this package's conftest-free tests: other packages' fixtures may need what this
# machine lacks (lmdb).
limit "${TEST_TIMEOUT:-140}" $PY -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
    -m gpu -rs tests/kernels --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee -a "$OUT_DIR/gpu_tests.log"
limit "${SWAP_BENCH_TIMEOUT:-150}" $KV bench swap --json > "$OUT_DIR/swap.json" \
    2> "$OUT_DIR/swap.log"
SWEEP_FLAG=""
if [ "${SWEEP:-0}" != "0" ]; then SWEEP_FLAG="--sweep"; fi
limit "${KERNEL_BENCH_TIMEOUT:-140}" $KV bench kernels --json $SWEEP_FLAG \
    > "$OUT_DIR/kernels.json" 2> "$OUT_DIR/kernels.log"
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
