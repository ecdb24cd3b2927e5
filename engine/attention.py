"""The attention layer over the paged KV cache, and the metadata that drives it.

Every decoder layer calls `PagedAttention.forward`: it writes the new tokens' K/V into the
layer's cache views through `slot_mapping` (store_kv), then runs causal varlen attention of
the batch's queries over each request's block table (paged_attention). The metadata is built
once per step by the model runner and passed explicitly; there is no global context.

Backends (chosen once, at construction):
    "torch"  kernels.reference: pure torch, the CPU default and the reference in tests.
    "triton" kernels.store_kv / kernels.paged_attention: the GPU default without cuDNN.
    "cudnn"  kernels.cudnn_backend: prefill steps through cuDNN's fused paged attention,
             decodes through the Triton kernel; the GPU default when nvidia-cudnn-frontend
             is installed and cuDNN is >= 9.6.
    "flash"  kernels.flash_backend (flash-attn): CUDA only, block sizes divisible by 256.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

ATTN_BACKENDS = ("torch", "triton", "cudnn", "flash")
#: Backends whose decode steps run the Triton kernel, so they can be captured in CUDA graphs.
GRAPH_BACKENDS = ("triton", "cudnn")

#: Upstream flash-attn 2's paged KV path needs the page (block) size divisible by this.
FLASH_BLOCK_MULTIPLE = 256


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where one step's tokens sit in the paged cache (all tensors on the model's device).

    query_start_loc: [num_reqs + 1] int32, cu_seqlens of the queries (padded with its last
        value); request r's queries are tokens query_start_loc[r]:query_start_loc[r+1].
    seq_lens: [num_reqs] int32, tokens of each request in the cache after this step; its
        queries are the last q_len of them.
    block_tables: [num_reqs, max_blocks_per_req] int32, GPU block ids (unused entries 0).
    slot_mapping: [num_tokens] int64, `block_id * block_size + offset` for each new token's
        K/V; -1 = do not store.
    max_query_len, max_seq_len: host-side maxima over the requests.
    derived: what a backend derives from these fields once per step and every layer reuses
        (the cudnn backend's padded lengths and tables); filled on first use. The fields
        above are never modified after construction, so it stays true to them.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def select_backend(device: torch.device | str, block_size: int, requested: str = "auto") -> str:
    """The attention backend to use on `device` for caches of `block_size` tokens per block.

    "auto" picks "torch" on the CPU, and on CUDA "cudnn" when nvidia-cudnn-frontend is
    installed with cuDNN >= 9.6, else "triton" (flash is only used when asked for). Raises
    ValueError when `requested` is unknown or impossible here: "triton" without CUDA (unless
    TRITON_INTERPRET=1, the slow CPU interpreter used in tests), "cudnn" without CUDA or
    the frontend, "flash" without CUDA, without flash-attn installed, or with a block size
    it cannot page.
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if requested == "auto":
        if not on_cuda:
            return "torch"
        return "cudnn" if _cudnn_available() else "triton"
    if requested == "torch":
        return "torch"
    if requested == "triton":
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton attention backend needs a CUDA device, got {device}; "
                             "use attn_backend='torch' on the CPU")
        return "triton"
    if requested == "cudnn":
        if not on_cuda:
            raise ValueError(f"the cudnn attention backend needs a CUDA device, got {device}; "
                             "use 'torch' on the CPU")
        if not _cudnn_available():
            raise ValueError("the cudnn attention backend needs nvidia-cudnn-frontend and "
                             "cuDNN >= 9.6 on an Ampere or newer GPU (pip install "
                             "'kvtier[cudnn]'); or use 'triton'")
        return "cudnn"
    if requested == "flash":
        if not on_cuda:
            raise ValueError(f"the flash attention backend needs a CUDA device, got {device}; "
                             "use 'torch' on the CPU")
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError("attn_backend='flash' needs the flash-attn package "
                             "(pip install 'kvtier[flash]'); or use 'triton'")
        if block_size % FLASH_BLOCK_MULTIPLE != 0:
            raise ValueError(f"flash-attn pages KV in blocks that are multiples of "
                             f"{FLASH_BLOCK_MULTIPLE} tokens, got block_size={block_size}; "
                             "use attn_backend='triton' or a block size like 256")
        return "flash"
    raise ValueError(f"unknown attention backend {requested!r}; use 'auto' or one of "
                     f"{ATTN_BACKENDS}")


def steps_through_cudnn(model: torch.nn.Module) -> bool:
    """Whether `model`'s prefill steps run cuDNN now: its backend is "cudnn" and the
    deterministic mode, which attends through its own Triton kernel, is off."""
    return (getattr(model, "attn_backend", None) == "cudnn"
            and not getattr(model, "deterministic", False))


def _cudnn_available() -> bool:
    return importlib.import_module("kvtier.kernels.cudnn_backend").cudnn_available()


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float],
                  torch.Tensor]


def _attend_with(paged_attention: Callable[..., torch.Tensor],
                 shares_derived: bool = False) -> Attend:
    """attend(query, k_cache, v_cache, metadata, softmax_scale) over a backend's
    `paged_attention`; `shares_derived`: it also takes the step's `derived` dict."""
    def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               md: AttentionMetadata, softmax_scale: float) -> torch.Tensor:
        per_step = {"step_cache": md.derived} if shares_derived else {}
        return paged_attention(query, k_cache, v_cache, md.query_start_loc, md.seq_lens,
                               md.block_tables, md.max_query_len, md.max_seq_len,
                               softmax_scale, **per_step)
    return attend


def _backend_functions(backend: str) -> tuple[Callable[..., None], Attend]:
    """(store_kv, attend) of a backend, imported on first use."""
    if backend == "torch":
        reference = importlib.import_module("kvtier.kernels.reference")
        return reference.store_kv, _attend_with(reference.paged_attention)
    if backend == "triton":
        store = importlib.import_module("kvtier.kernels.store_kv")
        attend = importlib.import_module("kvtier.kernels.paged_attention")
        return store.store_kv, _attend_with(attend.paged_attention)
    if backend == "cudnn":
        store = importlib.import_module("kvtier.kernels.store_kv")
        cudnn_backend = importlib.import_module("kvtier.kernels.cudnn_backend")
        return store.store_kv, _attend_with(cudnn_backend.paged_attention, shares_derived=True)
    if backend == "flash":
        store = importlib.import_module("kvtier.kernels.store_kv")
        flash = importlib.import_module("kvtier.kernels.flash_backend")
        return store.store_kv, _attend_with(flash.paged_attention)
    raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTN_BACKENDS}")


def _invariant_attend(backend: str) -> Attend:
    """attend() of the deterministic mode: `invariant_attention`, whose every query row is
    the same bits whatever its batch and chunk (the Triton kernel on the GPU backends, its
    torch version for "torch"). It reads all keys through the paged cache, so cached and
    newly stored keys are reduced alike."""
    if backend == "torch":
        reference = importlib.import_module("kvtier.kernels.reference")
        return _attend_with(reference.invariant_attention)
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTN_BACKENDS}")
    invariant = importlib.import_module("kvtier.kernels.invariant_attention")
    return _attend_with(invariant.invariant_attention)


class PagedAttention(nn.Module):
    """Store new K/V into the paged cache, then attend causally over it (no weights).

    Queries carry `num_heads` heads, keys/values `num_kv_heads` (GQA: query head h reads kv
    head h // (num_heads // num_kv_heads)). `softmax_scale` defaults to head_dim ** -0.5.
    Raises ValueError for an unknown backend or heads that do not divide.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: str = "torch", softmax_scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = backend
        self.softmax_scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        self._store_kv, self._attend = _backend_functions(backend)
        self.deterministic = False

    def set_deterministic(self, on: bool) -> None:
        """Attend through the batch-invariant kernel (on) or the backend's own (off)."""
        self._attend = (_invariant_attend(self.backend) if on
                        else _backend_functions(self.backend)[1])
        self.deterministic = on

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim]; k_cache/v_cache: one layer's views [num_blocks, block_size, num_kv_heads,
        head_dim]. Returns [num_tokens, num_heads, head_dim] in the query's dtype."""
        assert query.shape[1:] == (self.num_heads, self.head_dim), \
            f"query heads {tuple(query.shape[1:])} != {(self.num_heads, self.head_dim)}"
        assert key.shape[1:] == (self.num_kv_heads, self.head_dim), \
            f"key heads {tuple(key.shape[1:])} != {(self.num_kv_heads, self.head_dim)}"
        self._store_kv(key, value, k_cache, v_cache, attn_metadata.slot_mapping)
        return self._attend(query, k_cache, v_cache, attn_metadata, self.softmax_scale)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend!r}, "
                f"deterministic={self.deterministic}")
