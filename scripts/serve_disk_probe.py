"""Why the disk tier serves few blocks in `kvtier bench serve`: what happens to each
restore's disk hits, from the gate to a landing.

Counts, over one timed run of a mode: the gate's answers (`Scheduler._worth_reading`), the
restores that found blocks on disk, the disk blocks left waiting for a host slot when their
load was fed, the disk read jobs (time queued before an I/O thread took them, time running,
blocks read), the groups the compute front cancelled, the compute front's holds and claims
made without a load rate, and the groups that landed per tier.

    python3 scripts/serve_disk_probe.py --model random:llama3-8b --device cuda \
        --dtype bfloat16 --num-rounds 6 --modes host_disk
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from kvtier.cli.bench.serve import ServeConfig, run_serve_bench
from kvtier.engine import restore, scheduler

from kvtier import load_path, transfer
from kvtier.stats import Direction, Tier

COUNTS: dict[str, int] = defaultdict(int)
SAMPLES: dict[str, list[float]] = defaultdict(list)


def wrap(owner: type, name: str, after) -> None:
    """Replace `owner.name` by a call that then runs `after(self, result, *args)`."""
    inner = getattr(owner, name)

    def wrapper(self, *args, **kwargs):
        result = inner(self, *args, **kwargs)
        after(self, result, *args)
        return result

    setattr(owner, name, wrapper)


def on_gate(_sched, worth, request, first_block) -> None:
    COUNTS[f"gate {'read' if worth else 'skip'}"] += 1
    SAMPLES[f"gate {'read' if worth else 'skip'}: tokens"].append(
        request.num_tokens - first_block * request.block_size)


def on_restore(rest, _result, *args) -> None:
    disk_blocks = rest.tiers.count(Tier.DISK)
    if disk_blocks:
        COUNTS["restores with disk hits"] += 1
        SAMPLES["disk hit blocks per restore"].append(disk_blocks)


def on_feed(_path, _result, load) -> None:
    if load.waiting:
        COUNTS["loads left waiting for host slots"] += 1
        SAMPLES["blocks waiting for a host slot"].append(len(load.waiting))


def on_cancel(rest, cancelled, block_index) -> None:
    COUNTS[f"cancel {'done' if cancelled else 'refused (arriving)'}"] += 1


def on_hold(rest, held, *args) -> None:
    COUNTS[f"first claim {'held' if held else 'free'}"] += 1


def on_balanced(rest, tokens, compute_block, num_tokens, prefill) -> None:
    if rest._load_rate() is None:  # noqa: SLF001 - a probe
        COUNTS["claims without a load rate"] += 1
        SAMPLES["tokens claimed without a load rate"].append(tokens)


def on_land(rest, _result, group) -> None:
    COUNTS[f"landed groups: {group.tier.value}"] += 1


def submit_timed(inner):
    def submit(self, job):
        if isinstance(job, transfer.IOJob) and job.direction is Direction.DISK_TO_HOST:
            queued = time.perf_counter()
            run = job.run

            def timed_run() -> int:
                started = time.perf_counter()
                SAMPLES["disk read: queued ms"].append((started - queued) * 1e3)
                try:
                    return run()
                finally:
                    SAMPLES["disk read: running ms"].append(
                        (time.perf_counter() - started) * 1e3)

            job = transfer.IOJob(job.direction, timed_run)
            COUNTS["disk read jobs"] += 1
        return inner(self, job)
    return submit


def summary() -> dict:
    out: dict = dict(COUNTS)
    for name, values in SAMPLES.items():
        ordered = sorted(values)
        out[name] = {"n": len(values), "p50": round(statistics.median(ordered), 2),
                     "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
                     "max": round(ordered[-1], 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modes", default="host_disk")
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--num-rounds", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    wrap(scheduler.Scheduler, "_worth_reading", on_gate)
    wrap(restore.Restore, "__init__", on_restore)
    wrap(load_path.LoadPath, "feed", on_feed)
    wrap(restore.Restore, "_cancel", on_cancel)
    wrap(restore.Restore, "holds_first_claim", on_hold)
    wrap(restore.Restore, "balanced_tokens", on_balanced)
    wrap(restore.Restore, "_land", on_land)
    transfer.TransferEngine.submit = submit_timed(transfer.TransferEngine.submit)
    for mode in args.modes.split(","):
        config = ServeConfig(model=args.model, device=args.device, dtype=args.dtype,
                             num_conversations=args.num_conversations,
                             num_rounds=args.num_rounds, system_tokens=args.system_tokens,
                             user_tokens=args.user_tokens, max_tokens=args.max_tokens,
                             modes=(mode,), runs=1)

        def progress(message: str) -> None:
            if "mode" in message:  # the timed run starts: count only it
                COUNTS.clear()
                SAMPLES.clear()

        result = run_serve_bench(config, progress)
        figures = result["modes"][mode]
        print(mode, json.dumps({"throughput_tok_s": round(figures["throughput_tok_s"], 1),
                                "tokens": figures["tokens"], **summary()}), flush=True)


if __name__ == "__main__":
    main()
