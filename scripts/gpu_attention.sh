#!/usr/bin/env bash
# Attention on the lent GPU: GPU tests, the kernel table, warm-up on a cold and a warm Triton
# cache with first-request TTFTs, and the engine's 32K-token TTFT against transformers.
#   bash scripts/gpu_attention.sh [OUT_DIR]      (default: $OUT, else ./out)
# STAGES picks stages (default: all): tests firstreq kernels longctx.
set -u
STAGES=${STAGES:-"tests firstreq kernels longctx"}
source "$(dirname "$0")/gpu_env.sh" "$@"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

if stage tests; then
    timeout "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
        tests/kernels tests/engine/test_warmup.py tests/engine/test_cuda_graphs.py \
        tests/cli/test_bench.py > "$OUT_DIR/gpu_tests.log" 2>&1
    echo "gpu tests (rc=$?): $(tail -n 1 "$OUT_DIR/gpu_tests.log")" | tee -a "$SUMMARY"
    grep -E "^(FAILED|ERROR)" "$OUT_DIR/gpu_tests.log" | head -n 10 | tee -a "$SUMMARY"
fi
if stage firstreq; then
    # Two fresh processes: the first compiles into an empty user Triton cache, the second
    # loads from it.
    for run in cold warm; do
        timeout 150 $PY scripts/gpu_attention.py --stages firstreq --out "$OUT_DIR/$run" \
            > "$OUT_DIR/firstreq_$run.log" 2>&1
        echo "firstreq $run (rc=$?):" | tee -a "$SUMMARY"
        sed -n '/==== summary/,$p' "$OUT_DIR/firstreq_$run.log" | tail -n +2 | tee -a "$SUMMARY"
    done
fi
if stage kernels; then
    timeout 200 $KV bench kernels --json > "$OUT_DIR/bench_kernels.json" 2> "$OUT_DIR/bench_kernels.log"
    echo "bench kernels rc=$?" | tee -a "$SUMMARY"
    $PY - "$OUT_DIR/bench_kernels.json" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
print(r["device"], "copy GB/s", round(r["copy_gbps"]), r["block_order"])
for d in r["decode"]:
    g = d["cuda_graph"]
    print(f"decode b{d['batch']} ctx{d['context']}: paged {d['paged_ms']:.4f} sdpa {d['sdpa']['default_ms']:.4f} "
          f"ratio {d['ratio_vs_sdpa_default']:.2f} (best {d['ratio_vs_sdpa_best']:.2f}) share {d['copy_share']:.2f} "
          f"graph ratio {g.get('ratio_vs_sdpa_default', 0):.2f} err {d['rel_error']:.1e} {d['config']}")
for p in r["prefill"]:
    print(f"prefill {p['chunk']}+{p['prefix']}: paged {p['paged_ms']:.3f} ({p['paged_tflops']:.0f} TFLOP/s) "
          f"flash {p['sdpa']['ms_by_backend'].get('flash')} ratio {p['ratio_vs_sdpa_flash']:.2f} "
          f"default {p['sdpa']['default_ms']:.3f} ratio {p['ratio_vs_sdpa_default']:.2f} err {p['rel_error']:.1e} {p['config']}")
for s in r["store_kv"]:
    print(f"store_kv {s['num_tokens']}: ratio {s['ratio_vs_d2d']:.2f}")
print("targets", r["targets"])
PYEOF
fi
if stage longctx; then
    timeout 200 $KV bench longctx --model random:llama3-8b --device cuda --num-docs 3 \
        --doc-tokens 32768 --max-batched-tokens 8192 --max-tokens 2 --strategies recompute \
        --compare-hf --json > "$OUT_DIR/longctx.json" 2> "$OUT_DIR/longctx.log"
    echo "longctx rc=$?" | tee -a "$SUMMARY"
    $PY - "$OUT_DIR/longctx.json" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
s = r["strategies"]["recompute"]
print("engine recompute TTFT round1", s["ttft_round1_s"], "round2", s["ttft_s"])
print("transformers", r["transformers"])
PYEOF
fi
echo "==== summary"
cat "$SUMMARY"
