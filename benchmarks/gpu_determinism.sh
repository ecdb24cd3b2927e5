#!/usr/bin/env bash
# The deterministic mode on the lent GPU: its GPU tests, token and log-probability identity
# across batch sizes 1/8/64 and step budgets 2048/8192 (with each run's time in both modes),
# and 32K host and disk restores against recompute in both modes.
#   bash benchmarks/gpu_determinism.sh [OUT_DIR]      (default: $OUT, else ./out)
# STAGES picks stages (default: all): tests invariance longctx.
set -u
STAGES=${STAGES:-"tests invariance longctx"}
source "$(dirname "$0")/gpu_env.sh" "$@"

M8="--model random:llama3-8b --device cuda --dtype bfloat16"
env_report 2>&1 | tee "$OUT_DIR/env.log"
if stage tests; then
    limit "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
        tests/engine/test_deterministic.py tests/kernels/test_kernel_invariant.py \
        > "$OUT_DIR/gpu_tests.log" 2>&1
    tail -n 1 "$OUT_DIR/gpu_tests.log"
fi
if stage invariance; then
    limit 420 $KV bench invariance $M8 --num-prompts 64 --min-tokens 64 \
        --max-prompt-tokens 3072 --max-tokens 32 --shapes 1x2048,8x2048,64x2048,64x8192 \
        --json > "$OUT_DIR/invariance.json" 2> "$OUT_DIR/invariance.log"
fi
if stage longctx; then
    limit 300 $KV bench longctx $M8 --num-docs 2 --doc-tokens 32768 \
        --max-batched-tokens 8192 --max-tokens 2 --strategies recompute,host,disk --deterministic \
        --json > "$OUT_DIR/longctx.json" 2> "$OUT_DIR/longctx.log"
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
