"""How large an engine's KV pool and tiers are: the context it serves, the GPU blocks it
allocates (from free device memory, or from the context on the CPU) and the `TierConfig` of
its host, disk and remote tiers, all from an `EngineConfig`."""

from __future__ import annotations

from pathlib import Path

import torch
from kvtier.engine.engine_config import EngineConfig, default_disk_cache_dir

from kvtier.config import TierConfig
from kvtier.layout import KVLayout


def max_model_len(asked: int | None, model_context: int) -> int:
    """The engine's context: the model's, or less when `max_model_len` asks for less."""
    if asked is None:
        return model_context
    if asked > model_context:
        raise ValueError(f"max_model_len={asked} exceeds the model's context of "
                         f"{model_context} tokens; lower it or leave it unset")
    return asked


def cpu_pool_blocks(blocks_per_seq: int, max_num_seqs: int) -> int:
    """KV blocks of the pool on the CPU, where the "device" memory is the machine's RAM.

    Sized from the context and the batch, not from free RAM: one sequence at the full
    context (`blocks_per_seq` blocks) plus one block per other sequence of the batch for its
    decode tail. Longer batches preempt and come back through the tiers; pass `gpu_blocks`
    or lower `max_model_len` to change it.
    """
    return blocks_per_seq + max_num_seqs - 1


def num_gpu_blocks(config: EngineConfig, context: int, device: torch.device,
                   layout: KVLayout) -> int:
    """The pool's blocks: `config.gpu_blocks` when given; on CUDA, the share
    `gpu_memory_utilization` of the free memory, at most what every running sequence at
    `context` tokens could use; on the CPU, `cpu_pool_blocks`. Raises ValueError when the
    share holds no block."""
    if config.gpu_blocks is not None:
        return config.gpu_blocks
    blocks_per_seq = -(-context // config.block_size)
    if device.type != "cuda":
        return cpu_pool_blocks(blocks_per_seq, config.max_num_seqs)
    free_bytes, _ = torch.cuda.mem_get_info(device)
    num_blocks = int(free_bytes * config.gpu_memory_utilization) // layout.bytes_per_block
    # More than every running sequence at full context could ever use is wasted memory.
    num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
    if num_blocks < 1:
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} of the "
                         f"free memory holds no {layout.bytes_per_block}-byte block; raise "
                         "it or pass gpu_blocks")
    return num_blocks


def tier_config(config: EngineConfig, gpu_blocks: int, layout: KVLayout) -> TierConfig:
    """The tiers below the GPU pool of `gpu_blocks` blocks. Raises ValueError when the host
    budget holds no block."""
    host_bytes = config.host_cache_bytes
    if host_bytes and host_bytes < layout.bytes_per_block:
        raise ValueError(f"host_cache_gb={config.host_cache_gb} is smaller than one block "
                         f"({layout.bytes_per_block} bytes); raise it or turn the host "
                         "cache off")
    disk_path = None
    if config.disk_cache:
        disk_path = Path(config.disk_cache_dir) if config.disk_cache_dir is not None \
            else default_disk_cache_dir()
    return TierConfig(num_gpu_blocks=gpu_blocks, host_capacity_bytes=host_bytes,
                      disk_path=disk_path,
                      disk_budget_bytes=config.disk_cache_bytes if disk_path else None,
                      disk_durable=config.disk_durable, disk_shards=config.disk_shards,
                      disk_worker=config.disk_worker,
                      read_reserve_share=config.read_reserve_share,
                      remote=config.remote_config)
