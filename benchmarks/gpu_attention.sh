#!/usr/bin/env bash
# Attention on the lent GPU: the GPU tests of the kernels, warm-up and CUDA graphs, the
# kernel table, and the engine's 32K-token TTFT against transformers' forward.
#   bash benchmarks/gpu_attention.sh [OUT_DIR]      (default: $OUT, else ./out)
# STAGES picks stages (default: all): tests kernels longctx.
set -u
STAGES=${STAGES:-"tests kernels longctx"}
source "$(dirname "$0")/gpu_env.sh" "$@"

env_report 2>&1 | tee "$OUT_DIR/env.log"
if stage tests; then
    limit "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
        tests/kernels tests/engine/test_warmup.py tests/engine/test_cuda_graphs.py \
        tests/cli/test_bench.py > "$OUT_DIR/gpu_tests.log" 2>&1
    tail -n 1 "$OUT_DIR/gpu_tests.log"
fi
if stage kernels; then
    limit 200 $KV bench kernels --json > "$OUT_DIR/kernels.json" 2> "$OUT_DIR/kernels.log"
fi
if stage longctx; then
    limit 200 $KV bench longctx --model random:llama3-8b --device cuda --num-docs 3 \
        --doc-tokens 32768 --max-batched-tokens 8192 --max-tokens 2 --strategies recompute \
        --compare-hf --json > "$OUT_DIR/longctx.json" 2> "$OUT_DIR/longctx.log"
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
