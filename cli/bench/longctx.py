"""`kvtier bench longctx`: time to first token of long prompts whose KV is recomputed, restored
from the host tier, or restored from the disk tier.

`num_docs` documents of `doc_tokens` seeded random token ids, more than the GPU budget holds
(by default it holds one request). Round one prefills every document with a first question,
so their blocks spill; round two asks a second question about each document, one request at
a time. Strategies, side by side on one loaded model:

    recompute  tiers off: round two prefills every document again, on a fresh engine (as
               the disk strategies' round two: the first requests after a start are slower)
    host       a host tier large enough for every document: round two restores from it
    disk       round one on an engine that is then closed (its host tier flushed to disk);
               round two on a fresh engine whose host tier starts empty, so the documents'
               blocks come from the LMDB disk tier
    host_small_disk  as disk, but behind a host tier smaller than the documents
               (`host_cache_gb`, by default an eighth of them): the disk tier is fed while
               the host tier is full, as on a machine whose RAM is short
    disk_inprocess  as disk, with the disk tier in the engine's process (on a GPU the
               engine's default runs it in a worker process of its own)

Round two restores bidirectionally (`engine.restore`): each request computes its document's
head while the tail loads, and the two fronts meet where the tier's speed puts them; the
result gives, per strategy, the tokens restored per tier and computed (the meeting point).
With `cold` the page cache is dropped before each round-two request of every strategy (root
only; the result says whether it was): the disk restores start cold, and every strategy's
requests follow the same pause (a `sync` and the drop take a while, and a request after an
idle spell can itself take longer than one back to back). After the disk strategy, the disk
tier's own read bandwidth and the raw sequential read bandwidth of a file of one document's
KV size on the same disk are measured, alternately, three times each (`cli.bench.diskread`;
medians), cold with `cold` only: the page cache is never dropped without it (the reads are
then warm, and the result says so).
With `cold`, the disk strategies run round two a second time on another fresh engine
over what round one left on disk (the blocks of round two's prompts that the cold round
wrote are deleted first), with the tier's files read into the page cache: cold and warm
(page cache) restores are reported apart. Each disk strategy reports, per document, which
of its blocks round one left on disk (`stored_on_disk`: how many, and the run that ends
the document).
Each disk strategy reports where round one's blocks went (`disk_writes`: written, skipped
with reasons, lost, the tier's write GB/s beside a raw sequential write of the same disk
measured in the same run).

The engine's stats are sampled after every step (tier occupancy, bytes moved per direction,
the restore fronts), which gives the swap timeline. Round-two TTFT p50/p90/p99 per strategy
and its ratio to recompute are the headline; every strategy must generate the same tokens (greedy).
With `deterministic`, every strategy runs again in the deterministic mode (batch-invariant
kernels): the result says per mode how many round-two requests generated recompute's tokens,
and the deterministic mode's TTFT beside the default's (`deterministic_cost`).
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvtier.cli.bench.disk_writes import disk_writes, raw_sequential_write
from kvtier.cli.bench.diskread import (
    disk_tier_read,
    drop_page_cache,
    forget_blocks,
    raw_sequential_read,
    read_into_page_cache,
    stored_flags,
    stored_span,
    tier_resident_fraction,
)
from kvtier.cli.bench.step_recorder import StepRecorder, run_one
from kvtier.engine import LLM, RequestOutput, SamplingParams
from kvtier.engine.attention import select_backend
from kvtier.engine.engine_config import ATTN_BACKENDS
from kvtier.engine.loader import LoadedModel, load_model, resolve_device
from kvtier.engine.restore import DISK_GROUP_BYTES

from kvtier.config import DEFAULT_IO_THREADS
from kvtier.hashing import BlockHash, hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.stats import Direction

STRATEGIES = ("recompute", "host", "disk")
#: Strategies run only when named: the disk behind a small host tier, and the disk tier in
#: the engine's process.
EXTRA_STRATEGIES = ("host_small_disk", "disk_inprocess")
DISK_STRATEGIES = ("disk", "host_small_disk", "disk_inprocess")
#: Strategies whose round two runs on a fresh engine: the disk ones (their host tier starts
#: empty) and recompute, their baseline, so that both pay what an engine's first requests
#: pay (docs/BENCHMARKS.md, "Short prompts") and the ratio weighs the restore alone.
FRESH_ROUND_TWO = ("recompute", *DISK_STRATEGIES)
GIB = 1 << 30
#: The goal the engine issue sets for a 32K-token prompt on the GPU: restoring its KV from the
#: host tier gives the first token at least this many times sooner than recomputing it.
HOST_SPEEDUP_GOAL = 12.0
#: Rounds of the disk tier's cold read against the raw file's (medians are reported).
DISK_READ_ROUNDS = 3

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LongctxConfig:
    """Sizes of the benchmark. gpu_blocks None: one request's blocks plus two.

    Raises ValueError naming the option when a size is out of range or a strategy unknown.
    """

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    num_docs: int = 4
    doc_tokens: int = 1024
    question_tokens: int = 16
    max_tokens: int = 4
    block_size: int = 16
    gpu_blocks: int | None = None
    max_batched_tokens: int = 2048
    strategies: tuple[str, ...] = STRATEGIES
    disk_dir: str | None = None
    seed: int = 0
    compare_hf: bool = False
    cold: bool = False
    attn_backend: str = "auto"
    deterministic: bool = False  # also run every strategy in the deterministic mode
    host_cache_gb: float | None = None  # host_small_disk's host tier; None: 1/8 of the docs
    disk_durable: bool = False  # the disk tier fsyncs every commit (the engine's default: off)
    #: The engines' `restore_min_saving_s` (None: the engine's default). 0 reads every prefix
    #: the tiers hold, however short: the tiers' own speed, not the engine's choice.
    restore_min_saving_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_docs", "doc_tokens", "question_tokens", "max_tokens", "block_size",
                     "max_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        check_attn_backend(self.attn_backend)
        unknown = [s for s in self.strategies if s not in STRATEGIES + EXTRA_STRATEGIES]
        if unknown or "recompute" not in self.strategies:
            raise ValueError(f"--strategies must name some of {STRATEGIES + EXTRA_STRATEGIES} "
                             f"including 'recompute' (the baseline of every ratio); got "
                             f"{self.strategies}")
        if self.restore_min_saving_s is not None and self.restore_min_saving_s < 0:
            raise ValueError(f"--restore-min-saving must be >= 0, got "
                             f"{self.restore_min_saving_s}")
        if self.host_cache_gb is not None and self.host_cache_gb <= 0:
            raise ValueError(f"--host-cache-gb must be positive, got {self.host_cache_gb}")
        if self.gpu_blocks is not None and self.gpu_blocks < self.request_blocks:
            raise ValueError(f"--gpu-blocks {self.gpu_blocks} cannot hold one request "
                             f"({self.request_blocks} blocks); raise it or shorten --doc-tokens")

    @property
    def request_blocks(self) -> int:
        """Blocks one request occupies at its longest."""
        tokens = self.doc_tokens + self.question_tokens + self.max_tokens
        return math.ceil(tokens / self.block_size)

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu_blocks if self.gpu_blocks is not None else self.request_blocks + 2


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """p50 / p90 / p99 (linear interpolation), mean and count of `samples`."""
    values = np.asarray(samples, dtype=np.float64)
    assert values.size, "no samples to summarize"
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99),
            "mean": float(values.mean()), "n": int(values.size)}


def check_attn_backend(name: str) -> None:
    """Raise ValueError naming --attn-backend unless `name` is one the engine knows."""
    if name not in ATTN_BACKENDS:
        raise ValueError(f"--attn-backend must be one of {', '.join(ATTN_BACKENDS)}; "
                         f"got {name!r}")


def load_for_bench(model: str, device: str, dtype: str,
                   attn_backend: str = "auto") -> LoadedModel:
    """Load `model` once; the strategies' engines share it. attn_backend as in
    `engine.attention.select_backend` ("auto": the device's default)."""
    device_ = resolve_device(device)
    return load_model(model, device_, dtype,
                      attn_backend=select_backend(device_, 16, attn_backend))


def free_engine_memory(device: torch.device) -> None:
    """Release a closed engine's KV cache before the next one allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_documents(config: LongctxConfig, vocab_size: int) -> tuple[list[list[int]], ...]:
    """Seeded token ids: the documents, and one question per document and round."""
    rng = np.random.default_rng(config.seed)
    low = min(16, vocab_size - 1)  # keep clear of the usual special-token ids
    docs = [rng.integers(low, vocab_size, config.doc_tokens).tolist()
            for _ in range(config.num_docs)]
    questions = [[rng.integers(low, vocab_size, config.question_tokens).tolist()
                  for _ in range(config.num_docs)] for _ in range(2)]
    return docs, questions[0], questions[1]


def _engine_options(strategy: str, config: LongctxConfig, layout: KVLayout,
                    disk_dir: Path, deterministic: bool = False) -> dict[str, Any]:
    # Room for every request's blocks in the host tier (and on disk), plus a quarter: at 32K
    # tokens of an 8B model a document is 4 GiB, so the slack is kept small.
    tier_bytes = (5 * config.num_docs * config.request_blocks // 4 + 4) * layout.bytes_per_block
    options: dict[str, Any] = {"gpu_blocks": config.num_gpu_blocks,
                               "block_size": config.block_size,
                               "max_num_batched_tokens": config.max_batched_tokens,
                               "host_cache": strategy != "recompute",
                               "host_cache_gb": tier_bytes / GIB,
                               "disk_cache": strategy in DISK_STRATEGIES,
                               "disk_cache_gb": tier_bytes / GIB,
                               "deterministic": deterministic}
    if config.restore_min_saving_s is not None:
        options["restore_min_saving_s"] = config.restore_min_saving_s
    if strategy == "host_small_disk":
        small = config.host_cache_gb
        options["host_cache_gb"] = small if small is not None else max(
            tier_bytes // 8, 2 * layout.bytes_per_block) / GIB
    if strategy in DISK_STRATEGIES:
        options["disk_cache_dir"] = disk_dir / strategy
        options["disk_durable"] = config.disk_durable
    if strategy == "disk_inprocess":
        options["disk_worker"] = False
    return options


def _run_strategy(strategy: str, loaded: LoadedModel, config: LongctxConfig,
                  docs: list[list[int]], first: list[list[int]], second: list[list[int]],
                  disk_dir: Path, progress: Progress,
                  raw_write: dict[str, Any] | None = None,
                  deterministic: bool = False) -> dict[str, Any]:
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    layout = loaded.config.kv_layout(config.block_size, next(loaded.model.parameters()).dtype)
    options = _engine_options(strategy, config, layout, disk_dir, deterministic)
    recorder = StepRecorder()
    outputs: dict[str, list[RequestOutput]] = {}
    cold: bool | None = None  # whether every round-two request followed a dropped page cache
    writes = None
    stored = None
    warmed: dict[str, Any] | None = None  # how the warm round's page cache was made warm
    asked: list[list[BlockHash]] = []  # round two's prompts' blocks, and which round one
    held: list[list[bool]] = []  # left on disk
    with LLM(loaded, **options) as llm:
        device = llm.device
        recorder.start(llm, "round 1")
        progress(f"{strategy}: round 1, prefilling {config.num_docs} documents")
        outputs["round1"] = [run_one(llm, d + q, params, recorder) for d, q in zip(docs, first)]
        if strategy in DISK_STRATEGIES:  # what reached the disk, closing included
            flush = llm.close()
            writes = disk_writes(llm.manager.stats(lower_tiers=False), raw_write)
            if writes is not None:
                writes["flush_on_close"] = {"written": flush.num_written,
                                            "unwritten": flush.num_unwritten,
                                            "seconds": flush.seconds}
            namespace = namespace_hash(llm.model_fingerprint, layout,
                                       llm.config.hash_algorithm, llm.config.cache_salt)
            # What round two's prompts could find on disk, as round one left it.
            asked = [hash_blocks(namespace, d + q, config.block_size,
                                 llm.config.hash_algorithm) for d, q in zip(docs, second)]
            held = stored_flags(options["disk_cache_dir"], layout, asked)
            doc_blocks = config.doc_tokens // config.block_size
            stored = [stored_span(flags[:doc_blocks]) for flags in held]
        elif strategy not in FRESH_ROUND_TWO:
            recorder.start(llm, "round 2")
            progress(f"{strategy}: round 2, asking about each document again")
            outputs["round2"] = []
            for d, q in zip(docs, second):
                cold = _pause(config, cold, progress)
                outputs["round2"].append(run_one(llm, d + q, params, recorder))
    del llm
    free_engine_memory(device)
    resident: list[float | None] = []  # share of the disk tier's file cached after a drop
    restores: dict[str, dict[str, int]] = {}  # per fresh engine: `LLM.restore_counts`
    if strategy in FRESH_ROUND_TWO:
        # A fresh engine (over the same directory): its host tier is empty, so every block
        # that is not recomputed comes from disk. With `cold`, a second fresh engine then
        # reads the same blocks from the page cache (warm).
        rounds = (("round2", config.cold), ("round2_warm", False))
        for name, drop in rounds[:1 + (config.cold and strategy in DISK_STRATEGIES)]:
            if name == "round2_warm":
                warmed = _warm_round_one_tier(options["disk_cache_dir"], layout, asked, held,
                                              progress)
            with LLM(loaded, **options) as llm:
                recorder.start(llm, {"round2": "round 2", "round2_warm": "round 2 warm"}[name])
                progress(f"{strategy}: {name} on a fresh engine" + (
                    ", restoring from disk" if strategy in DISK_STRATEGIES else ""))
                outputs[name] = []
                for i, (d, q) in enumerate(zip(docs, second)):
                    if drop:
                        cold = _pause(config, cold, progress)
                        if strategy in DISK_STRATEGIES:
                            resident.append(tier_resident_fraction(
                                options["disk_cache_dir"]))
                    outputs[name].append(run_one(llm, d + q, params, recorder))
                    share = "" if not (drop and resident) or resident[-1] is None else \
                        f" ({resident[-1]:.1%} of the tier's file cached after the drop)"
                    progress(f"{strategy}: {name}, document {i + 1}/{len(docs)}: TTFT "
                             f"{outputs[name][-1].metrics.ttft_s * 1e3:.1f} ms{share}")
                restores[name] = asdict(llm.restore_counts())
            del llm
            free_engine_memory(device)
    round2 = outputs["round2"]
    moved = {d.value: sum(s["bytes_moved"][d.value] for s in recorder.samples)
             for d in Direction}
    return {
        "ttft_s": summarize([o.metrics.ttft_s for o in round2]),
        "ttft_round1_s": summarize([o.metrics.ttft_s for o in outputs["round1"]]),
        "tokens": {"gpu": sum(o.metrics.cached_tokens_gpu for o in round2),
                   "host": sum(o.metrics.cached_tokens_host for o in round2),
                   "disk": sum(o.metrics.cached_tokens_disk for o in round2),
                   "computed": sum(o.metrics.computed_tokens for o in round2)},
        "bytes_moved": moved,
        "meeting_blocks": _meeting_blocks(round2, config),
        "ttft_warm_s": (summarize([o.metrics.ttft_s for o in outputs["round2_warm"]])
                        if "round2_warm" in outputs else None),
        "meeting_blocks_warm": (_meeting_blocks(outputs["round2_warm"], config)
                                if "round2_warm" in outputs else None),
        "warm_page_cache": warmed,
        "disk_writes": writes,
        # Per document, which of its blocks round one left on disk (`stored_spans`).
        "stored_on_disk": stored,
        # How the fresh engines' prefix lookups went (restores started, hits given up for
        # want of GPU blocks, prefixes the rates sent to compute, probes).
        "restores": restores,
        "cold": cold,
        "resident_after_drop": resident,
        "num_steps": len(recorder.samples),
        "num_swap_steps": len(recorder.swaps()),
        "max_bytes_per_step": max((sum(s["bytes_moved"].values()) for s in recorder.samples),
                                  default=0),
        "timeline": recorder.samples,
        "token_ids": {name: [list(o.outputs[0].token_ids) for o in outs]
                      for name, outs in outputs.items() if name != "round2_warm"},
        "warm_identical": ("round2_warm" not in outputs or
                           [list(o.outputs[0].token_ids) for o in outputs["round2_warm"]]
                           == [list(o.outputs[0].token_ids) for o in round2]),
    }


def _warm_round_one_tier(root: Path, layout: KVLayout, asked: list[list[BlockHash]],
                         held: list[list[bool]], progress: Progress) -> dict[str, Any]:
    """Before the warm round: the blocks of round two's prompts that the cold round wrote
    are deleted, so that the warm round finds what round one left, as the cold round did;
    then the tier's files are read into the page cache. Without this the warm round read
    most blocks from disk cold: the drops before each cold request had evicted every block
    that round did not read itself."""
    added = [h for hashes, flags in zip(asked, held) for h, was in zip(hashes, flags)
             if not was]
    forgotten = forget_blocks(root, layout, added)
    start = time.perf_counter()
    num_bytes = read_into_page_cache(root)
    seconds = time.perf_counter() - start
    resident = tier_resident_fraction(root)
    progress(f"warm round: {forgotten} blocks the cold round wrote deleted; the tier's "
             f"{num_bytes / 2**30:.1f} GiB read into the page cache in {seconds:.1f} s"
             + ("" if resident is None else f" ({resident:.0%} resident)"))
    return {"forgotten": forgotten, "bytes_read": num_bytes, "seconds": seconds,
            "resident": resident}


def _meeting_blocks(outputs: list, config: LongctxConfig) -> list[dict[str, int]]:
    """Per document, the blocks each source gave its round-two prompt and those computed:
    where the restore fronts met."""
    bs, doc_blocks = config.block_size, config.doc_tokens // config.block_size
    return [{"gpu": m.cached_tokens_gpu // bs, "host": m.cached_tokens_host // bs,
             "disk": m.cached_tokens_disk // bs,
             "computed": doc_blocks - (m.cached_tokens_gpu + m.cached_tokens_host
                                       + m.cached_tokens_disk) // bs}
            for m in (o.metrics for o in outputs)]


def _pause(config: LongctxConfig, cold: bool | None, report: Progress) -> bool | None:
    """Before a round-two request: with `config.cold`, drop the page cache; returns whether
    every drop so far worked (`cold`, None while none was tried)."""
    if not config.cold:
        return cold
    dropped = drop_page_cache()
    if cold is None:
        report("dropping the page cache before each round-two request (--cold)" if dropped
               else "--cold: the page cache could not be dropped (needs root)")
    return dropped if cold is None else cold and dropped


def _measure_disk(loaded: LoadedModel, config: LongctxConfig, disk_dir: Path,
                  report: Progress) -> dict[str, Any]:
    """The disk tier's cold read bandwidth next to the same disk's raw sequential reads:
    `DISK_READ_ROUNDS` rounds of (the tier, the raw file), each entry the round with the
    median GB/s, every round's figure beside it (one cold read varies by 10-20% on the GPU
    machine's disk, so a single pair cannot tell 0.84x from 0.9x)."""
    layout = loaded.config.kv_layout(config.block_size, next(loaded.model.parameters()).dtype)
    report(f"disk: reading the tier back {'cold' if config.cold else 'warm (no --cold)'}, "
           "then a raw file of one document's size")
    doc_blocks = config.doc_tokens // config.block_size
    group_blocks = max(1, DISK_GROUP_BYTES // layout.bytes_per_block)
    tiers, raws = [], []
    for _ in range(DISK_READ_ROUNDS):
        # One document's blocks as a restore reads them (its groups, from the tail backward).
        tiers.append(disk_tier_read(disk_dir, layout, threads=DEFAULT_IO_THREADS,
                                    group_blocks=group_blocks, max_blocks=doc_blocks,
                                    order="document", drop=config.cold))
        raws.append(raw_sequential_read(disk_dir.parent,
                                        config.doc_tokens * layout.bytes_per_token,
                                        drop=config.cold))
    # As many blocks in key order, scattered over the file (the worst case), once.
    scattered = disk_tier_read(disk_dir, layout, threads=DEFAULT_IO_THREADS,
                               group_blocks=group_blocks, max_blocks=doc_blocks, order="key",
                               drop=config.cold)
    tier = median_by(tiers, "gb_s")
    raw = median_by(raws, "best_gb_s")
    return {"tier": tier, "tier_scattered": scattered, "raw": raw,
            "tier_gb_s_rounds": [t["gb_s"] for t in tiers],
            "raw_best_gb_s_rounds": [r["best_gb_s"] for r in raws],
            "tier_vs_best_raw": tier["gb_s"] / raw["best_gb_s"],
            "scattered_vs_best_raw": scattered["gb_s"] / raw["best_gb_s"]}


def median_by(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The result whose `key` is the median (the lower middle one of an even count)."""
    return sorted(results, key=lambda result: result[key])[(len(results) - 1) // 2]


def run_longctx_bench(config: LongctxConfig, progress: Progress | None = None,
                      loaded: LoadedModel | None = None) -> dict[str, Any]:
    """Run every strategy of `config` on one loaded model; return a JSON-ready dict.

    `strategies[name]["ttft_s"]` summarizes round two; `speedup_vs_recompute` is the
    recompute p50 over this strategy's p50; `headline` repeats the host and disk ratios for
    the prompt length used; `outputs_identical` says whether every strategy generated the
    same tokens. Raises ValueError for bad sizes (including a model context too short for
    the documents) and the loader's errors for a model it cannot load.
    """
    report = progress or (lambda message: None)
    if loaded is None:
        report(f"loading {config.model}")
        loaded = load_for_bench(config.model, config.device, config.dtype,
                                config.attn_backend)
    context = loaded.config.max_position_embeddings
    if config.doc_tokens + config.question_tokens + config.max_tokens > context:
        raise ValueError(f"--doc-tokens {config.doc_tokens} plus the question and answer "
                         f"exceed the model's context ({context} tokens); shorten them")
    docs, first, second = make_documents(config, loaded.config.vocab_size)
    strategies: dict[str, dict[str, Any]] = {}
    # A fresh directory every run (inside `disk_dir` when given), so nothing from an earlier
    # run can be hit in round one.
    with tempfile.TemporaryDirectory(prefix="kvtier-longctx-", dir=config.disk_dir) as scratch:
        disk_dir = Path(scratch) / "kv"
        disk_read: dict[str, Any] | None = None
        raw_write = None
        if any(s in DISK_STRATEGIES for s in config.strategies):
            # The bar for the tier's writes: this disk's own sequential writes, one
            # document's KV (at most 4 GiB).
            weight = next(loaded.model.parameters())
            doc_bytes = config.doc_tokens * loaded.config.kv_layout(
                config.block_size, weight.dtype).bytes_per_token
            disk_dir.mkdir(parents=True, exist_ok=True)
            report("raw sequential write of one document's KV size")
            raw_write = raw_sequential_write(disk_dir, min(doc_bytes, 4 * GIB))
        for strategy in config.strategies:
            strategies[strategy] = _run_strategy(strategy, loaded, config, docs, first, second,
                                                 disk_dir, report, raw_write)
            if strategy == "disk":
                disk_read = _measure_disk(loaded, config, disk_dir / strategy, report)
    deterministic: dict[str, dict[str, Any]] | None = None
    if config.deterministic:
        deterministic = {}
        with tempfile.TemporaryDirectory(prefix="kvtier-longctx-",
                                         dir=config.disk_dir) as scratch:
            for strategy in config.strategies:
                deterministic[strategy] = _run_strategy(
                    strategy, loaded, config, docs, first, second, Path(scratch) / "kv",
                    lambda m: report(f"deterministic mode: {m}"), raw_write,
                    deterministic=True)
    baseline = strategies["recompute"]["ttft_s"]["p50"]
    for result in strategies.values():
        result["speedup_vs_recompute"] = baseline / result["ttft_s"]["p50"]
    reference = strategies["recompute"]["token_ids"]
    transformers = None
    if config.compare_hf:
        # transformers' forward pass over the same round-two prompts (same weights), against
        # the engine's recompute TTFT of those prompts.
        from kvtier.cli.bench.hf_prefill import hf_prefill_ttft

        report("transformers: one forward pass per round-two prompt")
        hf = hf_prefill_ttft(loaded, [d + q for d, q in zip(docs, second)])
        transformers = {"ttft_s": summarize(hf["ttft_s"]),
                        "engine_recompute_vs_hf": baseline / float(np.median(hf["ttft_s"])),
                        "same_first_tokens": hf["first_tokens"] == [
                            ids[0] for ids in reference["round2"]]}
    weight = next(loaded.model.parameters())
    layout = loaded.config.kv_layout(config.block_size, weight.dtype)
    prompt_tokens = config.doc_tokens + config.question_tokens
    return {
        "bench": "longctx",
        "config": asdict(config),
        "model_id": loaded.model_id,
        "attn_backend": loaded.model.attn_backend,
        "device": str(weight.device),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "layout": layout.describe(),
        "bytes_per_block": layout.bytes_per_block,
        "gpu_blocks": config.num_gpu_blocks,
        "prompt_tokens": prompt_tokens,
        "document_kv_bytes": config.doc_tokens * layout.bytes_per_token,
        "headline": {
            "prompt_tokens": prompt_tokens,
            "ttft_p50_recompute_s": baseline,
            **{f"ttft_p50_{name}_s": strategies[name]["ttft_s"]["p50"]
               for name in strategies if name != "recompute"},
            **{f"speedup_{name}_vs_recompute": strategies[name]["speedup_vs_recompute"]
               for name in strategies if name != "recompute"},
            # The goal is set for a GPU; on another device it is not reported.
            "host_speedup_goal": HOST_SPEEDUP_GOAL if weight.device.type == "cuda" else None,
            "host_speedup_meets_goal": (strategies["host"]["speedup_vs_recompute"]
                                        >= HOST_SPEEDUP_GOAL if "host" in strategies
                                        and weight.device.type == "cuda" else None),
        },
        "strategies": strategies,
        "disk_read": disk_read,
        "raw_write": raw_write,
        "outputs_identical": all(result["token_ids"] == reference and result["warm_identical"]
                                 for result in strategies.values()),
        "equal_to_baseline": _equal_requests(strategies),
        **(_deterministic_report(strategies, deterministic) if deterministic else {}),
        "transformers": transformers,
    }


def _equal_requests(strategies: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per strategy: round-two requests that generated recompute's tokens."""
    reference = strategies["recompute"]["token_ids"]["round2"]
    return {name: {"identical": sum(a == b for a, b in zip(s["token_ids"]["round2"],
                                                           reference)),
                   "of": len(reference)}
            for name, s in strategies.items()}


def _deterministic_report(default: dict[str, dict[str, Any]],
                          deterministic: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The deterministic mode's strategies (without their timelines), their requests equal
    to its recompute, and its round-two TTFT p50 over the default mode's per strategy."""
    for result in deterministic.values():
        result.pop("timeline")
    return {
        "deterministic_strategies": deterministic,
        "deterministic_equal_to_baseline": _equal_requests(deterministic),
        "deterministic_cost_columns": ("TTFT p50",),
        "deterministic_cost": {name: {"ttft_p50": deterministic[name]["ttft_s"]["p50"]
                                      / default[name]["ttft_s"]["p50"]}
                               for name in default},
    }


def run_longctx_sweep(config: LongctxConfig, doc_tokens: Sequence[int],
                      progress: Progress | None = None) -> dict[str, Any]:
    """`run_longctx_bench` for every document length in `doc_tokens`, on one loaded model.
    Raises as `run_longctx_bench` does."""
    report = progress or (lambda message: None)
    report(f"loading {config.model}")
    loaded = load_for_bench(config.model, config.device, config.dtype,
                                config.attn_backend)
    runs = []
    for tokens in doc_tokens:
        one = LongctxConfig(**{**asdict(config), "doc_tokens": tokens,
                               "strategies": config.strategies})
        runs.append(run_longctx_bench(one, lambda m, t=tokens: report(f"{t} tokens: {m}"),
                                      loaded))
    return {"bench": "longctx-sweep", "doc_tokens": list(doc_tokens), "runs": runs}
