#!/usr/bin/env bash
# Prefill/decode disaggregation on a 2-GPU machine: kvtier bench disagg, 8B-shaped, bf16.
#   bash benchmarks/gpu_disagg.sh [OUT_DIR]       (default: $OUT, else ./out)
# STAGES picks stages (default: goodput ttft32k; burst runs only when named):
#   goodput  colocated (one instance of role both per GPU) against disaggregated (prefill on
#            cuda:0, decode on cuda:1) over a Poisson sweep of RATES (default 1,2,4,6,8,12)
#            with NUM_REQUESTS (default 48) per rate; the mix: LONG_FRACTION (default 0.25)
#            of LONG_TOKENS-token prompts (default 4096), the rest SHORT_TOKENS (256),
#            MAX_TOKENS (64) generated each; LONG_PREFILL_TOKEN_THRESHOLD, when set, is passed
#            to every instance (--long-prefill-token-threshold); PREFILL_QUEUE_LIMIT, when
#            set, to the disaggregated router (--prefill-queue-limit)
#   ttft32k  what handing over a 32K prompt's KV adds to its TTFT: four 32K prompts one at
#            a time (--rates 0: no queueing), each mode
#   burst    the disaggregated pair past what its prefill GPU serves: BURST_RATES (default
#            32,48) of 8K and 512-token prompts (8% long, the cap at 512 tokens), 80 each;
#            reports fallbacks by reason and whether the NCCL pair formed again, and keeps
#            the instances' logs in OUT_DIR/burst-logs
# TRANSPORT (default: the instances' best) is passed as --transport. SMOKE=1 shrinks every
# size (random:llama3-1b, short prompts). The serving stack (fastapi, uvicorn, httpx,
# prometheus_client) must be importable there: carry its wheels in .whl/ if it is not.
set -u
STAGES=${STAGES:-"goodput ttft32k"}
SMOKE=${SMOKE:-0}
source "$(dirname "$0")/gpu_env.sh" "$@"

MODEL="--model random:llama3-8b"; [ "$SMOKE" = 1 ] && MODEL="--model random:llama3-1b"
COMMON="$MODEL --dtype bfloat16 --prefill-device cuda:0 --decode-device cuda:1"
[ -n "${TRANSPORT:-}" ] && COMMON="$COMMON --transport $TRANSPORT"
env_report 2>&1 | tee "$OUT_DIR/env.log"
if stage goodput; then
    if [ "$SMOKE" = 1 ]; then ARGS="--rates 2,8 --num-requests 8 --long-tokens 1024"
    else ARGS="--rates ${RATES:-1,2,4,6,8,12} --num-requests ${NUM_REQUESTS:-48} --long-tokens ${LONG_TOKENS:-4096}"; fi
    [ -n "${LONG_PREFILL_TOKEN_THRESHOLD:-}" ] && \
        ARGS="$ARGS --serve-arg=--long-prefill-token-threshold=$LONG_PREFILL_TOKEN_THRESHOLD"
    [ -n "${PREFILL_QUEUE_LIMIT:-}" ] && ARGS="$ARGS --prefill-queue-limit $PREFILL_QUEUE_LIMIT"
    limit "${GOODPUT_TIMEOUT:-590}" $KV bench disagg $COMMON $ARGS \
        --short-tokens "${SHORT_TOKENS:-256}" --long-fraction "${LONG_FRACTION:-0.25}" \
        --max-tokens "${MAX_TOKENS:-64}" --json > "$OUT_DIR/disagg.json" \
        2> "$OUT_DIR/disagg.log"
fi
if stage ttft32k; then
    TOKENS=32768; [ "$SMOKE" = 1 ] && TOKENS=4096
    limit "${TTFT32K_TIMEOUT:-590}" $KV bench disagg $COMMON --rates 0 --num-requests 4 \
        --long-tokens $TOKENS --long-fraction 1 --max-tokens 8 \
        --serve-arg=--max-model-len=40960 --serve-arg=--max-num-batched-tokens=8192 \
        --json > "$OUT_DIR/disagg_ttft32k.json" 2> "$OUT_DIR/disagg_ttft32k.log"
fi
if stage burst; then
    ARGS="--rates ${BURST_RATES:-32,48} --num-requests 80 --long-tokens 8192 --short-tokens 512"
    [ "$SMOKE" = 1 ] && ARGS="--rates 16 --num-requests 16 --long-tokens 1024 --short-tokens 128"
    limit "${BURST_TIMEOUT:-590}" $KV bench disagg $COMMON --modes disaggregated $ARGS \
        --long-fraction 0.08 --max-tokens 32 --serve-arg=--long-prefill-token-threshold=512 \
        --logs-dir "$OUT_DIR/burst-logs" --json > "$OUT_DIR/disagg_burst.json" \
        2> "$OUT_DIR/disagg_burst.log"
fi
limit 60 $PY benchmarks/summary.py "$OUT_DIR"
