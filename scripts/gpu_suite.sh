#!/usr/bin/env bash
# Every GPU test and the tier/engine benchmarks, for the lent GPU machine.
#   bash scripts/gpu_suite.sh [OUT_DIR]        (default: $OUT, else ./out)
# STAGES picks stages (default: all): tests roundtrip swap longctx serve.
# SMOKE=1 shrinks every size (a quick check that each stage runs).
# lmdb is not installed there: carry its wheel in .whl/ (see docs/BENCHMARKS.md).
set -u
STAGES=${STAGES:-"tests roundtrip swap longctx serve"}
SMOKE=${SMOKE:-0}
source "$(dirname "$0")/gpu_env.sh" "$@"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT_DIR/env.log"
$PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT_DIR/env.log"


if stage tests; then
    echo "== GPU tests" | tee "$OUT_DIR/gpu_tests.log"
    timeout "${TEST_TIMEOUT:-420}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
        --continue-on-collection-errors \
        tests 2>&1 | tail -n 60 | tee -a "$OUT_DIR/gpu_tests.log"
fi
if stage roundtrip; then
    MIB=1024; [ "$SMOKE" = 1 ] && MIB=64
    echo "== roundtrip" | tee "$OUT_DIR/roundtrip.log"
    timeout 150 $PY -m kvtier.cli.bench.roundtrip --total-mib $MIB --json > "$OUT_DIR/roundtrip.json" \
        2>>"$OUT_DIR/roundtrip.log"; tail -c 1500 "$OUT_DIR/roundtrip.json"
fi
if stage swap; then
    echo "== swap" | tee "$OUT_DIR/swap.log"
    timeout 150 $KV bench swap --json > "$OUT_DIR/swap.json" 2>>"$OUT_DIR/swap.log"; tail -c 1500 "$OUT_DIR/swap.json"
fi
if stage longctx; then
    if [ "$SMOKE" = 1 ]; then ARGS="--model random:llama3-1b --num-docs 2 --doc-tokens 4096"
    else ARGS="--model random:llama3-8b --num-docs 3 --doc-tokens 32768 --max-batched-tokens 8192"; fi
    echo "== longctx $ARGS" | tee "$OUT_DIR/longctx.log"
    timeout "${LONGCTX_TIMEOUT:-300}" $KV bench longctx $ARGS --device cuda --max-tokens 2 \
        --plot "$OUT_DIR/longctx.png" --json > "$OUT_DIR/longctx.json" 2>>"$OUT_DIR/longctx.log"
    echo "rc=$?" >> "$OUT_DIR/longctx.log"; tail -n 5 "$OUT_DIR/longctx.log"
    $PY - "$OUT_DIR/longctx.json" <<'PYEOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print("longctx: no JSON:", exc); raise SystemExit
print("longctx headline:", json.dumps(r.get("headline")), "identical:", r.get("outputs_identical"))
for name, s in r.get("strategies", {}).items():
    print(f"  {name}: ttft p50 {s['ttft_s']['p50']:.4f}s speedup {s.get('speedup_vs_recompute', 0):.2f}x")
PYEOF
fi
if stage serve; then
    if [ "$SMOKE" = 1 ]; then ARGS="--model random:llama3-1b --hf-batch 8 --num-conversations 4"
    else ARGS="--model random:llama3-8b --hf-batch 64 --hf-prompt-tokens 512 --hf-new-tokens 64 --num-conversations 16 --num-rounds 3 --system-tokens 512 --user-tokens 512"; fi
    echo "== serve $ARGS" | tee "$OUT_DIR/serve.log"
    timeout "${SERVE_TIMEOUT:-300}" $KV bench serve $ARGS --device cuda --compare-hf --json \
        > "$OUT_DIR/serve.json" 2>>"$OUT_DIR/serve.log"
    echo "rc=$?" >> "$OUT_DIR/serve.log"; tail -n 5 "$OUT_DIR/serve.log"; tail -c 2500 "$OUT_DIR/serve.json"
fi
