"""Building an engine from its settings: the model loaded (or taken as given) on its device,
the GPU pool and tiers sized, the scheduler and model runner around them, the warm-up run.

`LLM` (kvtier.engine.llm) runs requests over what `assemble` returns; keeping the building
here leaves that class to the requests' life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from kvtier.engine import sizing
from kvtier.engine.attention import select_backend
from kvtier.engine.cpu_threads import leave_a_core_to_io
from kvtier.engine.engine_config import EngineConfig
from kvtier.engine.loader import (
    LoadedModel,
    check_loaded,
    load_model,
    resolve_device,
    resolve_device_dtype,
)
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.request import Request
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.warmup import WarmupReport, prepare_gpu, time_cpu_prefill, use_user_triton_cache

from kvtier.cuda_device import bind_thread
from kvtier.layout import KVLayout
from kvtier.manager import TierManager

#: Picks each request's next token from a step's logits `[num_requests, vocab]`.
Sample = Callable[[torch.Tensor, Sequence[Request]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What `assemble` built. max_model_len: the longest sequence a request may reach;
    warmup_report: the CUDA warm-up's (None when it did not run)."""

    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    layout: KVLayout
    num_gpu_blocks: int
    manager: TierManager
    scheduler: Scheduler
    runner: ModelRunner
    warmup_report: WarmupReport | None


def assemble(cfg: EngineConfig, model: LoadedModel | None,
             device: str | torch.device | None, dtype: str | torch.dtype | None,
             sample: Sample) -> EngineParts:
    """The parts of an engine for `cfg`. model: an already loaded model to use (its device,
    dtype and attention backend; `device` and `dtype` are checked against it), else
    `cfg.model` is loaded. sample: the runner's sampler. Raises as `LLM` documents."""
    block_size = cfg.block_size
    if cfg.warmup and torch.cuda.is_available():
        use_user_triton_cache()  # before anything compiles, so a second start is fast
    if model is not None:
        loaded = model
        run_device, run_dtype = check_loaded(loaded, device or "auto", dtype or "auto")
    else:
        run_device, run_dtype = resolve_device_dtype(resolve_device(cfg.device), cfg.dtype)
        backend = select_backend(run_device, block_size, cfg.attn_backend)
        if cfg.deterministic and backend in ("cudnn", "flash"):
            backend = "triton"  # the mode attends through its own Triton kernel anyway
        loaded = load_model(cfg.model, run_device, run_dtype, attn_backend=backend)
    bind_thread(run_device)  # what follows (cache, warm-up) launches there
    max_model_len = sizing.max_model_len(cfg.max_model_len,
                                         loaded.config.max_position_embeddings)
    layout = loaded.config.kv_layout(block_size, run_dtype)
    num_gpu_blocks = sizing.num_gpu_blocks(cfg, max_model_len, run_device, layout)
    manager = TierManager(layout, sizing.tier_config(cfg, num_gpu_blocks, layout), run_device)
    if run_device.type == "cpu":
        leave_a_core_to_io()  # the model shares the cores with the tiers' I/O threads
    scheduler = Scheduler(
        manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
        min_restore_saving_s=cfg.restore_min_saving_s,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold)
    runner = ModelRunner(loaded.model, manager.kv_cache, block_size, sample,
                         deterministic=cfg.deterministic)
    warmup_report = prepare_gpu(runner, cfg, min(max_model_len, num_gpu_blocks * block_size),
                                max_model_len)
    if warmup_report is not None:
        # The first restore after start is sized with the model's rate, as later ones.
        scheduler.prefill_rate.observe_steps(warmup_report.prefill_steps)
    elif cfg.warmup and run_device.type == "cpu" and manager.lower_tiers:
        # Whether the first restore reads the slow tiers at all (only they are gated).
        scheduler.gate.start_rate.observe_steps(time_cpu_prefill(
            loaded.model, manager.kv_cache, block_size, cfg.max_num_batched_tokens,
            max_model_len))
    return EngineParts(loaded, run_device, run_dtype, max_model_len, layout, num_gpu_blocks,
                       manager, scheduler, runner, warmup_report)
