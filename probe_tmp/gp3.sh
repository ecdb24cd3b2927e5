source benchmarks/gpu_env.sh $OUT > /dev/null 2>&1
COMMON=(--dtype bfloat16 --no-disk-cache --max-num-requests 336 --long-prefill-token-threshold 512 --handoff-nccl tcp://127.0.0.1:29511)
$KV serve random:llama3-8b --device cuda:0 --role prefill --port 8100 "${COMMON[@]}" > $OUT/prefill.log 2>&1 &
$KV serve random:llama3-8b --device cuda:1 --role decode --port 8200 "${COMMON[@]}" > $OUT/decode.log 2>&1 &
for i in $(seq 1 120); do
  curl -sf http://127.0.0.1:8100/health > /dev/null && curl -sf http://127.0.0.1:8200/health > /dev/null && break
  sleep 1
done
echo "healthy after $i s"
timeout -s ABRT 300 $KV bench disagg --model random:llama3-8b --prefill-url http://127.0.0.1:8100 --decode-url http://127.0.0.1:8200 --modes disaggregated --rates 32,48 --num-requests 80 --long-tokens 8192 --short-tokens 512 --long-fraction 0.08 --max-tokens 32 --json > $OUT/gp.json 2> $OUT/gp.log
echo rc=$?
curl -s http://127.0.0.1:8100/metrics | grep -i "handoff\|fallback" | grep -v "^#" | head -30 > $OUT/prefill_metrics.txt
curl -s http://127.0.0.1:8200/metrics | grep -i "handoff" | grep -v "^#" | head -30 > $OUT/decode_metrics.txt
kill %1 %2; sleep 2
grep -i -E "warn|error|expired|out of step|timeout|fail" $OUT/prefill.log | head -20
echo ---
grep -i -E "warn|error|expired|out of step|timeout|fail" $OUT/decode.log | head -20
cat $OUT/prefill_metrics.txt | head -20
