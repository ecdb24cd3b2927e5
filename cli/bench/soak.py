"""`kvtier bench soak`: thousands of requests through tiny tiers, then proof that nothing
leaked, nothing was lost and no answer changed.

A seeded workload of requests with random lengths, shared prefixes, three tenants
(`cache_salt`), greedy and seeded sampling, streams into an engine whose GPU pool and host
tier hold a few requests' blocks, with the disk tier on: blocks move down and back all the
time, and the tiny GPU budget forces preemptions. The run is cut into phases; each phase is
a new engine on the same disk directory (a restart). After each phase, and at the end, the
soak checks:

  * every GPU block is free with ref_cnt 0 (pool invariants), no host slot is pinned or
    reserved, nothing is in flight;
  * the tier counters add up (lookups cascade GPU -> host -> disk, the disk asked for at
    most the host's misses; bytes moved are whole blocks; the disk's verified reads are the
    disk -> host bytes; restored tokens were moved), no transfer failed, no stored value
    was rejected, the only failed disk reads are blocks pruned between lookup and read, the
    disk stays in budget;
  * nothing leaked: the I/O threads are joined, open file descriptors are back to the
    baseline, and resident memory grew by less than `max_rss_growth_mb` after the first
    phase (allocators and caches warm up during it);
  * a seeded sample of the requests gives the same tokens on a tiers-off engine.

The result is a dict (JSON-ready): the workload, per-phase tier counters, the leak figures
and `checks` (name -> passed), with `ok` true when all passed.
"""

from __future__ import annotations

import gc
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import typer
from kvtier.cli.common import print_json, print_table
from kvtier.engine import LLM, RequestOutput, SamplingParams
from kvtier.engine.loader import LoadedModel, load_model

from kvtier.stats import Direction, ManagerStats, Tier

Progress = Callable[[str], None]
TENANTS = (None, "tenant-1", "tenant-2")


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """The engine's budgets (in blocks) and the workload's shape. Raises ValueError naming
    a bad option."""

    model: str = "random:tiny-llama"
    device: str = "cpu"
    block_size: int = 16
    gpu_blocks: int = 24
    host_slots: int = 8
    disk_blocks: int = 256
    max_num_seqs: int = 8
    max_batched_tokens: int = 128
    num_prefixes: int = 12
    max_prompt_tokens: int = 160
    max_new_tokens: int = 12
    num_phases: int = 2
    num_checked: int = 32
    max_rss_growth_mb: float = 256.0
    torch_threads: int = 1
    disk_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "gpu_blocks", "host_slots", "disk_blocks", "max_num_seqs",
                     "max_batched_tokens", "num_prefixes", "max_prompt_tokens",
                     "max_new_tokens", "num_phases", "torch_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.num_checked < 0 or self.max_rss_growth_mb <= 0:
            raise ValueError("--num-checked must be >= 0 and --max-rss-growth-mb positive")
        if -(-self.max_prompt_tokens // self.block_size) > self.gpu_blocks:
            raise ValueError(f"--gpu-blocks {self.gpu_blocks} cannot hold a prompt of "
                             f"--max-prompt-tokens {self.max_prompt_tokens}")


@dataclass(frozen=True, slots=True)
class _Work:
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None


def make_workload(num_requests: int, seed: int, config: SoakConfig,
                  vocab_size: int) -> list[_Work]:
    """Seeded requests: most start with one of the shared prefixes; a third sample (with
    their own seed, so their tokens do not depend on the batch), the rest are greedy."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(rng.randrange(
        config.block_size, config.max_prompt_tokens // 2 + 1))]
        for _ in range(config.num_prefixes)]
    work = []
    for index in range(num_requests):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
        room = config.max_prompt_tokens - len(prompt)
        prompt += [rng.randrange(vocab_size) for _ in range(rng.randint(1, room))]
        sampled = rng.random() < 1 / 3
        params = SamplingParams(max_tokens=rng.randint(1, config.max_new_tokens),
                                temperature=0.8 if sampled else 0.0, top_k=20 if sampled else 0,
                                seed=seed * 1_000_003 + index, ignore_eos=rng.random() < 0.5)
        work.append(_Work(prompt, params, rng.choice(TENANTS)))
    return work


def _rss_bytes() -> int | None:
    """Resident memory of this process (psutil; None where the platform cannot say)."""
    try:
        return psutil.Process().memory_info().rss
    except (psutil.Error, OSError):
        return None


def _num_fds() -> int | None:
    """Open file descriptors of this process (None where the platform cannot say)."""
    try:
        return psutil.Process().num_fds()
    except (psutil.Error, OSError, AttributeError):  # num_fds is POSIX only
        return None


def _engine(loaded: LoadedModel, config: SoakConfig, disk_dir: Path) -> LLM:
    bytes_per_block = loaded.config.kv_layout(config.block_size, torch.float32).bytes_per_block
    # The soak exercises the disk's read path: its tiny model computes any prefix sooner
    # than reading could save, so the disk is always asked (restore_min_saving_s 0).
    return LLM(loaded, block_size=config.block_size, gpu_blocks=config.gpu_blocks,
               host_cache_gb=config.host_slots * bytes_per_block / 2**30,
               disk_cache_dir=disk_dir, disk_cache_gb=config.disk_blocks * 1.05
               * bytes_per_block / 2**30, max_num_seqs=config.max_num_seqs,
               max_num_batched_tokens=config.max_batched_tokens, restore_min_saving_s=0.0)


def _run_phase(llm: LLM, work: list[_Work], first_index: int, max_in_flight: int,
               outputs: dict[int, RequestOutput]) -> int:
    """Stream `work` into the engine, at most `max_in_flight` at once; returns the steps."""
    ids: dict[str, int] = {}
    pending = list(enumerate(work, first_index))
    pending.reverse()
    num_steps = num_done = 0
    while pending or llm.has_unfinished():
        while pending and len(ids) - num_done < max_in_flight:
            index, item = pending.pop()
            ids[llm.add_request(item.prompt, item.params, cache_salt=item.cache_salt)] = index
        for output in llm.step():
            outputs[ids[output.request_id]] = output
            num_done += 1
        num_steps += 1
    return num_steps


def _phase_checks(llm: LLM, stats: ManagerStats, outputs: list[RequestOutput],
                  block_size: int) -> dict[str, bool]:
    """What must hold when a phase's requests are all done (see the module docstring)."""
    manager, tiers = llm.manager, stats.tiers
    bpb = llm.layout.bytes_per_block
    checks: dict[str, bool] = {}
    try:
        manager.pool.check_invariants()
        if manager.host is not None:
            manager.host.check_invariants(idle=True)
        checks["blocks_free_and_unpinned"] = (
            stats.pool.num_free == stats.pool.num_blocks
            and all(block.ref_cnt == 0 for block in manager.pool.blocks)
            and stats.num_jobs_in_flight == 0 and stats.num_loads_in_flight == 0)
    except AssertionError:
        checks["blocks_free_and_unpinned"] = False
    moved = {d: stats.bytes_moved(d) for d in Direction}
    restored = sum(o.metrics.cached_tokens_host + o.metrics.cached_tokens_disk
                   for o in outputs) // block_size
    # The disk is asked only for prefixes worth reading (`restore_rates.worth_reading`), so
    # at most every host miss is a disk lookup.
    checks["lookups_cascade"] = (tiers[Tier.GPU].misses == tiers[Tier.HOST].hits
                                 + tiers[Tier.HOST].misses and tiers[Tier.HOST].misses
                                 >= tiers[Tier.DISK].hits + tiers[Tier.DISK].misses)
    checks["bytes_are_whole_blocks"] = all(n % bpb == 0 for n in moved.values())
    checks["restored_tokens_were_moved"] = moved[Direction.HOST_TO_GPU] >= restored * bpb
    disk = stats.disk
    checks["disk_reads_are_verified_hits"] = (disk is not None and
                                              moved[Direction.DISK_TO_HOST] == disk.hits * bpb)
    checks["disk_within_budget"] = disk is not None and disk.bytes_used <= disk.budget_bytes
    checks["no_transfer_failed"] = (all(t.failures == 0 for t in stats.transfers.values())
                                    and tiers[Tier.HOST].failures == 0)
    checks["no_value_rejected"] = disk is not None and disk.rejected == 0
    # A disk hit can be pruned (the budget is full) before its read: a miss, recomputed.
    # Every failed disk read must be such a block, never a read that went wrong.
    checks["disk_failures_are_pruned_blocks"] = (disk is not None and
                                                 tiers[Tier.DISK].failures == disk.misses)
    checks["all_finished"] = all(o.outputs[0].finish_reason in ("stop", "length")
                                 for o in outputs)
    return checks


def _summary(stats: ManagerStats, outputs: list[RequestOutput], num_steps: int) -> dict:
    disk = stats.disk
    return {
        "requests": len(outputs), "steps": num_steps,
        "preemptions": sum(o.metrics.num_preemptions for o in outputs),
        "tokens": {"gpu": sum(o.metrics.cached_tokens_gpu for o in outputs),
                   "host": sum(o.metrics.cached_tokens_host for o in outputs),
                   "disk": sum(o.metrics.cached_tokens_disk for o in outputs),
                   "computed": sum(o.metrics.computed_tokens for o in outputs)},
        "tiers": {t.value: asdict(s) for t, s in stats.tiers.items()},
        "bytes_moved": {d.value: stats.bytes_moved(d) for d in Direction},
        "transfer_failures": {d.value: t.failures for d, t in stats.transfers.items()},
        "disk": None if disk is None else asdict(disk),
    }


def run_soak(num_requests: int, seed: int = 0, config: SoakConfig | None = None,
             progress: Progress | None = None) -> dict[str, Any]:
    """Run the soak (see the module docstring); returns its report. Raises ValueError for
    a bad option, and the loader's errors for a model it cannot load."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"--num-requests must be a positive integer, got {num_requests!r}")
    config = config or SoakConfig()
    progress = progress or (lambda text: None)
    torch_threads_before = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads)
    own_dir = config.disk_dir is None
    disk_dir = Path(tempfile.mkdtemp(prefix="kvtier-soak-")) if own_dir else Path(config.disk_dir)
    try:
        return _soak(num_requests, seed, config, disk_dir, progress)
    finally:
        torch.set_num_threads(torch_threads_before)
        if own_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


def _soak(num_requests: int, seed: int, config: SoakConfig, disk_dir: Path,
          progress: Progress) -> dict[str, Any]:
    progress(f"loading {config.model}")
    loaded = load_model(config.model, config.device, "float32")
    work = make_workload(num_requests, seed, config, loaded.config.vocab_size)
    gc.collect()
    threads_before = set(threading.enumerate())
    baseline = {"rss": _rss_bytes(), "fds": _num_fds(), "threads": len(threads_before)}
    outputs: dict[int, RequestOutput] = {}
    phases, checks, rss_after_first = [], {}, None
    started = time.perf_counter()
    bounds = [round(i * num_requests / config.num_phases) for i in range(config.num_phases + 1)]
    for phase, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        progress(f"phase {phase + 1}/{config.num_phases}: requests {lo}-{hi}")
        with _engine(loaded, config, disk_dir) as llm:
            num_steps = _run_phase(llm, work[lo:hi], lo, 2 * config.max_num_seqs, outputs)
            llm.manager.flush()
            stats = llm.stats()
            done = [outputs[i] for i in range(lo, hi) if i in outputs]
            phase_checks = _phase_checks(llm, stats, done, config.block_size)
            phase_checks["all_finished"] &= len(done) == hi - lo
        for name, passed in phase_checks.items():
            checks[name] = checks.get(name, True) and passed
        phases.append(_summary(stats, done, num_steps))
        gc.collect()
        if rss_after_first is None:
            rss_after_first = _rss_bytes()
    seconds = time.perf_counter() - started
    gc.collect()
    end = {"rss": _rss_bytes(), "fds": _num_fds(), "threads": threading.active_count()}
    # Threads of the test or program around the soak may come and go; none of ours may stay.
    checks["threads_joined"] = not set(threading.enumerate()) - threads_before
    if baseline["fds"] is not None:
        checks["fds_back_to_baseline"] = end["fds"] == baseline["fds"]
    rss_growth = None
    if rss_after_first is not None and end["rss"] is not None:
        rss_growth = end["rss"] - rss_after_first
        checks["rss_growth_bounded"] = rss_growth < config.max_rss_growth_mb * 2**20
    progress(f"checking {config.num_checked} requests against a tiers-off engine")
    rng = random.Random(seed)
    sample = sorted(rng.sample(range(num_requests), min(config.num_checked, num_requests)))
    mismatched = []
    if sample:
        with LLM(loaded, block_size=config.block_size, gpu_blocks=4 * config.gpu_blocks,
                 host_cache=False, disk_cache=False) as reference:
            expected = reference.generate([work[i].prompt for i in sample],
                                          [work[i].params for i in sample])
        mismatched = [i for i, out in zip(sample, expected)
                      if i not in outputs
                      or out.outputs[0].token_ids != outputs[i].outputs[0].token_ids]
    checks["sample_matches_tiers_off"] = not mismatched
    return {
        "config": asdict(config), "num_requests": num_requests, "seed": seed,
        "model_id": loaded.model_id, "seconds": seconds,
        "requests_per_s": num_requests / seconds if seconds > 0 else None,
        "phases": phases,
        "leaks": {"baseline": baseline, "end": end, "rss_after_first_phase": rss_after_first,
                  "rss_growth_after_first_phase": rss_growth},
        "sample": {"checked": len(sample), "mismatched": mismatched},
        "checks": checks, "ok": all(checks.values()),
    }


def _print(result: dict[str, Any]) -> None:
    config = result["config"]
    print_table(f"bench soak: {result['num_requests']} requests, {result['model_id']}, GPU "
                f"{config['gpu_blocks']} blocks, host {config['host_slots']} slots, disk "
                f"{config['disk_blocks']} blocks, {config['num_phases']} phases",
                ("phase", "requests", "steps", "preempted", "gpu", "host", "disk", "computed",
                 "disk pruned", "disk rejected"),
                [(i + 1, p["requests"], p["steps"], p["preemptions"], p["tokens"]["gpu"],
                  p["tokens"]["host"], p["tokens"]["disk"], p["tokens"]["computed"],
                  p["disk"]["pruned"], p["disk"]["rejected"])
                 for i, p in enumerate(result["phases"])])
    leaks = result["leaks"]
    growth = leaks["rss_growth_after_first_phase"]
    typer.echo(f"{result['seconds']:.1f} s, {result['requests_per_s']:.1f} requests/s; RSS "
               f"growth after the first phase: "
               f"{'n/a' if growth is None else f'{growth / 2**20:.1f} MiB'}; open files "
               f"{leaks['baseline']['fds']} -> {leaks['end']['fds']}; threads "
               f"{leaks['baseline']['threads']} -> {leaks['end']['threads']}")
    print_table("checks", ("check", "result"),
                [(name, "ok" if passed else "FAILED") for name, passed in result["checks"].items()])


def soak(
    num_requests: int = typer.Option(300, help="Requests in the whole soak."),
    seed: int = typer.Option(0, help="Seed of the workload."),
    model: str = typer.Option("random:tiny-llama", help="Model (a small one keeps it fast)."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    gpu_blocks: int = typer.Option(24, help="GPU block budget (tiny: forces preemptions)."),
    host_slots: int = typer.Option(8, help="Host tier size in blocks."),
    disk_blocks: int = typer.Option(256, help="Disk tier budget in blocks."),
    num_phases: int = typer.Option(2, help="Engines in a row on one disk directory."),
    num_checked: int = typer.Option(32, help="Requests re-run on a tiers-off engine."),
    max_rss_growth_mb: float = typer.Option(256.0, help="Allowed RSS growth after the "
                                            "first phase, MiB."),
    torch_threads: int = typer.Option(1, help="torch threads (1 is fastest for tiny models)."),
    disk_dir: Path | None = typer.Option(None, help="Disk tier directory (default: a "
                                         "temporary one, removed after)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Thousands of requests through tiny tiers: nothing leaks, nothing is lost, no answer
    changes. Exits non-zero when a check fails."""
    config = SoakConfig(model=model, device=device, gpu_blocks=gpu_blocks,
                        host_slots=host_slots, disk_blocks=disk_blocks, num_phases=num_phases,
                        num_checked=num_checked, max_rss_growth_mb=max_rss_growth_mb,
                        torch_threads=torch_threads,
                        disk_dir=None if disk_dir is None else str(disk_dir))
    from rich.console import Console

    with Console(stderr=True).status("bench soak") as status:
        result = run_soak(num_requests, seed, config, lambda text: status.update(text))
    if json_output:
        print_json(result)
    else:
        _print(result)
    if not result["ok"]:
        failed = [name for name, passed in result["checks"].items() if not passed]
        raise ValueError(f"soak checks failed: {', '.join(failed)}")
