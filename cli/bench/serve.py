"""`kvtier bench serve`: multi-round conversations sharing a system prompt, under memory
pressure, with the tiers off, a host tier, and a host tier plus a disk tier.

`num_conversations` closed-loop clients each send `num_rounds` requests: the shared system
prompt, then the conversation so far (every earlier question and answer), then a new
question. A client sends its next request as soon as its answer arrives, so the engine always
has up to `num_conversations` requests while the GPU block budget holds only part of their
contexts: finished histories are evicted from the GPU, and a tier brings them back when the
conversation returns. Token ids are seeded random; sampling is greedy with a fixed answer
length, so every mode must produce the same conversations. With `doc_tokens`, each
conversation starts with a document of its own after the system prompt; with `lockstep`,
every conversation's next request is sent together, once all of the round's answers are in.

The disk modes report where the computed blocks went (`disk_writes`: written, skipped with
their reasons, lost, which must be 0; the tier's write GB/s beside a raw sequential write
of the same disk measured once in the run).

With `deterministic`, every mode also runs in the deterministic mode (batch-invariant
kernels, `EngineConfig.deterministic`): the result says, per numerics and mode, how many
conversations came out identical to the tiers-off ones, and the deterministic mode's
throughput beside the default's (`deterministic_cost`).

With `compare_hf`, the same loaded model also runs through transformers' `generate()` (the
weights are shared, not copied): prefill tokens/s and decode tokens/s at batch 1 and batch
`hf_batch`, for the engine (tiers off) and for transformers, reported with their ratios.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from kvtier.cli.bench.disk_writes import disk_writes, raw_sequential_write
from kvtier.cli.bench.longctx import (
    check_attn_backend,
    free_engine_memory,
    load_for_bench,
    median_by,
    summarize,
)
from kvtier.engine import LLM, RequestOutput, SamplingParams
from kvtier.engine.loader import LoadedModel

from kvtier.tiers.disk.worker_tier import DiskWorkerTier, WorkerCalls

#: off: tiers off. host: a host tier that holds every conversation. host_third: a host tier
#: that holds a third of them (host_disk's), no disk. host_disk: that host tier, then disk.
#: host_disk_all: host_disk with the disk asked for every prefix (restore_min_saving_s 0).
#: host_small_disk: a host tier of `host_cache_gb` (default an eighth of the conversations),
#: then disk. host_small_disk_all: host_small_disk with the disk asked for every prefix.
#: host_small_disk_inprocess / host_small_disk_worker: host_small_disk with the disk tier in
#: the engine's process / in a worker process of its own (host_small_disk: the engine's
#: default, a worker on a CUDA device).
MODES = ("off", "host", "host_disk")
EXTRA_MODES = ("host_third", "host_disk_all", "host_small_disk", "host_small_disk_all",
               "host_small_disk_inprocess", "host_small_disk_worker")
DISK_MODES = ("host_disk", "host_disk_all", "host_small_disk", "host_small_disk_all",
              "host_small_disk_inprocess", "host_small_disk_worker")
#: Modes that say where the disk tier runs: in the engine's process, or in a worker
#: process of its own (the others take the engine's default for the device).
DISK_WORKER_MODES = {"host_small_disk_inprocess": False, "host_small_disk_worker": True}
GIB = 1 << 30

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Sizes of the workload. gpu_blocks None: a third of the working set (every
    conversation's final context, the shared system prompt counted once), and at least one
    request. Raises ValueError naming a bad option."""

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    num_conversations: int = 8
    num_rounds: int = 3
    system_tokens: int = 256
    user_tokens: int = 32
    max_tokens: int = 16
    block_size: int = 16
    gpu_blocks: int | None = None
    max_batched_tokens: int = 2048
    modes: tuple[str, ...] = MODES
    compare_hf: bool = False
    hf_batch: int = 8
    hf_prompt_tokens: int = 128
    hf_new_tokens: int = 32
    repeats: int = 3
    runs: int = 1  # rounds over every mode; each mode reports its median-throughput run
    seed: int = 0
    remote_cache: str | None = None  # a Redis URL: the tiered modes also get a remote tier
    attn_backend: str = "auto"
    deterministic: bool = False  # also run every mode in the deterministic mode
    doc_tokens: int = 0  # a document of each conversation's own after the system prompt
    lockstep: bool = False  # every conversation's next request sent together
    host_cache_gb: float | None = None  # host_small_disk's host tier (None: 1/8 of all)
    disk_durable: bool = False  # the disk tier fsyncs every commit (the engine's default: off)

    def __post_init__(self) -> None:
        check_attn_backend(self.attn_backend)
        if self.doc_tokens < 0:
            raise ValueError(f"--doc-tokens must be >= 0, got {self.doc_tokens}")
        if self.host_cache_gb is not None and self.host_cache_gb <= 0:
            raise ValueError(f"--host-cache-gb must be positive, got {self.host_cache_gb}")
        for name in ("num_conversations", "num_rounds", "system_tokens", "user_tokens",
                     "max_tokens", "block_size", "max_batched_tokens", "hf_batch",
                     "hf_prompt_tokens", "repeats", "runs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.hf_new_tokens < 2:
            raise ValueError(f"--hf-new-tokens must be at least 2 (decode needs a second "
                             f"token), got {self.hf_new_tokens}")
        if not self.modes or any(m not in MODES + EXTRA_MODES for m in self.modes):
            raise ValueError(f"--modes must name some of {MODES + EXTRA_MODES}, "
                             f"got {self.modes}")
        if self.gpu_blocks is not None and self.gpu_blocks < self.request_blocks:
            raise ValueError(f"--gpu-blocks {self.gpu_blocks} cannot hold one conversation's "
                             f"last request ({self.request_blocks} blocks)")

    @property
    def context_tokens(self) -> int:
        """Tokens of a conversation after its last answer."""
        return (self.system_tokens + self.doc_tokens
                + self.num_rounds * (self.user_tokens + self.max_tokens))

    @property
    def request_blocks(self) -> int:
        return math.ceil(self.context_tokens / self.block_size)

    @property
    def working_set_blocks(self) -> int:
        """Blocks every conversation's final context needs, the shared system prompt once."""
        own_tokens = self.doc_tokens + self.num_rounds * (self.user_tokens + self.max_tokens)
        return (math.ceil(self.system_tokens / self.block_size)
                + self.num_conversations * math.ceil(own_tokens / self.block_size))

    @property
    def num_gpu_blocks(self) -> int:
        if self.gpu_blocks is not None:
            return self.gpu_blocks
        return max(self.request_blocks + 2, self.working_set_blocks // 3)


def make_conversations(config: ServeConfig,
                       vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """The workload's seeded token ids: the shared system prompt, and per conversation its
    `num_rounds` questions (also driven over HTTP by `kvtier bench serve --url`)."""
    rng = np.random.default_rng(config.seed)
    system = rng.integers(16, vocab_size, config.system_tokens).tolist()
    questions = [[rng.integers(16, vocab_size, config.user_tokens).tolist()
                  for _ in range(config.num_rounds)] for _ in range(config.num_conversations)]
    if config.doc_tokens:  # the document goes in front of the first question
        for conversation in questions:
            conversation[0] = rng.integers(16, vocab_size, config.doc_tokens).tolist() \
                + conversation[0]
    return system, questions


def _tier_options(mode: str, config: ServeConfig, bytes_per_block: int) -> dict[str, Any]:
    everything = config.num_conversations * config.request_blocks * bytes_per_block
    options: dict[str, Any] = {"gpu_blocks": config.num_gpu_blocks,
                               "block_size": config.block_size,
                               "max_num_seqs": config.num_conversations,
                               "max_num_batched_tokens": config.max_batched_tokens,
                               "host_cache": mode != "off",
                               "disk_cache": mode in DISK_MODES}
    if mode == "host":
        options["host_cache_gb"] = 5 * everything / 4 / GIB
    elif mode in ("host_third", "host_disk", "host_disk_all"):
        # The host tier holds a third of the conversations; the rest must go to disk (or,
        # without one, be computed again).
        options["host_cache_gb"] = max(everything // 3, 2 * bytes_per_block) / GIB
    elif mode in ("host_small_disk", "host_small_disk_all", *DISK_WORKER_MODES):
        options["host_cache_gb"] = config.host_cache_gb if config.host_cache_gb is not None \
            else max(everything // 8, 2 * bytes_per_block) / GIB
    if mode in DISK_MODES:
        options["disk_cache_gb"] = 5 * everything / 4 / GIB
        options["disk_durable"] = config.disk_durable
    if mode in DISK_WORKER_MODES:
        options["disk_worker"] = DISK_WORKER_MODES[mode]
    if mode in ("host_disk_all", "host_small_disk_all"):
        options["restore_min_saving_s"] = 0.0
    if config.remote_cache is not None and mode != "off":
        from kvtier.tiers.remote.config import RemoteConfig
        # A key prefix per engine: a mode never hits blocks that an earlier mode stored.
        options["remote_cache"] = RemoteConfig(config.remote_cache,
                                               key_prefix=f"bench-serve-{time.time_ns()}")
    return options


def _equal_to_baseline(runs: dict[str, list[dict[str, Any]]], baseline: str,
                       ) -> dict[str, dict[str, int]]:
    """Per mode: conversations whose every answer equals the baseline mode's (first run)."""
    reference = runs[baseline][0]["histories"]
    return {mode: {"identical": sum(a == b for a, b in zip(mode_runs[0]["histories"],
                                                             reference)),
                   "of": len(reference)}
            for mode, mode_runs in runs.items()}


def _play_modes(loaded: LoadedModel, config: ServeConfig, system: list[int],
                questions: list[list[list[int]]], bytes_per_block: int, deterministic: bool,
                report: Progress, raw_write: dict[str, Any] | None = None,
                ) -> dict[str, list[dict[str, Any]]]:
    """Every mode's runs (after one untimed warm-up pass of the first mode)."""
    weight = next(loaded.model.parameters())
    numerics = "deterministic" if deterministic else "default"
    # One-time costs (kernel compilation for every batch shape, allocator growth) must not
    # land on the first mode: play the whole workload once, untimed, with its options.
    report(f"warming up ({numerics} kernels)")
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-") as scratch:
        options = _tier_options(config.modes[0], config, bytes_per_block)
        with LLM(loaded, disk_cache_dir=scratch, deterministic=deterministic,
                 **options) as llm:
            _run_mode(llm, config, system, questions)
        del llm
        free_engine_memory(weight.device)
    # Runs go round the modes, so that a drift of the machine touches every mode alike.
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in config.modes}
    for run in range(config.runs):
        for mode in config.modes:
            report(f"run {run + 1}/{config.runs}, mode {mode} ({numerics}): "
                   f"{config.num_conversations} conversations x {config.num_rounds} rounds")
            with tempfile.TemporaryDirectory(prefix="kvtier-serve-") as scratch:
                options = _tier_options(mode, config, bytes_per_block)
                with LLM(loaded, disk_cache_dir=scratch, deterministic=deterministic,
                         **options) as llm:
                    runs[mode].append(_run_mode(llm, config, system, questions, raw_write))
                del llm
                free_engine_memory(weight.device)
    return runs


def _worker_calls(llm: LLM) -> dict[str, WorkerCalls] | None:
    """The disk worker's requests so far, per verb; None without a disk worker."""
    disk = llm.manager.disk
    return disk.calls() if isinstance(disk, DiskWorkerTier) else None


def _run_mode(llm: LLM, config: ServeConfig, system: list[int],
              questions: list[list[list[int]]],
              raw_write: dict[str, Any] | None = None) -> dict[str, Any]:
    """Drive the closed-loop clients to the end; per-request metrics and the histories."""
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    histories = [list(system) for _ in range(config.num_conversations)]
    rounds = [0] * config.num_conversations
    owner: dict[str, int] = {}

    def send(conversation: int) -> None:
        histories[conversation] += questions[conversation][rounds[conversation]]
        owner[llm.add_request(list(histories[conversation]), params)] = conversation

    start, planned_before, thread_before = (time.perf_counter(), llm.planning_seconds,
                                            llm.thread_time())
    worker_before = _worker_calls(llm)
    for conversation in range(config.num_conversations):
        send(conversation)
    finished: list[RequestOutput] = []
    answered: list[int] = []  # with lockstep: conversations waiting for the round to end
    by_round: list[dict[str, Any]] = []  # with lockstep: one record per round
    round_began, round_first, round_planned = start, 0, planned_before
    while owner:
        for output in llm.step():
            conversation = owner.pop(output.request_id)
            finished.append(output)
            histories[conversation] += output.outputs[0].token_ids
            rounds[conversation] += 1
            if rounds[conversation] < config.num_rounds:
                answered.append(conversation)
            if config.lockstep and not owner:
                now = time.perf_counter()
                by_round.append(_round_record(llm, finished[round_first:], now - round_began,
                                              llm.planning_seconds - round_planned))
                round_began, round_first = now, len(finished)
                round_planned = llm.planning_seconds
            if not config.lockstep or not owner:
                for waiting in sorted(answered):
                    send(waiting)
                answered = []
    elapsed = time.perf_counter() - start
    planning_s = llm.planning_seconds - planned_before
    thread_s = llm.thread_time().since(thread_before)
    worker_calls = _worker_calls(llm)
    llm.manager.drain()  # bytes moved count the writes the run started, landed or not yet
    ttft = [o.metrics.ttft_s for o in finished]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time)
            / (len(o.outputs[0].token_ids) - 1)
            for o in finished if len(o.outputs[0].token_ids) > 1]
    num_generated = sum(len(o.outputs[0].token_ids) for o in finished)
    stats = llm.stats()
    return {
        "disk_writes": disk_writes(stats, raw_write),
        "elapsed_s": elapsed,
        # Of it, the engine thread planning steps (`LLM.planning_seconds`), and where all
        # of its steps went (`LLM.thread_time`).
        "planning_s": planning_s,
        "engine_thread_s": thread_s.as_dict(),
        # Requests to the disk worker over the run, per verb: how many, and the seconds
        # the engine's threads waited for them (None: the disk tier runs in process).
        "disk_worker_calls": None if worker_calls is None else {
            verb: asdict(calls.since(worker_before.get(verb, WorkerCalls())))
            for verb, calls in sorted(worker_calls.items())},
        "num_requests": len(finished),
        "generated_tokens": num_generated,
        "throughput_tok_s": num_generated / elapsed,
        "ttft_s": summarize(ttft),
        "ttft_by_arrival_s": [o.metrics.ttft_s for o in
                              sorted(finished, key=lambda o: o.metrics.arrival_time)],
        "tpot_s": summarize(tpot) if tpot else None,
        "tokens": _prompt_tokens(finished),
        "num_preemptions": sum(o.metrics.num_preemptions for o in finished),
        "bytes_moved": {d.value: t.num_bytes for d, t in stats.transfers.items()},
        "tier_blocks": {tier.value: asdict(counts)
                        for tier, counts in stats.tiers.items()},
        # Per lookup: restores started, hits given up for want of GPU blocks, prefixes the
        # rates sent to compute, probes (`RestoreCounts`).
        "restores": asdict(llm.restore_counts()),
        "rounds": by_round or None,
        "histories": histories,
    }


def _prompt_tokens(outputs: list[RequestOutput]) -> dict[str, int]:
    """Where the prompts' tokens came from, summed over `outputs`."""
    return {"gpu": sum(o.metrics.cached_tokens_gpu for o in outputs),
            "host": sum(o.metrics.cached_tokens_host for o in outputs),
            "disk": sum(o.metrics.cached_tokens_disk for o in outputs),
            "remote": sum(o.metrics.cached_tokens_remote for o in outputs),
            "computed": sum(o.metrics.computed_tokens for o in outputs)}


def _round_record(llm: LLM, outputs: list[RequestOutput], seconds: float,
                  planning_s: float) -> dict[str, Any]:
    """One lockstep round: its seconds and those of them the engine spent planning steps
    (`planning_s`), where its prompts' tokens came from, its TTFT p50;
    when its last answer came, the restores so far and the rates that size them
    (`LLM.restore_rates`), and where the disk tier's ledger stood (blocks written so far,
    still pending, reused by the GPU before their write): what the next round's lookups
    could find on disk."""
    ledger = llm.stats().stores
    return {"seconds": seconds, "planning_s": planning_s, "tokens": _prompt_tokens(outputs),
            "ttft_p50_s": statistics.median(o.metrics.ttft_s for o in outputs),
            "restores": asdict(llm.restore_counts()), "rates": llm.restore_rates(),
            "disk_ledger": None if ledger is None else
            {"written": ledger.written, "pending": ledger.pending,
             "gpu_reused": ledger.skipped.get("gpu_reused", 0)}}


def _median_run(mode_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's run with the median throughput (the lower middle one of an even count), with
    every run's throughput and TTFT p99 beside it under "runs"."""
    median = dict(median_by(mode_runs, "throughput_tok_s"))
    median["runs"] = [{"throughput_tok_s": r["throughput_tok_s"], "ttft_p99_s": r["ttft_s"]["p99"]}
                      for r in mode_runs]
    return median


# ---- transformers comparison -------------------------------------------------------------


def hf_twin(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' model for `loaded`, sharing its weight tensors (no second copy)."""
    from transformers import AutoModelForCausalLM

    weight = next(loaded.model.parameters())
    with torch.device(weight.device):
        hf_model = AutoModelForCausalLM.from_config(loaded.config.to_hf(), dtype=weight.dtype,
                                                    attn_implementation="sdpa")
    result = hf_model.load_state_dict(loaded.model.state_dict(), strict=False, assign=True)
    tied = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    if set(result.missing_keys) != tied or result.unexpected_keys:
        raise ValueError(f"cannot map {loaded.model_id} onto transformers' model: missing "
                         f"{result.missing_keys}, unexpected {result.unexpected_keys}")
    if tied:
        hf_model.tie_weights()
    # Generate exactly max_new_tokens, as the engine does with ignore_eos. (min_new_tokens
    # would not do: it masks the EOS logit, so the tokens would differ from the engine's.)
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    return hf_model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FirstLogitsClock:
    """A logits processor that notes when generate() has the first token's logits, so the
    prefill and decode times come from one call (two calls' difference can go negative)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            _sync(self.device)
            self.first = time.perf_counter()
        return scores


def _hf_timings(hf_model: torch.nn.Module, prompts: list[list[int]], num_new: int,
                device: torch.device) -> tuple[float, float, list[list[int]]]:
    """(seconds for prefill + first token, seconds for all `num_new` tokens, new tokens)."""
    from transformers import LogitsProcessorList

    input_ids = torch.tensor(prompts, device=device)  # [batch, prompt_tokens]
    mask = torch.ones_like(input_ids)
    clock = _FirstLogitsClock(device)
    with torch.inference_mode():
        _sync(device)
        start = time.perf_counter()
        out = hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=num_new,
                                do_sample=False, logits_processor=LogitsProcessorList([clock]))
        _sync(device)
        total = time.perf_counter() - start
    assert clock.first is not None, "generate() produced no token"
    return clock.first - start, total, out[:, input_ids.shape[1]:].tolist()


def _engine_timings(loaded: LoadedModel, prompts: list[list[int]], num_new: int,
                    config: ServeConfig) -> tuple[float, float, list[list[int]]]:
    """The same quantities for the engine with the tiers off (pure compute)."""
    num_blocks = len(prompts) * math.ceil((len(prompts[0]) + num_new) / config.block_size)
    with LLM(loaded, gpu_blocks=num_blocks, block_size=config.block_size,
             max_num_seqs=len(prompts), max_num_batched_tokens=max(
                 config.max_batched_tokens, len(prompts) * len(prompts[0])),
             host_cache=False, disk_cache=False) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=num_new, ignore_eos=True))
    arrival = min(o.metrics.arrival_time for o in outputs)
    first = max(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.finished_time for o in outputs)
    return first - arrival, last - arrival, [list(o.outputs[0].token_ids) for o in outputs]


def compare_with_hf(loaded: LoadedModel, config: ServeConfig, progress: Progress) -> dict:
    """Prefill and decode tokens/s of the engine and of transformers, batch 1 and batch N;
    medians over `repeats` runs on fresh prompts (so no prefix cache helps the engine)."""
    device = next(loaded.model.parameters()).device
    hf_model = hf_twin(loaded)
    rng = np.random.default_rng(config.seed + 1)
    vocab = loaded.config.vocab_size
    results: dict[str, Any] = {}
    for batch in sorted({1, config.hf_batch}):
        figures: dict[str, list[float]] = {}
        same_tokens = True
        for repeat in range(config.repeats + 1):  # run 0 warms up (kernels, allocator)
            prompts = rng.integers(16, vocab, (batch, config.hf_prompt_tokens)).tolist()
            progress(f"transformers comparison: batch {batch}, run {repeat}")
            runs = {"engine": _engine_timings(loaded, prompts, config.hf_new_tokens, config),
                    "hf": _hf_timings(hf_model, prompts, config.hf_new_tokens, device)}
            same_tokens &= runs["engine"][2] == runs["hf"][2]
            if repeat == 0:
                continue
            for name, (first_s, total_s, _) in runs.items():
                figures.setdefault(f"{name}_prefill", []).append(
                    batch * config.hf_prompt_tokens / first_s)
                figures.setdefault(f"{name}_decode", []).append(
                    batch * (config.hf_new_tokens - 1) / (total_s - first_s))
        medians = {key: statistics.median(values) for key, values in figures.items()}
        results[f"batch_{batch}"] = {
            "engine_prefill_tok_s": medians["engine_prefill"],
            "hf_prefill_tok_s": medians["hf_prefill"],
            "prefill_ratio": medians["engine_prefill"] / medians["hf_prefill"],
            "engine_decode_tok_s": medians["engine_decode"],
            "hf_decode_tok_s": medians["hf_decode"],
            "decode_ratio": medians["engine_decode"] / medians["hf_decode"],
            "same_tokens": same_tokens,
        }
    del hf_model
    return results


# ---- the benchmark -----------------------------------------------------------------------


def run_serve_bench(config: ServeConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run every mode of `config` on one loaded model; return a JSON-ready dict.

    `modes[name]` has throughput (generated tokens/s), TTFT and TPOT p50/p90/p99, where
    prompt tokens came from, bytes moved; `ratios_vs_baseline` compares each mode with the
    first one (`baseline`, normally the tiers off); `outputs_identical` says whether every
    mode produced the same conversations, `equal_to_baseline` how many per mode. With
    `config.deterministic`, `deterministic_modes` and `deterministic_equal_to_baseline` are
    the same for the deterministic mode, and `deterministic_cost[mode]` its throughput and
    TPOT p50 over the default mode's.
    Raises ValueError for bad sizes and the loader's errors for a model it cannot load.
    """
    report = progress or (lambda message: None)
    report(f"loading {config.model}")
    loaded = load_for_bench(config.model, config.device, config.dtype, config.attn_backend)
    if config.context_tokens > loaded.config.max_position_embeddings:
        raise ValueError(f"a conversation reaches {config.context_tokens} tokens, past the "
                         f"model's context ({loaded.config.max_position_embeddings}); use "
                         "fewer rounds or shorter prompts")
    weight = next(loaded.model.parameters())
    layout = loaded.config.kv_layout(config.block_size, weight.dtype)
    system, questions = make_conversations(config, loaded.config.vocab_size)
    raw_write = None
    if any(mode in DISK_MODES for mode in config.modes):
        report("raw sequential write of a third of the working set (at most 4 GiB)")
        with tempfile.TemporaryDirectory(prefix="kvtier-serve-") as scratch:
            raw_write = raw_sequential_write(scratch, min(
                config.working_set_blocks * layout.bytes_per_block // 3, 4 * GIB))
    runs = _play_modes(loaded, config, system, questions, layout.bytes_per_block, False,
                       report, raw_write)
    equal = _equal_to_baseline(runs, config.modes[0])
    det_runs = None
    if config.deterministic:
        det_runs = _play_modes(loaded, config, system, questions, layout.bytes_per_block,
                               True, report, raw_write)
        det_equal = _equal_to_baseline(det_runs, config.modes[0])
        for mode_runs in det_runs.values():
            for r in mode_runs:
                r.pop("histories")
    histories = [r.pop("histories") for mode_runs in runs.values() for r in mode_runs]
    modes = {mode: _median_run(mode_runs) for mode, mode_runs in runs.items()}
    baseline = modes[config.modes[0]]
    result: dict[str, Any] = {
        "bench": "serve",
        "config": asdict(config),
        "model_id": loaded.model_id,
        "attn_backend": loaded.model.attn_backend,
        "device": str(weight.device),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "gpu_blocks": config.num_gpu_blocks,
        "working_set_blocks": config.working_set_blocks,
        "modes": modes,
        "baseline": config.modes[0],
        "ratios_vs_baseline": {
            name: {"throughput": m["throughput_tok_s"] / baseline["throughput_tok_s"],
                   "ttft_p50": m["ttft_s"]["p50"] / baseline["ttft_s"]["p50"]}
            for name, m in modes.items()},
        "outputs_identical": all(h == histories[0] for h in histories),
        "equal_to_baseline": equal,
        "raw_write": raw_write,
    }
    if det_runs is not None:
        det_modes = {mode: _median_run(mode_runs) for mode, mode_runs in det_runs.items()}
        result["deterministic_modes"] = det_modes
        result["deterministic_equal_to_baseline"] = det_equal
        result["deterministic_cost_columns"] = ("tok/s", "TPOT p50")
        result["deterministic_cost"] = {
            mode: {"throughput": det_modes[mode]["throughput_tok_s"]
                   / modes[mode]["throughput_tok_s"],
                   "tpot_p50": (det_modes[mode]["tpot_s"]["p50"] / modes[mode]["tpot_s"]["p50"]
                                if modes[mode]["tpot_s"] and det_modes[mode]["tpot_s"]
                                else None)}
            for mode in config.modes}
    if config.compare_hf:
        result["hf_comparison"] = compare_with_hf(loaded, config, report)
    return result
