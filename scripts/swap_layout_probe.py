"""How scattered are the swaps the engine itself issues? Runs `kvtier bench serve`'s
workload (one mode) and records every GPU <-> host swap the transfer engine submits: its
blocks, the DMA runs (adjacent on both sides), the host runs (adjacent host slots) and the
method `swap_blocks(method="auto")` picks for them.

    python scripts/swap_layout_probe.py --mode host_third --device cpu
    python scripts/swap_layout_probe.py --mode host_third --model random:llama3-8b \
        --device cuda --num-conversations 32 --num-rounds 4 --system-tokens 1024

Prints, per direction, the swaps, blocks per swap, blocks per DMA run (adjacent on both
sides) and per host run, the mean host run a block sits in, and the share of blocks that
"auto" would stage.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
from kvtier.cli.bench.serve import EXTRA_MODES, MODES, ServeConfig, run_serve_bench
from kvtier.kernels._swap_plan import coalesce, run_starts
from kvtier.kernels.swap_blocks import choose_method

from kvtier import transfer
from kvtier.stats import Direction


def _block_weighted_mean_run(ids: np.ndarray) -> float:
    """Mean length of the run a block sits in ([n] ids, sorted)."""
    starts = run_starts(ids)
    lengths = np.diff(np.concatenate((starts, [ids.shape[0]])))
    return float((lengths * lengths).sum() / lengths.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="host_third", choices=MODES + EXTRA_MODES)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-rounds", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    records: dict[Direction, list[dict]] = defaultdict(list)
    submit = transfer.TransferEngine.submit

    def recording_submit(self, job):  # noqa: ANN001, ANN202 - a probe's wrapper
        if isinstance(job, transfer.SwapJob):
            mapping = job.block_mapping.numpy()
            src, dst = mapping[:, 0].astype(np.int64), mapping[:, 1].astype(np.int64)
            host = dst if job.direction == Direction.GPU_TO_HOST else src
            runs = coalesce(src, dst)
            block_bytes = job.src[0].numel() * job.src.element_size()
            records[job.direction].append({
                "blocks": int(mapping.shape[0]),
                "dma_runs": runs.num_runs,
                "host_runs": int(run_starts(np.sort(host)).shape[0]),
                "mean_host_run": _block_weighted_mean_run(np.sort(host)),
                "method": choose_method(runs, host, block_bytes),
                "block_bytes": block_bytes})
        return submit(self, job)

    transfer.TransferEngine.submit = recording_submit
    config = ServeConfig(model=args.model, device=args.device, dtype=args.dtype,
                         num_conversations=args.num_conversations,
                         num_rounds=args.num_rounds, system_tokens=args.system_tokens,
                         user_tokens=args.user_tokens, max_tokens=args.max_tokens,
                         modes=(args.mode,))
    result = run_serve_bench(config)
    summary = {"mode": args.mode, "model": args.model,
               "throughput_tok_s": result["modes"][args.mode]["throughput_tok_s"],
               "tokens": result["modes"][args.mode]["tokens"]}
    for direction, rows in records.items():
        blocks = np.array([r["blocks"] for r in rows])
        total = int(blocks.sum())
        staged = sum(r["blocks"] for r in rows if r["method"] == "staged")
        summary[direction.value] = {
            "swaps": len(rows),
            "block_bytes": rows[0]["block_bytes"],
            "blocks": total,
            "blocks_per_swap_p50": float(np.median(blocks)),
            "blocks_per_swap_max": int(blocks.max()),
            "blocks_per_dma_run": total / sum(r["dma_runs"] for r in rows),
            "blocks_per_host_run": total / sum(r["host_runs"] for r in rows),
            "block_weighted_host_run": sum(r["mean_host_run"] * r["blocks"]
                                           for r in rows) / total,
            "share_staged": staged / total,
        }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
