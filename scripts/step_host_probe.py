"""Where the engine thread's time goes between GPU steps in `kvtier bench serve`, per mode.

The engine loop is synchronous: schedule, launch the step, wait for its sampled ids, update
(which also starts the write-through of the blocks the step filled). While the engine thread
schedules and updates, the GPU has nothing queued, so that host time adds to every step.
This probe wraps `Scheduler.schedule`, `ModelRunner.execute` (and the wait for the sampled
ids inside it), `Scheduler.update` and the tier manager's write-through (queueing it, and
starting the queued copies where the tree does that apart), and reports each
one's total wall time over the timed runs of each mode, against the mode's elapsed time.

    python3 scripts/step_host_probe.py --model random:llama3-8b --device cuda \
        --dtype bfloat16 --modes off,host_third,host,host_disk
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from kvtier.cli.bench.serve import ServeConfig, run_serve_bench
from kvtier.engine import model_runner, scheduler

from kvtier import manager, stores

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(owner: type, name: str, label: str) -> None:
    """Wrap `owner.name` so that its wall time adds to TOTALS[label]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - started
            COUNTS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modes", default="off,host_third,host,host_disk")
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--num-rounds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=512)
    args = parser.parse_args()
    timed(scheduler.Scheduler, "schedule", "schedule")
    timed(scheduler.Scheduler, "update", "update")
    timed(model_runner.ModelRunner, "execute", "execute")
    timed(model_runner.ModelRunner, "_read_back", "execute: wait for sampled ids")
    timed(stores.StorePath, "write_through", "update: write-through")
    timed(stores.StorePath, "progress", "progress (deferred stores, write-backs)")
    if hasattr(stores.StorePath, "submit_pending"):  # stores started while a step runs
        timed(stores.StorePath, "submit_pending", "write-through: submit queued")
    if hasattr(manager.TierManager, "wait_for_stores"):  # waits instead of preemptions
        timed(manager.TierManager, "wait_for_stores", "schedule: wait for stores (asked)")
        timed(manager.TransferEngine, "wait", "transfers: wait")
    summary = {}
    for mode in args.modes.split(","):
        config = ServeConfig(model=args.model, device=args.device, dtype=args.dtype,
                             num_conversations=args.num_conversations,
                             num_rounds=args.num_rounds, system_tokens=args.system_tokens,
                             user_tokens=args.user_tokens, modes=(mode,), runs=1)
        marks: list[tuple[dict[str, float], dict[str, int]]] = []

        def progress(message: str, marks=marks) -> None:
            if "mode" in message:  # the timed run starts (after loading and warm-up)
                marks.append((dict(TOTALS), dict(COUNTS)))

        result = run_serve_bench(config, progress)
        figures = result["modes"][mode]
        start_totals, start_counts = marks[-1] if marks else ({}, {})
        phases = {label: {"s": round(total - start_totals.get(label, 0.0), 4),
                          "calls": COUNTS[label] - start_counts.get(label, 0)}
                  for label, total in TOTALS.items()}
        summary[mode] = {"elapsed_s": round(figures["elapsed_s"], 4),
                         "throughput_tok_s": round(figures["throughput_tok_s"], 1),
                         "phases": phases}
        print(mode, json.dumps(summary[mode]), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
