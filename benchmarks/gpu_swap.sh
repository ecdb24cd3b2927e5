#!/usr/bin/env bash
# GPU tests of the block swaps and the full `kvtier bench swap` sweeps, for the GPU machine.
#   bash benchmarks/gpu_swap.sh [OUT_DIR]      (default: $OUT, else ./out)
# Stages (STAGES, default all): tests scattered hostruns contiguous. Each stage has its own
# time limit; tables are printed last from the JSON files.
set -u
STAGES=${STAGES:-"tests scattered hostruns contiguous"}
source "$(dirname "$0")/gpu_env.sh" "$@"

env_report 2>&1 | tee "$OUT_DIR/env.log"
if stage tests; then
    echo "== GPU tests" | tee "$OUT_DIR/gpu_tests.log"
    limit "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rfs \
        tests/kernels/test_kernel_block_copies.py tests/kvtier/test_transfer.py \
        tests/kvtier/test_transfer_faults.py tests/cli/test_bench.py \
        -k "swap or transfer or copy or Transfer" 2>&1 | tail -n 40 | tee -a "$OUT_DIR/gpu_tests.log"
fi
if stage scattered; then
    limit 150 $KV bench swap --total-mib "${TOTAL_MIB:-512}" --scattered \
        --methods "${SCATTERED_METHODS:-auto,dma,staged,triton}" --json \
        > "$OUT_DIR/swap_scattered.json" 2>> "$OUT_DIR/sweeps.log"
fi
if stage hostruns; then
    limit 120 $KV bench swap --total-mib "${TOTAL_MIB:-512}" --scattered --host-run-blocks 16 \
        --methods "${HOSTRUNS_METHODS:-auto,dma,staged}" --json \
        > "$OUT_DIR/swap_hostruns.json" 2>> "$OUT_DIR/sweeps.log"
fi
if stage contiguous; then
    limit 100 $KV bench swap --total-mib "${TOTAL_MIB:-512}" --contiguous --methods auto,dma \
        --json > "$OUT_DIR/swap_contiguous.json" 2>> "$OUT_DIR/sweeps.log"
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
