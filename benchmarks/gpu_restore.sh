#!/usr/bin/env bash
# Restore figures on a GPU machine: cold reads of 2 MiB disk-tier values by each method,
# `bench longctx` swept cold (1K, 8K, 32K tokens) and warm at 32K, and `bench serve` under
# memory pressure (host_third: host_disk's host tier without the disk), three runs of each
# mode. JSON and logs go to OUT_DIR; tables are printed last.
#   bash benchmarks/gpu_restore.sh [OUT_DIR]      (default: $OUT, else ./out)
# STAGES picks stages (default: all): diskread longctx_cold longctx_warm serve. Together they
# take longer than one 10-minute device call: split them, e.g. STAGES=longctx_cold, then
# STAGES=serve, then the rest.
set -u
STAGES=${STAGES:-"diskread longctx_cold longctx_warm serve"}
source "$(dirname "$0")/gpu_env.sh" "$@"
MODEL=(--model random:llama3-8b --device cuda --dtype bfloat16)
LONG=(--num-docs 3 --max-batched-tokens 8192 --disk-dir /tmp --json)

env_report 2>&1 | tee "$OUT_DIR/env.log"
if stage diskread; then
    limit 50 $KV bench diskread --gib 2 --dir /tmp --threads 1,4,16 --json \
        > "$OUT_DIR/diskread.json" 2> "$OUT_DIR/diskread.log"
fi
if stage longctx_cold; then
    limit 420 $KV bench longctx "${MODEL[@]}" "${LONG[@]}" --doc-tokens 1024,8192,32768 --cold \
        > "$OUT_DIR/longctx_cold.json" 2> "$OUT_DIR/longctx_cold.log"
fi
if stage longctx_warm; then
    limit 200 $KV bench longctx "${MODEL[@]}" "${LONG[@]}" --doc-tokens 32768 \
        --strategies recompute,disk > "$OUT_DIR/longctx_warm.json" 2> "$OUT_DIR/longctx_warm.log"
fi
if stage serve; then
    limit 540 $KV bench serve "${MODEL[@]}" --num-conversations 16 --num-rounds 3 \
        --system-tokens 512 --user-tokens 512 --modes off,host,host_third,host_disk --runs 3 \
        --json > "$OUT_DIR/serve.json" 2> "$OUT_DIR/serve.log"
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
