#!/usr/bin/env bash
# GPU tests of the block swaps and the full `kvtier bench swap` sweep, for the GPU machine.
#   bash scripts/gpu_swap.sh [OUT_DIR]      (default: $OUT, else ./out)
# Stages (STAGES, default all): profile scattered hostruns contiguous streams tests, in that
# order (the sweeps first, so their figures survive a short time limit). Each stage has its
# own time limit; tables are printed last from the JSON files.
set -u
STAGES=${STAGES:-"tests profile scattered hostruns contiguous streams"}
source "$(dirname "$0")/gpu_env.sh" "$@"

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT_DIR/env.log"

if stage profile; then
    echo "== host time per call (cProfile)" | tee "$OUT_DIR/profile.log"
    timeout 60 $PY scripts/swap_profile.py >> "$OUT_DIR/profile.log" 2>&1
    grep "^==" "$OUT_DIR/profile.log"
fi
if stage scattered; then
    echo "== bench swap --scattered" | tee -a "$OUT_DIR/sweeps.log"
    timeout 150 $KV bench swap --total-mib "${TOTAL_MIB:-512}" --scattered --methods "${SCATTERED_METHODS:-auto,dma,staged,triton}" --json > "$OUT_DIR/swap_scattered.json" \
        2>>"$OUT_DIR/sweeps.log"; echo "rc=$?" | tee -a "$OUT_DIR/sweeps.log"
fi
if stage hostruns; then
    echo "== bench swap --scattered --host-run-blocks 16" | tee -a "$OUT_DIR/sweeps.log"
    timeout 120 $KV bench swap --total-mib "${TOTAL_MIB:-512}" --scattered --host-run-blocks 16 --methods "${HOSTRUNS_METHODS:-auto,dma,staged}" \
        --json > "$OUT_DIR/swap_hostruns.json" 2>>"$OUT_DIR/sweeps.log"
    echo "rc=$?" | tee -a "$OUT_DIR/sweeps.log"
fi
if stage contiguous; then
    echo "== bench swap --contiguous" | tee -a "$OUT_DIR/sweeps.log"
    timeout 100 $KV bench swap --total-mib "${TOTAL_MIB:-512}" --contiguous --methods auto,dma --json \
        > "$OUT_DIR/swap_contiguous.json" 2>>"$OUT_DIR/sweeps.log"
    echo "rc=$?" | tee -a "$OUT_DIR/sweeps.log"
fi
if stage streams; then
    # How many streams the DMA method should spread small scattered copies over.
    echo "== dma streams" | tee "$OUT_DIR/dma_streams.log"
    timeout 90 $PY - >> "$OUT_DIR/dma_streams.log" 2>&1 <<'PYEOF'
import importlib, torch
module = importlib.import_module("kvtier.kernels.swap_blocks")
from kvtier.cli.bench.swap import _time_streams, layout_rows
total = 256 << 20
gpu = torch.empty(total, dtype=torch.bfloat16, device="cuda")
host = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
out_s, in_s = torch.cuda.Stream(), torch.cuda.Stream()
for size in (32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10):
    n = total // size
    g, h = gpu.view(2 * n, size // 2), host.view(2 * n, size // 2)
    rows = {k: torch.from_numpy(v.copy()) for k, v in layout_rows(n, True, 1).items()}
    line = f"{size >> 10:>4}K"
    for streams in (2, 4, 8, 16):
        module.DMA_STREAMS = streams
        d2h = lambda: module.swap_blocks(g, h, rows["d2h"], "dma", out_s)  # noqa: E731
        h2d = lambda: module.swap_blocks(h, g, rows["h2d"], "dma", in_s)  # noqa: E731
        ms = [_time_streams(w, 5) for w in ({out_s: d2h}, {in_s: h2d}, {out_s: d2h, in_s: h2d})]
        line += f" | {streams}: {total / ms[0] / 1e6:4.1f} {total / ms[1] / 1e6:4.1f} {2 * total / ms[2] / 1e6:4.1f}"
    print(line, "GB/s d2h h2d both", flush=True)
PYEOF
    cat "$OUT_DIR/dma_streams.log"
fi

if stage tests; then
    echo "== GPU tests" | tee "$OUT_DIR/gpu_tests.log"
    timeout "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rfs \
        ${TEST_FILES:-tests/kernels/test_kernel_block_copies.py tests/kvtier/test_transfer.py \
        tests/kvtier/test_transfer_faults.py tests/cli/test_bench.py} -k "swap or transfer or copy or Transfer" 2>&1 | tail -n 40 | tee -a "$OUT_DIR/gpu_tests.log"
fi
for name in scattered hostruns contiguous; do
    [ -s "$OUT_DIR/swap_$name.json" ] || continue
    echo "== $name"
    COLUMNS=80 $PY -c "import json, sys; from kvtier.cli.bench.tables import print_swap; print_swap(json.load(open(sys.argv[1])))" "$OUT_DIR/swap_$name.json" 2>&1 
done
