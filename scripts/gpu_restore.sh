#!/usr/bin/env bash
# Restore figures on a GPU machine in one go (each stage under `timeout`): cold reads of
# 2 MiB disk-tier values by each method, disk-tier writes and reads beside a busy Python
# thread (before / now, cold where permitted: `io`, a text table), `bench longctx` swept
# cold, 32K warm, `bench serve` under memory pressure (with host_third: host_disk's host
# tier without the disk), and a
# profile of the engine thread over one cold 32K restore. JSON and logs go to $OUT; a short
# table is printed last. STAGES picks stages (default: all; together they take longer than
# one 10-minute device call, so split them, e.g. STAGES="longctx_cold", then "serve"
# (three runs of four modes), then the rest).
set -u
OUT=${OUT:-/tmp/kvtier-restore}
mkdir -p "$OUT"
MODEL=(--model random:llama3-8b --device cuda --dtype bfloat16)
LONG=(--num-docs 3 --max-batched-tokens 8192 --disk-dir /tmp --json)

STAGES=${STAGES:-"diskread io longctx_cold longctx_warm serve profile"}
stage() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0;; esac
  local started=$SECONDS
  # SIGABRT on timeout: faulthandler writes every thread's stack to the log first.
  PYTHONFAULTHANDLER=1 timeout -s ABRT "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "stage $name: rc=$? in $((SECONDS - started)) s"
}

stage diskread 50 python3 -m kvtier.cli.main bench diskread --gib 2 --dir /tmp \
  --threads 1,4,16 --json
stage io 120 python3 scripts/io_beside_busy_thread.py --blocks 256 --dir /tmp
stage longctx_cold 420 python3 -m kvtier.cli.main bench longctx "${MODEL[@]}" "${LONG[@]}" \
  --doc-tokens 1024,8192,32768 --cold
stage longctx_warm 200 python3 -m kvtier.cli.main bench longctx "${MODEL[@]}" "${LONG[@]}" \
  --doc-tokens 32768 --strategies recompute,disk
stage serve 540 python3 -m kvtier.cli.main bench serve "${MODEL[@]}" --num-conversations 16 \
  --num-rounds 3 --system-tokens 512 --user-tokens 512 --modes off,host,host_third,host_disk \
  --runs 3 --json
stage profile 150 python3 scripts/restore_profile.py --doc-tokens 32768
python3 scripts/restore_summary.py "$OUT"
