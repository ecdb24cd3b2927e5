"""copy_blocks: whole-block copies inside one cache (copy-on-write of a shared block).

A block of the cross-layer cache is one contiguous span, so copying it needs no knowledge of
its shape: the kernel sees every block as `words_per_block` machine words (8 bytes when the
block size and alignment allow) and each program copies one `CHUNK`-word slice of one block
with wide vector loads. `kernels.swap_blocks` reuses the same kernel between GPU memory
and pinned host memory (the GPU reaches pinned pages through unified virtual addressing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks

#: Words one program copies per inner step (8 KiB of int64), and per program in total.
TILE_WORDS = 1024
CHUNK_WORDS = 4 * TILE_WORDS


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, block_mapping_ptr, stride_src, stride_dst, words_per_block,
    num_chunks, chunks_per_block,
    CHUNK: tl.constexpr, TILE: tl.constexpr, EVEN: tl.constexpr,
):
    # Programs stride over (pair, chunk) work items, so the grid can be capped: a swap then
    # leaves SMs to the model and to a concurrent swap in the other direction.
    for item in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        pair = item // chunks_per_block
        part = item % chunks_per_block
        src_block = tl.load(block_mapping_ptr + 2 * pair)  # int64
        dst_block = tl.load(block_mapping_ptr + 2 * pair + 1)
        src = src_ptr + src_block * stride_src
        dst = dst_ptr + dst_block * stride_dst
        start = part.to(tl.int64) * CHUNK
        for offset in range(0, CHUNK, TILE):
            words = start + offset + tl.arange(0, TILE)
            if EVEN:
                tl.store(dst + words, tl.load(src + words))
            else:
                in_block = words < words_per_block
                tl.store(dst + words, tl.load(src + words, mask=in_block), mask=in_block)


def as_words(blocks: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """View `[n, *block_shape]` (each block contiguous) as `[n, words_per_block]` integers."""
    flat = blocks.reshape(blocks.shape[0], -1)  # a view: each block is contiguous
    word_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word_bytes]
    return flat.view(torch.uint8).view(word_dtype)


def word_bytes_for(*tensors: torch.Tensor) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every block's size, stride and address."""
    for word in (8, 4, 2, 1):
        if all(t[0].numel() * t.element_size() % word == 0
               and t.stride(0) * t.element_size() % word == 0
               and t.data_ptr() % word == 0 for t in tensors):
            return word
    raise AssertionError("a one-byte word always divides")


def launch_block_copy(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                      max_programs: int | None = None) -> None:
    """Copy blocks `src[m[i, 0]] -> dst[m[i, 1]]` with the Triton kernel on the current stream.

    Internal to copy_blocks / swap_blocks, which have checked shapes, dtypes and devices;
    `block_mapping` must already be readable by the kernel (device, or CPU when interpreting).
    `max_programs` caps the grid (None: one program per chunk).
    """
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0 or src[0].numel() == 0:
        return
    word = word_bytes_for(src, dst)
    src_words, dst_words = as_words(src, word), as_words(dst, word)
    words_per_block = src_words.shape[1]
    chunks_per_block = triton.cdiv(words_per_block, CHUNK_WORDS)
    num_chunks = num_pairs * chunks_per_block
    grid = (min(num_chunks, max_programs or num_chunks),)
    _copy_blocks_kernel[grid](
        src_words, dst_words, block_mapping, src_words.stride(0), dst_words.stride(0),
        words_per_block, num_chunks, chunks_per_block, CHUNK=CHUNK_WORDS, TILE=TILE_WORDS,
        EVEN=words_per_block % CHUNK_WORDS == 0, num_warps=4,
    )


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks inside one cache: `kv_cache[dst] = kv_cache[src]` per mapping row.

    kv_cache: [num_blocks, *block_shape] on CUDA, each block one contiguous span
    block_mapping: [n, 2] int64 rows (src_index, dst_index), on the CPU or on kv_cache's
        device. A destination must not appear twice nor also be a source in the same call
        (the copies run in parallel); a CPU mapping is checked for this and for index
        ranges, a device mapping is trusted (checking it would need a device sync).

    Runs asynchronously on the current stream. Raises ValueError on misuse.
    """
    _checks.check_kernel_device("kv_cache", kv_cache)
    if kv_cache.dim() < 2:
        raise ValueError(f"kv_cache must be [num_blocks, *block_shape], got shape "
                         f"{tuple(kv_cache.shape)}")
    _checks.check_blocks_contiguous("kv_cache", kv_cache)
    num_blocks = kv_cache.shape[0]
    _checks.check_block_mapping(block_mapping, num_blocks, num_blocks)
    if block_mapping.device.type == "cpu":
        sources = set(block_mapping[:, 0].tolist())
        destinations = block_mapping[:, 1].tolist()
        if len(set(destinations)) != len(destinations) or sources & set(destinations):
            raise ValueError("block_mapping destinations must be distinct and must not also be "
                             "sources in the same call; split the copies into two calls")
        block_mapping = block_mapping.to(kv_cache.device, non_blocking=True)
    elif block_mapping.device != kv_cache.device:
        raise ValueError(f"block_mapping is on {block_mapping.device}, kv_cache on "
                         f"{kv_cache.device}; pass it on the CPU or on the cache's device")
    launch_block_copy(kv_cache, kv_cache, block_mapping.contiguous())
