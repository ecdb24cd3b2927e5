#!/usr/bin/env bash
# Every GPU test and the tier/engine benchmarks, for the lent GPU machine.
#   bash benchmarks/gpu_suite.sh [OUT_DIR]        (default: $OUT, else ./out)
# STAGES picks stages (default: all): tests roundtrip swap longctx serve.
# SMOKE=1 shrinks every size (a quick check that each stage runs).
# lmdb is not installed there: carry its wheel in .whl/ (benchmarks/README.md).
set -u
STAGES=${STAGES:-"tests roundtrip swap longctx serve"}
SMOKE=${SMOKE:-0}
source "$(dirname "$0")/gpu_env.sh" "$@"

env_report 2>&1 | tee "$OUT_DIR/env.log"
if stage tests; then
    echo "== GPU tests" | tee "$OUT_DIR/gpu_tests.log"
    limit "${TEST_TIMEOUT:-420}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
        --continue-on-collection-errors tests 2>&1 | tail -n 60 | tee -a "$OUT_DIR/gpu_tests.log"
fi
if stage roundtrip; then
    MIB=1024; [ "$SMOKE" = 1 ] && MIB=64
    limit 150 $KV bench roundtrip --total-mib $MIB --json > "$OUT_DIR/roundtrip.json" \
        2> "$OUT_DIR/roundtrip.log"
fi
if stage swap; then
    limit 150 $KV bench swap --json > "$OUT_DIR/swap.json" 2> "$OUT_DIR/swap.log"
fi
if stage longctx; then
    if [ "$SMOKE" = 1 ]; then ARGS="--model random:llama3-1b --num-docs 2 --doc-tokens 4096"
    else ARGS="--model random:llama3-8b --num-docs 3 --doc-tokens 32768 --max-batched-tokens 8192"; fi
    limit "${LONGCTX_TIMEOUT:-300}" $KV bench longctx $ARGS --device cuda --max-tokens 2 \
        --plot "$OUT_DIR/longctx.png" --json > "$OUT_DIR/longctx.json" 2> "$OUT_DIR/longctx.log"
fi
if stage serve; then
    if [ "$SMOKE" = 1 ]; then ARGS="--model random:llama3-1b --hf-batch 8 --num-conversations 4"
    else ARGS="--model random:llama3-8b --hf-batch 64 --hf-prompt-tokens 512 --hf-new-tokens 64 --num-conversations 16 --num-rounds 3 --system-tokens 512 --user-tokens 512"; fi
    limit "${SERVE_TIMEOUT:-300}" $KV bench serve $ARGS --device cuda --compare-hf --json \
        > "$OUT_DIR/serve.json" 2> "$OUT_DIR/serve.log"
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
