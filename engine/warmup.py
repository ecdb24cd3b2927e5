"""Warm-up at engine start: compile every kernel specialization a step can reach, before the
first request.

Triton compiles a kernel on its first launch with a new set of compile-time constants, and
torch grows its allocator and picks GEMM kernels on the first call of a shape: left to the
first requests, that put seconds of compilation on a request's path (docs/KERNELS.md,
"Warm-up"). The engine's kernels are specialised only
on what the model fixes (dtype, head counts, head dim, block size) and on the tiling
`kernels.paged_decode.pick_config` chooses, i.e. on the shape class of a step:

    prefill        one fresh prompt chunk of the step's full token budget (no prefix); with
                   the cudnn backend also one just under the size it takes, for Triton
    long prefix    a short chunk after a long context (split-KV)
    decode         short decodes, and decodes over long contexts (split-KV, merged)
    mid-sized      a fresh chunk of 512 tokens (the deterministic mode's products tile by rows)
    mixed          a prefill chunk batched with decodes, over long and short contexts
    sampling       the logits head, both sampler paths (greedy, seeded random) and the
                   read-back of the sampled ids (`kernels.store_to_host`)
    block copies   one block GPU -> pinned host -> GPU, and one GPU -> GPU block copy
    cuDNN graphs   with the cudnn attention backend, one prefill graph per request bucket
                   (`kernels.cudnn_backend.reachable_shapes`), built before the steps run

`prepare_gpu` runs it at engine start, right after the model runner records the CUDA graphs
of every decode batch bucket (`DecodeGraphs.capture_all`). Every warm-up step stores nothing
(slot_mapping -1) and reads block 0 through all-zero block tables; it runs before the first
request, while the GPU pool holds no block, and never touches the host or disk tiers.

Compiled kernels go to Triton's cache directory, which `use_user_triton_cache` points at
`<user cache dir>/triton` (unless TRITON_CACHE_DIR is set) so a second start loads them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kvtier.engine import paths
from kvtier.engine.attention import (
    GRAPH_BACKENDS,
    AttentionMetadata,
    PagedAttention,
    steps_through_cudnn,
)
from kvtier.engine.restore_rates import prefill_keys
from kvtier.engine.sampler import SamplingParams, sample
from kvtier.kernels import store_to_host

from kvtier.device_cache import layer_views

if TYPE_CHECKING:
    from kvtier.engine.engine_config import EngineConfig
    from kvtier.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Context of the warm-up's long-context steps: long enough for split-KV (>= 2 x 512 keys).
LONG_CONTEXT = 2048
#: Query tokens of the warm-up's short prefill chunks.
SHORT_CHUNK = 48
#: Query tokens of the warm-up's mid-sized prefill chunk.
MID_CHUNK = 512
#: Prompt tokens of the prefill timed at start on the CPU (`time_cpu_prefill`): enough that
#: the per-step costs do not make the rate, few enough to add little to a start.
CPU_TIMED_TOKENS = 128


@dataclass(frozen=True, slots=True)
class WarmupStep:
    """One synthetic step: each request's query tokens and its tokens after the step."""

    name: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What warm-up ran and how long it took (seconds, wall clock, device synchronised)."""

    steps: tuple[str, ...]
    step_seconds: float
    graph_seconds: float
    num_graphs: int
    triton_cache_dir: str
    #: (tokens, keys attended to, seconds) of the full-budget prefill timed once compiled,
    #: with no context and, where the model's length allows, after a context as long: they
    #: seed the scheduler's prefill rate, so the first restore is sized like the later ones.
    prefill_steps: tuple[tuple[int, int, float], ...] = ()
    #: cuDNN attention graphs built (attention backend "cudnn"; 0 otherwise).
    num_attention_graphs: int = 0

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Tokens per second of the full-budget prefill with no context."""
        if not self.prefill_steps:
            return None
        num_tokens, _, seconds = self.prefill_steps[0]
        return num_tokens / seconds

    @property
    def seconds(self) -> float:
        return self.step_seconds + self.graph_seconds


def use_user_triton_cache() -> Path | None:
    """Point Triton's kernel cache at `<user cache dir>/triton` unless TRITON_CACHE_DIR is
    already set; returns the directory in use, or None (with a warning) when it cannot be
    created, leaving Triton's default. Must run before Triton compiles anything (Triton
    reads the variable when it compiles)."""
    configured = os.environ.get("TRITON_CACHE_DIR")
    if configured:
        return Path(configured)
    try:
        path = paths.ensure_private_dir(paths.cache_dir() / "triton")
    except OSError as exc:
        logger.warning("Triton's kernel cache stays in its default place: %s", exc)
        return None
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def warmup_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 cudnn_min_tokens: int | None = None) -> list[WarmupStep]:
    """The synthetic steps that reach every shape class of an engine with these limits.

    `cudnn_min_tokens`: with the cudnn attention backend, the fewest query tokens of a step
    it takes (`kernels.cudnn_backend.MIN_STEP_TOKENS`). A full-budget prefill then runs on
    cuDNN, so a fresh chunk just under that size is added: shorter prompts still run the
    Triton kernel's one-pass prefill tiling, and it must be compiled here too."""
    budget = max(1, min(max_num_batched_tokens, max_model_len - 1))
    long_context = max(2, min(LONG_CONTEXT, max_model_len - 1))
    chunk = max(1, min(SHORT_CHUNK, budget, long_context // 4))
    num_decodes = max(1, min(3, max_num_seqs - 1))
    steps = [
        WarmupStep("prefill", (budget,), (budget,)),
        *([WarmupStep("prefill below cuDNN", (cudnn_min_tokens - 1,), (cudnn_min_tokens - 1,))]
          if cudnn_min_tokens is not None and 1 < cudnn_min_tokens <= budget else []),
        WarmupStep("long prefix", (chunk,), (long_context,)),
        WarmupStep("decode", (1,) * num_decodes, (17,) * num_decodes),
        WarmupStep("long decode", (1,) * num_decodes, (long_context,) * num_decodes),
    ]
    if max_num_seqs > 1:
        mixed_chunk = max(1, min(chunk, budget - num_decodes))
        steps.append(WarmupStep("mixed", (mixed_chunk,) + (1,) * num_decodes,
                                (mixed_chunk,) + (long_context,) * num_decodes))
        steps.append(WarmupStep("mixed, short contexts", (mixed_chunk,) + (1,) * num_decodes,
                                (mixed_chunk,) + (17,) * num_decodes))
    if MID_CHUNK < budget:
        # The deterministic mode's matrix products tile by the step's rows (<= 16, <= 128,
        # <= 1024, more): a mid-sized chunk reaches the third.
        steps.append(WarmupStep("mid-sized prefill", (MID_CHUNK,), (MID_CHUNK,)))
    return steps


def _step_inputs(step: WarmupStep, block_size: int, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and metadata of a step that stores nothing and reads block 0."""
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(step.q_lens, step.seq_lens)])
    num_tokens = positions.shape[0]
    starts = [0]
    for q_len in step.q_lens:
        starts.append(starts[-1] + q_len)
    max_blocks = -(-max(step.seq_lens) // block_size)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(step.q_lens), max_blocks), dtype=torch.int32,
                                 device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        max_query_len=max(step.q_lens), max_seq_len=max(step.seq_lens))
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return input_ids, positions.to(device), metadata


@torch.inference_mode()
def run_steps(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
              steps: list[WarmupStep]) -> None:
    """Run each step's forward, logits and both sampler paths; writes nothing to
    `kv_cache` [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]."""
    device = kv_cache.device
    generator = torch.Generator(device=device).manual_seed(0)
    for step in steps:
        input_ids, positions, metadata = _step_inputs(step, block_size, device)
        hidden = model.forward(input_ids, positions, kv_cache, metadata)  # [tokens, hidden]
        last = metadata.query_start_loc[1:].long() - 1  # [num_reqs] rows that would sample
        logits = model.compute_logits(hidden[last])  # [num_reqs, vocab] float32
        # Block 0 holds whatever memory held (NaN too): sample from clean logits instead.
        clean = torch.randn(logits.shape, generator=generator, device=device)
        num_reqs = len(step.q_lens)
        token_ids = sample(clean, [SamplingParams()] * num_reqs, [None] * num_reqs)  # [n]
        sample(clean, [SamplingParams(temperature=0.8, top_p=0.9, top_k=50)] * num_reqs,
               [generator] * num_reqs)
        if device.type == "cuda":
            store_to_host(token_ids, torch.empty(num_reqs, dtype=token_ids.dtype,
                                                 pin_memory=True))


def _warm_block_copies(kv_cache: torch.Tensor) -> None:
    """Block 0 to pinned host memory and back, and block 1 copied over block 0: loads the
    copy paths (and compiles the copy kernel). Runs at start, while no GPU block is in use
    (the tiers keep their data in host memory and on disk, never in the GPU pool)."""
    from kvtier.kernels import copy_blocks, swap_blocks

    mapping = torch.zeros((1, 2), dtype=torch.int64)  # block 0 <-> host slot 0
    host = torch.empty((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype).pin_memory()
    swap_blocks(kv_cache, host, mapping)
    swap_blocks(host, kv_cache, mapping)
    if kv_cache.shape[0] > 1:
        copy_blocks(kv_cache, torch.tensor([[1, 0]], dtype=torch.int64))


def _cudnn_min_tokens(model: torch.nn.Module) -> int | None:
    """The fewest query tokens of a step the cudnn backend takes; None with another one."""
    if not steps_through_cudnn(model):
        return None
    from kvtier.kernels import cudnn_backend

    return cudnn_backend.MIN_STEP_TOKENS


def _build_attention_graphs(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                            max_num_batched_tokens: int, max_num_seqs: int,
                            max_model_len: int) -> int:
    """With the cudnn attention backend: build the cuDNN graph of every request bucket a
    prefill step can reach (1.7 s for the first, which loads cuDNN's kernels). Returns how
    many were built (0 with any other backend)."""
    if not steps_through_cudnn(model):
        return 0
    from kvtier.kernels import cudnn_backend

    attn = next(m for m in model.modules() if isinstance(m, PagedAttention))
    k_cache, v_cache = layer_views(kv_cache, 0)
    shapes = cudnn_backend.reachable_shapes(max_num_batched_tokens, max_num_seqs,
                                            max_model_len, block_size)
    return cudnn_backend.build_graphs(shapes, attn.num_heads, k_cache, v_cache,
                                      attn.softmax_scale)


def warm_up(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
            max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
            graph_seconds: float = 0.0, num_graphs: int = 0) -> WarmupReport:
    """Run every warm-up step on `model` over `kv_cache` (CUDA only), log one line with the
    time taken, and return the report. `graph_seconds` / `num_graphs`: the decode graphs
    the runner recorded at start, reported in the same line."""
    assert kv_cache.device.type == "cuda", "warm-up compiles GPU kernels; skip it elsewhere"
    start = time.perf_counter()
    steps = warmup_steps(max_num_batched_tokens, max_num_seqs, max_model_len,
                         _cudnn_min_tokens(model))
    num_attention_graphs = _build_attention_graphs(model, kv_cache, block_size,
                                                   max_num_batched_tokens, max_num_seqs,
                                                   max_model_len)
    run_steps(model, kv_cache, block_size, steps)
    _warm_block_copies(kv_cache)
    timed = [steps[0]]
    budget = steps[0].q_lens[0]
    if 2 * budget < max_model_len:
        timed.append(WarmupStep("prefill after as long a context", (budget,), (2 * budget,)))
    prefill_steps = tuple(time_prefill(model, kv_cache, block_size, step) for step in timed)
    torch.cuda.synchronize(kv_cache.device)
    report = WarmupReport(steps=tuple(s.name for s in steps) + ("block copies",),
                          step_seconds=time.perf_counter() - start,
                          graph_seconds=graph_seconds, num_graphs=num_graphs,
                          triton_cache_dir=os.environ.get("TRITON_CACHE_DIR", ""),
                          prefill_steps=prefill_steps,
                          num_attention_graphs=num_attention_graphs)
    logger.info("warm-up: %d step shapes, %d CUDA graphs and %d cuDNN attention graphs ready "
                "in %.1f s (steps %.1f s, graphs %.1f s, prefill %.0f tokens/s); Triton "
                "cache %s", len(report.steps), num_graphs, num_attention_graphs,
                report.seconds, report.step_seconds, graph_seconds,
                report.prefill_tokens_per_s, report.triton_cache_dir)
    return report


def prepare_gpu(runner: ModelRunner, config: EngineConfig, graph_max_len: int,
                max_model_len: int) -> WarmupReport | None:
    """Before the first request, on CUDA: record `runner`'s decode graphs (up to
    `graph_max_len` tokens, when `config` asks for them and the attention backend can be
    captured), then warm up (when `config.warmup`). Returns the warm-up report, or None when
    nothing was warmed up (not CUDA, or warm-up off)."""
    if runner.device.type != "cuda":
        return None
    if config.cuda_graphs and getattr(runner.model, "attn_backend", None) in GRAPH_BACKENDS:
        # Recorded at start (a few seconds at most), not inside the first decode steps.
        runner.enable_cuda_graphs(config.max_num_seqs, graph_max_len)
    if not config.warmup:
        return None
    graphs = runner.graphs
    return warm_up(runner.model, runner.kv_cache, runner.block_size,
                   config.max_num_batched_tokens, config.max_num_seqs, max_model_len,
                   graph_seconds=graphs.capture_seconds if graphs else 0.0,
                   num_graphs=len(graphs.buckets) if graphs else 0)


@torch.inference_mode()
def time_prefill(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 step: WarmupStep) -> tuple[int, int, float]:
    """(tokens, keys attended to, seconds) of `step` (prompt chunks, already run once) run
    once more on `kv_cache`'s device, timed by CUDA events there and by the wall clock on
    the CPU; stores nothing."""
    input_ids, positions, metadata = _step_inputs(step, block_size, kv_cache.device)
    num_keys = sum(prefill_keys(q, s - q) for q, s in zip(step.q_lens, step.seq_lens))
    if kv_cache.device.type != "cuda":
        start = time.perf_counter()
        model.forward(input_ids, positions, kv_cache, metadata)
        return sum(step.q_lens), num_keys, time.perf_counter() - start
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    model.forward(input_ids, positions, kv_cache, metadata)
    end.record()
    end.synchronize()
    return sum(step.q_lens), num_keys, begin.elapsed_time(end) / 1e3


@torch.inference_mode()
def time_cpu_prefill(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                     max_num_batched_tokens: int, max_model_len: int,
                     ) -> tuple[tuple[int, int, float], ...]:
    """On the CPU, where nothing is compiled at start: one fresh prompt chunk of
    `CPU_TIMED_TOKENS` (at most the step's budget, shorter than the model's length) run once
    with a decode (the first forward also pays for torch's first allocations), then timed.
    Its (tokens, keys, seconds) seed the restore gate's start rate
    (`RestoreGate.start_rate`), so a fresh engine's first restore is weighed against
    computing: without it the gate reads every prefix, however short, until a step of
    `step_timer.MIN_TIMED_TOKENS` has run. Stores nothing."""
    num_tokens = max(1, min(max_num_batched_tokens, CPU_TIMED_TOKENS, max_model_len - 1))
    step = WarmupStep("prefill", (num_tokens,), (num_tokens,))
    decode = WarmupStep("decode", (1,), (min(17, max(1, max_model_len - 1)),))
    run_steps(model, kv_cache, block_size, [step, decode])
    return (time_prefill(model, kv_cache, block_size, step),)
