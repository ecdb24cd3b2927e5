"""Triton kernels for the paged KV cache.

Each kernel comes as a triad: a `@triton.jit` kernel, the launcher exported here (it checks
dtype, device, shapes and strides and raises ValueError on misuse), and a pure-torch
version in `kernels.reference`, which is the CPU path and the ground truth in tests.
Only torch and triton are imported.
"""

from kvtier.kernels import reference
from kvtier.kernels.copy_blocks import copy_blocks
from kvtier.kernels.flash_backend import flash_available
from kvtier.kernels.flash_backend import paged_attention as flash_paged_attention
from kvtier.kernels.host_store import load_from_host, store_to_host
from kvtier.kernels.invariant_attention import invariant_attention
from kvtier.kernels.invariant_linear import invariant_linear
from kvtier.kernels.layer_ops import rms_norm, rotary_embedding_, silu_and_mul
from kvtier.kernels.paged_attention import paged_attention
from kvtier.kernels.paged_decode import AttentionConfig
from kvtier.kernels.store_kv import store_kv
from kvtier.kernels.swap_blocks import SWAP_METHODS, DmaPlan, plan_dma, swap_blocks
from kvtier.kernels.word_checksum import word_checksum

__all__ = [
    "SWAP_METHODS",
    "AttentionConfig",
    "DmaPlan",
    "copy_blocks",
    "flash_available",
    "flash_paged_attention",
    "invariant_attention",
    "invariant_linear",
    "load_from_host",
    "paged_attention",
    "plan_dma",
    "reference",
    "rms_norm",
    "rotary_embedding_",
    "silu_and_mul",
    "store_kv",
    "store_to_host",
    "swap_blocks",
    "word_checksum",
]
