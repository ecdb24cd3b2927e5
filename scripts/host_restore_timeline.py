"""The GPU timeline of host-tier restores in `kvtier bench longctx`: when each step's work
and each host -> GPU copy job ran on the device, per round-two request.

Wraps `ModelRunner.execute` (CUDA events before and after each step's work) and
`TransferEngine._launch_cuda` (the copy job's own start and end events), runs `bench
longctx` with the arguments given after `--`, then prints, for every step from the first
host -> GPU copy of a request to its first token, the step's and the copies' spans in ms
from that first copy's start.

    python3 scripts/host_restore_timeline.py -- --model random:llama3-8b --device cuda \
        --dtype bfloat16 --num-docs 4 --doc-tokens 32768 --strategies recompute,host
"""

from __future__ import annotations

import sys

import torch
from kvtier.cli.main import app
from kvtier.engine import model_runner

from kvtier import transfer
from kvtier.stats import Direction

EVENTS: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []


def main() -> None:
    execute = model_runner.ModelRunner.execute
    launch = transfer.TransferEngine._launch_cuda

    def timed_execute(self, scheduled, while_waiting=None):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return execute(self, scheduled, while_waiting)
        finally:
            end.record()
            tokens = sum(s.num_new_tokens for s in scheduled)
            EVENTS.append((f"step {len(scheduled)} req / {tokens} tok", start, end))

    def timed_launch(self, job_id, job):
        launch(self, job_id, job)
        cuda_job = self._cuda_jobs.get(job_id)
        if cuda_job is not None and job.direction is Direction.HOST_TO_GPU:
            EVENTS.append((f"copy {job.num_bytes >> 20} MiB", cuda_job.start, cuda_job.done))

    model_runner.ModelRunner.execute = timed_execute
    transfer.TransferEngine._launch_cuda = timed_launch
    args = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    sys.argv = ["kvtier", "bench", "longctx", *args]
    try:
        app()
    except SystemExit:
        pass
    torch.cuda.synchronize()
    # A request's restore begins at the first copy after a decode step and ends at the
    # next decode step.
    spans, origin, groups = [], None, []
    for label, start, end in EVENTS:
        if label.startswith("copy") and origin is None:
            origin = start
            groups.append(spans := [])
        if origin is not None:
            spans.append((label, origin.elapsed_time(start), origin.elapsed_time(end)))
        if label.startswith("step") and label.endswith("/ 1 tok") and origin is not None:
            origin = None  # a decode step: this request's first token is out
    for index, group in enumerate(groups):
        print(f"restore {index}:", file=sys.stderr)
        for label, begin, finish in group:
            print(f"  {label:28s} {begin:8.1f} .. {finish:8.1f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
