#!/usr/bin/env bash
# Restore figures on a GPU machine: cold reads of 2 MiB disk-tier values by each method,
# `bench longctx` swept cold (1K, 8K, 32K tokens) and warm at 32K, and `bench serve` under
# memory pressure (host_third: host_disk's host tier without the disk), three runs of each
# mode. JSON and logs go to OUT_DIR; tables are printed last.
#   bash benchmarks/gpu_restore.sh [OUT_DIR]      (default: $OUT, else ./out)
# Behind a small host tier (the case a disk exists for): `small_host` serves three 32K
# documents through a 1 GB host tier + disk, then restores them in a fresh engine with the page
# cache dropped; `conversations` serves 24 conversations over 6K-token documents in lockstep
# through a 40K-token GPU pool: tiers off, a host tier holding everything, 3 GB host + disk
# (the disk tier in its worker process, and in the engine's); CONVERSATION_MODES picks the
# modes.
# `short`: prompts of 272, 1,040 and 4,112 tokens restored from the host and the disk (in its
# worker process, and in the engine's) against recompute, for the 8B and the 1B shapes (the
# "never slower than recompute" case).
# STAGES picks stages (default: all): diskread longctx_cold longctx_warm serve small_host
# conversations short. Together they
# take longer than one 10-minute device call: split them, e.g. STAGES=longctx_cold, then
# STAGES=serve, then the rest.
set -u
STAGES=${STAGES:-"diskread longctx_cold longctx_warm serve small_host conversations short"}
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
if stage small_host; then
    limit 300 $KV bench longctx "${MODEL[@]}" "${LONG[@]}" --doc-tokens 32768 --cold \
        --strategies recompute,host_small_disk --host-cache-gb 1 \
        > "$OUT_DIR/small_host.json" 2> "$OUT_DIR/small_host.log"
fi
if stage conversations; then
    limit 420 $KV bench serve "${MODEL[@]}" --num-conversations 24 --num-rounds 4 \
        --system-tokens 64 --user-tokens 200 --max-tokens 64 --doc-tokens 6000 --lockstep \
        --gpu-blocks 2500 --max-batched-tokens 4096 --host-cache-gb 3 \
        --modes "${CONVERSATION_MODES:-off,host,host_small_disk,host_small_disk_inprocess}" \
        --json > "$OUT_DIR/conversations.json" 2> "$OUT_DIR/conversations.log"
fi
if stage short; then
    for shape in llama3-8b llama3-1b; do
        limit 240 $KV bench longctx --model "random:$shape" --device cuda --dtype bfloat16 \
            --doc-tokens 256,1024,4096 --num-docs 6 --strategies recompute,host,disk,disk_inprocess \
            --disk-dir /tmp --json > "$OUT_DIR/short_$shape.json" 2> "$OUT_DIR/short_$shape.log"
    done
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
