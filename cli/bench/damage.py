"""`kvtier bench damage`: damage a disk tier between engine runs; no run may crash or answer
differently.

One disk tier directory is used by `--num-runs` engines in a row, each in a process of its
own (so a crash is counted, not suffered). Each run generates a seeded subset of a fixed
set of prompts that share prefixes, one prompt at a time, on a tiny model with GPU and host
budgets of a few blocks: blocks go down to disk and come back. Between runs the soak damages
the directory's `data.mdb` while no engine has it open: a few random pages (random bytes
over a page, a short random run, one flipped bit, a random page header), and every
`--named-every` runs one of the named cases of `damage_cases.DAMAGES` in turn (a leaf,
branch or meta page, the length, the kind of data.mdb, lock.mdb).

It counts crashes (a run that died by a signal, failed or did not finish within
`--run-timeout`), wrong answers (requests whose tokens differ from a tiers-off engine's),
recoveries (the damaged directory moved aside), tokens restored from disk, and the values
the disk tier rejected. `ok` is true when nothing crashed and no answer was wrong.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from kvtier.cli.bench.damage_cases import DAMAGES, damage_random_pages
from kvtier.cli.common import print_json, print_table

MODEL = "random:tiny-llama"
NUM_PROMPTS = 24
PROMPTS_PER_RUN = 10
MAX_TOKENS = 6
# The run's engine: a few GPU blocks and host slots, so blocks live on disk between runs.
# The damage bench exercises the disk's read path: its short prompts compute sooner than
# reading could save, so the disk is always asked (restore_min_saving_s 0).
ENGINE = {"gpu_blocks": 24, "host_cache_gb": 8 * 8192 / 2**30, "disk_cache_gb": 0.01,
          "max_num_batched_tokens": 64, "restore_min_saving_s": 0.0}

_CHILD = """
import json, sys
import torch
from kvtier.engine import LLM, SamplingParams
torch.set_num_threads(1)
spec = json.loads(sys.stdin.read())
params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
with LLM(spec["model"], device="cpu", disk_cache_dir=spec["disk_dir"], **spec["engine"]) as llm:
    recovery = llm.manager.disk_recovery
    outputs = [llm.generate([prompt], params)[0] for prompt in spec["prompts"]]
    stats = llm.stats()
print(json.dumps({
    "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    "disk_tokens": sum(o.metrics.cached_tokens_disk for o in outputs),
    "rejected": 0 if stats.disk is None else stats.disk.rejected,
    "recovery": None if recovery is None else {"moved_to": str(recovery.moved_to),
                                               "disk_off": recovery.disk_off,
                                               "message": recovery.message}}))
"""


def make_prompts(seed: int, vocab_size: int = 256) -> list[list[int]]:
    """NUM_PROMPTS token-id prompts of 40 to 150 tokens; groups of three share a prefix of
    32 tokens. No token 2 (the tiny models' end of sequence)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(32)]
                for _ in range(NUM_PROMPTS // 3)]
    return [prefixes[i // 3] + [rng.randrange(3, vocab_size)
                                for _ in range(rng.randrange(8, 118))]
            for i in range(NUM_PROMPTS)]


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    from kvtier.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(MODEL, device="cpu", gpu_blocks=512, host_cache=False, disk_cache=False) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _run_engine(disk_dir: Path, prompts: list[list[int]], timeout_s: float
                ) -> tuple[dict | None, str]:
    """One engine run in a child process: its JSON report, or None and why it failed."""
    spec = {"model": MODEL, "disk_dir": str(disk_dir), "engine": ENGINE, "prompts": prompts,
            "max_tokens": MAX_TOKENS}
    try:
        result = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(spec),
                                capture_output=True, text=True, timeout=timeout_s,
                                check=False)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:.0f} s"
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        return None, f"exit status {result.returncode}: {tail[0][:300]}"
    return json.loads(result.stdout.strip().splitlines()[-1]), ""


def run_damage_soak(num_runs: int = 50, seed: int = 0, pages_per_run: int = 3,
                    named_every: int = 5, run_timeout_s: float = 300.0,
                    disk_dir: Path | None = None, progress=None) -> dict[str, Any]:
    """The soak (see the module docstring); a JSON-ready dict. Raises ValueError for a bad
    count."""
    if num_runs < 1 or pages_per_run < 0 or named_every < 0 or run_timeout_s <= 0:
        raise ValueError("--num-runs must be positive, --pages-per-run and --named-every "
                         ">= 0 (0: never), --run-timeout positive")
    rng = random.Random(seed)
    prompts = make_prompts(seed)
    expected = _reference(prompts)
    own_dir = disk_dir is None
    root = Path(tempfile.mkdtemp(prefix="kvtier-damage-")) if own_dir else disk_dir.parent
    directory = root / "kv" if own_dir else disk_dir
    names = list(DAMAGES)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        for index in range(num_runs):
            damage: list[str] = []
            if index > 0 and (directory / "data.mdb").is_file():
                named = names[(index // named_every - 1) % len(names)] \
                    if named_every and index % named_every == 0 else None
                try:
                    if named is not None:
                        damage.append(f"{named}: {DAMAGES[named](directory, rng)}")
                except LookupError:  # no page of that kind in this file: random pages
                    named = None
                if named is None and pages_per_run:
                    damage += damage_random_pages(directory, rng,
                                                  rng.randint(1, pages_per_run))
            picked = sorted(rng.sample(range(NUM_PROMPTS), PROMPTS_PER_RUN))
            if progress is not None:
                progress(f"run {index + 1}/{num_runs}: {'; '.join(damage) or 'no damage'}")
            run_started = time.perf_counter()
            report, failure = _run_engine(directory, [prompts[i] for i in picked],
                                          run_timeout_s)
            run = {"damage": damage, "seconds": time.perf_counter() - run_started,
                   "crashed": report is None, "failure": failure}
            if report is not None:
                run["wrong"] = sum(tokens != expected[i]
                                   for tokens, i in zip(report["token_ids"], picked))
                run.update(disk_tokens=report["disk_tokens"], rejected=report["rejected"],
                           recovery=report["recovery"])
            runs.append(run)
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    finished = [r for r in runs if not r["crashed"]]
    seconds = [r["seconds"] for r in runs]
    result = {
        "num_runs": num_runs, "seed": seed, "model": MODEL, "prompts_per_run": PROMPTS_PER_RUN,
        "crashes": len(runs) - len(finished),
        "wrong_answers": sum(r["wrong"] for r in finished),
        "answers": len(finished) * PROMPTS_PER_RUN,
        "recoveries": sum(r["recovery"] is not None and not r["recovery"]["disk_off"]
                          for r in finished),
        "disk_off": sum(r["recovery"] is not None and r["recovery"]["disk_off"]
                        for r in finished),
        "runs_with_disk_hits": sum(r["disk_tokens"] > 0 for r in finished),
        "disk_tokens": sum(r["disk_tokens"] for r in finished),
        "rejected_values": sum(r["rejected"] for r in finished),
        "seconds": time.perf_counter() - started,
        "run_seconds_p50": statistics.median(seconds),
        "run_seconds_max": max(seconds),
        "runs": runs,
    }
    result["ok"] = result["crashes"] == 0 and result["wrong_answers"] == 0
    return result


def damage(
    num_runs: int = typer.Option(50, help="Engine runs on one disk tier, damaged between."),
    seed: int = typer.Option(0, help="Seed of the prompts and of the damage."),
    pages_per_run: int = typer.Option(3, help="At most this many random pages damaged "
                                      "between two runs."),
    named_every: int = typer.Option(5, help="Every N runs, one named damage instead (a "
                                    "leaf/branch/meta page, the length or kind of the file, "
                                    "lock.mdb); 0: never."),
    run_timeout: float = typer.Option(300.0, help="Seconds a run may take before it counts "
                                      "as a crash (a hang)."),
    disk_dir: Path | None = typer.Option(None, help="Disk tier directory (default: a "
                                         "temporary one, removed after); damaged copies "
                                         "are moved aside next to it."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Damage a disk tier between engine runs: no run may crash or answer differently.
    Exits non-zero otherwise."""
    from rich.console import Console

    with Console(stderr=True).status("bench damage") as status:
        result = run_damage_soak(num_runs, seed, pages_per_run, named_every, run_timeout,
                                 disk_dir, lambda text: status.update(text))
    if json_output:
        print_json(result)
    else:
        print_table(f"bench damage: {num_runs} runs, seed {seed}, {result['model']}",
                    ("figure", "value"),
                    [("crashes (signal, error or timeout)", result["crashes"]),
                     ("wrong answers", f"{result['wrong_answers']} of {result['answers']}"),
                     ("damaged tier moved aside", result["recoveries"]),
                     ("disk tier off", result["disk_off"]),
                     ("runs with disk hits", result["runs_with_disk_hits"]),
                     ("tokens restored from disk", result["disk_tokens"]),
                     ("damaged values rejected", result["rejected_values"]),
                     ("run seconds p50 / max", f"{result['run_seconds_p50']:.1f} / "
                                               f"{result['run_seconds_max']:.1f}"),
                     ("wall seconds", f"{result['seconds']:.1f}")])
        for index, run in enumerate(result["runs"]):
            if run["crashed"]:
                typer.echo(f"run {index + 1} crashed ({run['failure']}) after: "
                           f"{'; '.join(run['damage'])}")
    if not result["ok"]:
        raise ValueError(f"bench damage: {result['crashes']} crashed runs, "
                         f"{result['wrong_answers']} wrong answers")
