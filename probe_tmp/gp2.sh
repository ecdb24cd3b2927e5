source benchmarks/gpu_env.sh $OUT > /dev/null 2>&1
timeout -s ABRT 500 $KV bench disagg --model random:llama3-8b --dtype bfloat16 --prefill-device cuda:0 --decode-device cuda:1 --rates 32,48 --num-requests 80 --long-tokens 8192 --short-tokens 512 --long-fraction 0.08 --max-tokens 32 --serve-arg=--long-prefill-token-threshold=512 --json > $OUT/gp.json 2> $OUT/gp.log
echo rc=$?
$PY - $OUT/gp.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for mode, rep in r["modes"].items():
    for run in rep["rates"]:
        t, p = run["ttft_s"], run.get("tpot_s") or {}
        sh, lo = run.get("ttft_short_s") or {}, run.get("ttft_long_s") or {}
        print(mode, run["rate_rps"], "n_long", (lo or {}).get("n", 0), "TTFT p50/p90/p99 %.0f/%.0f/%.0f" % (t["p50"]*1e3, t["p90"]*1e3, t["p99"]*1e3),
              "short %.0f/%.0f" % (sh.get("p50", 0)*1e3, sh.get("p90", 0)*1e3), "long p50 %.0f" % ((lo or {}).get("p50", 0)*1e3),
              "TPOT p50/p90 %.1f/%.1f" % (p.get("p50", 0)*1e3, p.get("p90", 0)*1e3), "met", run["slo_met"], "within %d/%d" % (run["within_slo"], run["num_requests"]), "thr %.1f" % run["throughput_rps"])
    print(mode, "goodput", rep["goodput_rps"])
print("ratio", r["goodput_ratio"])
PY
