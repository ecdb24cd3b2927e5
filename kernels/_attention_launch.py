"""Prepared launches of paged_attention: the per-call host work done once per geometry.

A model calls `paged_attention` once per layer per step with the same shapes, strides and
dtypes, only on different tensors. The first call with a geometry takes the full path
(argument checks, tiling choice, split-KV scratch, Triton's JIT binding); afterwards the
launcher finds a `PreparedAttention` for the same geometry and tiling here and launches the
compiled kernels through their handles (`kernels._compiled_launch`), reusing scratch kept per
CUDA stream. Anything that differs (a dtype, a stride, a device, a new shape, a pointer not
16-byte aligned, the Triton interpreter) misses and takes the full path, which prepares the
new geometry after its launch.

`call_key` lists every fact the argument checks and Triton's specialisation depend on, so a
hit implies the call is valid and runs the same compiled kernels. What it leaves out changes
from step to step without touching either: the data, the block table's width (its row
stride is an unspecialised argument), max_seq_len (it only picks the tiling, which is the
second key).

`PreparedLaunches` is a bounded memo of pure functions of the call geometry (like an lru
cache), not context: dropping it at any time only costs the next calls the full path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
from kvtier.kernels._compiled_launch import CompiledLaunch
from kvtier.kernels.paged_decode import AttentionConfig, pick_config, split_scratch

#: Geometries kept before the memo is dropped and refilled (a model reaches a few dozen:
#: decode batch sizes, prefill chunk lengths, CUDA graph buckets).
MAX_GEOMETRIES = 512
#: Split-KV scratch kept for reuse, in bytes over all geometries and streams (a batch-1
#: decode of a 32K context needs 1 MiB); beyond it scratch is allocated per call.
MAX_SCRATCH_BYTES = 64 << 20


def call_key(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
             out: torch.Tensor | None) -> tuple | None:
    """The geometry of a paged_attention call (shapes, strides, dtypes, devices), or None
    when it cannot be prepared (a pointer not 16-byte aligned, block tables not 2-D)."""
    if block_tables.dim() != 2:
        return None
    pointers = (query.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
                | query_start_loc.data_ptr() | seq_lens.data_ptr() | block_tables.data_ptr())
    out_key = None
    if out is not None:
        pointers |= out.data_ptr()
        out_key = (out.shape, out.stride(), out.dtype, out.get_device())
    if pointers & 15:
        return None
    return (query.shape, query.stride(), query.dtype, query.get_device(),
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(),
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
            query_start_loc.shape, query_start_loc.stride(), query_start_loc.dtype,
            query_start_loc.get_device(), seq_lens.shape, seq_lens.stride(), seq_lens.dtype,
            seq_lens.get_device(), block_tables.shape[0], block_tables.stride(1),
            block_tables.dtype, block_tables.get_device(), out_key)


@dataclass(slots=True)
class PreparedAttention:
    """One geometry and tiling, ready to launch: the compiled attention kernel (and the
    split merge), the arguments that depend only on the geometry, and scratch per stream.

    attention_head: the kernel's arguments after qk_scale up to the block table's row
    stride; attention_tail: the ones after it. reduce_tail: the merge's arguments after its
    four tensors. scratch_shape: (num_splits, num_tokens, num_heads, head_dim).
    """

    device_index: int
    attention: CompiledLaunch
    attention_head: tuple
    attention_tail: tuple
    reduce: CompiledLaunch | None
    reduce_tail: tuple
    scratch_shape: tuple[int, int, int, int]
    memo: PreparedLaunches
    get_stream: Callable[[int], int]  # device index -> the current stream's handle
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def launch(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor, qk_scale: float,
               out: torch.Tensor | None) -> torch.Tensor | None:
        """Launch on the current stream; None (nothing launched) when the current device is
        not the one this was prepared on."""
        if torch.cuda.current_device() != self.device_index:
            return None
        stream = self.get_stream(self.device_index)
        if out is None:
            out = torch.empty_like(query)
        if self.reduce is None:
            part_out = part_lse = out  # never read or written without split-KV
        else:
            part_out, part_lse = self._scratch(stream, query.device)
        self.attention(stream, (query, k_cache, v_cache, out, part_out, part_lse,
                                query_start_loc, seq_lens, block_tables, qk_scale,
                                *self.attention_head, block_tables.stride(0),
                                *self.attention_tail))
        if self.reduce is not None:
            self.reduce(stream, (part_out, part_lse, out, query_start_loc, *self.reduce_tail))
        return out

    def _scratch(self, stream: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.scratch.get(stream)
        if kept is not None:
            return kept
        parts = split_scratch(*self.scratch_shape, device=device)
        # A graph captured now must own its scratch (the memo may drop ours while the
        # graph still replays); kept scratch is used only by launches on its own stream,
        # which the stream orders.
        if not torch.cuda.is_current_stream_capturing() and self.memo.keep_scratch(parts):
            self.scratch[stream] = parts
        return parts


@dataclass(slots=True)
class _Geometry:
    """What pick_config needs, read once from a geometry, and its prepared tilings."""

    device: torch.device
    dtype: torch.dtype
    num_tokens: int
    num_reqs: int
    num_kv_heads: int
    group: int
    head_dim: int
    tilings: dict[AttentionConfig, PreparedAttention] = field(default_factory=dict)


@dataclass(slots=True)
class PreparedLaunches:
    """Prepared paged_attention launches by geometry and tiling (see the module doc).

    hits / misses count lookups, for tests and benchmarks.
    """

    max_geometries: int = MAX_GEOMETRIES
    max_scratch_bytes: int = MAX_SCRATCH_BYTES
    geometries: dict[tuple, _Geometry] = field(default_factory=dict)
    scratch_bytes: int = 0
    hits: int = 0
    misses: int = 0

    def lookup(self, key: tuple, config: AttentionConfig | None, max_query_len: int,
               max_seq_len: int) -> PreparedAttention | None:
        """The prepared launch for a call of geometry `key` with `config` (None: the tiling
        pick_config chooses for these maxima), or None."""
        geometry = self.geometries.get(key)
        if geometry is None:
            self.misses += 1
            return None
        if config is None:
            config = pick_config(geometry.device, geometry.dtype, geometry.num_tokens,
                                 geometry.num_reqs, geometry.num_kv_heads, geometry.group,
                                 geometry.head_dim, max_query_len, max_seq_len)
        prepared = geometry.tilings.get(config)
        if prepared is None:
            self.misses += 1
        else:
            self.hits += 1
        return prepared

    def record(self, key: tuple, query: torch.Tensor, num_reqs: int, num_kv_heads: int,
               config: AttentionConfig, attention: tuple, reduce: tuple | None) -> None:
        """Prepare the launch the full path just made. attention: (compiled, grid, args) of
        the attention kernel; reduce: the same of the split merge, None without split-KV.
        Does nothing when Triton offers no handle to launch through."""
        compiled, grid, args = attention
        attention_launch = CompiledLaunch.of(compiled, grid)
        reduce_launch, reduce_tail = None, ()
        if reduce is not None:
            reduce_launch = CompiledLaunch.of(reduce[0], reduce[1])
            reduce_tail = reduce[2][4:]
            if reduce_launch is None:
                return
        if attention_launch is None:
            return
        if len(self.geometries) >= self.max_geometries:
            self.clear()
        geometry = self.geometries.get(key)
        if geometry is None:
            num_tokens, num_heads, head_dim = query.shape
            geometry = _Geometry(query.device, query.dtype, num_tokens, num_reqs,
                                 num_kv_heads, num_heads // num_kv_heads, head_dim)
            self.geometries[key] = geometry
        # args: 9 tensors, qk_scale, 12 geometry integers, the block table's row stride,
        # then strides of the scratch and the constexprs.
        geometry.tilings[config] = PreparedAttention(
            device_index=torch.cuda.current_device(), attention=attention_launch,
            attention_head=tuple(args[10:22]), attention_tail=tuple(args[23:]),
            reduce=reduce_launch, reduce_tail=tuple(reduce_tail),
            scratch_shape=(config.num_splits, *query.shape), memo=self,
            get_stream=triton.runtime.driver.active.get_current_stream)

    def keep_scratch(self, parts: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether scratch of this size fits the budget (and count it if so)."""
        size = sum(t.numel() * t.element_size() for t in parts)
        if self.scratch_bytes + size > self.max_scratch_bytes:
            return False
        self.scratch_bytes += size
        return True

    def clear(self) -> None:
        """Drop every prepared launch and the scratch kept for them."""
        self.geometries.clear()
        self.scratch_bytes = 0
