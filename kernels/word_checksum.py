"""word_checksum: a checksum of each row of bytes, computed where the bytes are.

The handoff checks every block it moves on both GPUs (over NCCL and CUDA IPC). The
checksum is the sum of a row's 32-bit words (sign-extended) weighted 2i+1 for word i,
modulo 2**64: any single damaged word changes it, and integer sums give the same bits in
any order, so this kernel, `reference.word_checksum` and any device agree. Computed in
torch it widens every word to 64 bits and materialises the weights and the products,
several times the row's bytes of memory traffic; here each program reads its slice of a
row once and writes one partial sum.
Given `row_ids`, it reads the rows where they are (blocks of a KV cache), so a transport
that copies blocks in place need not gather them first to check them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks

#: Words a program reads per step, and per program in total (256 KiB of a row).
TILE_WORDS = 4096
WORDS_PER_PROGRAM = 16 * TILE_WORDS


@triton.jit
def _word_checksum_kernel(words_ptr, ids_ptr, partials_ptr, num_words, num_parts,
                          HAS_IDS: tl.constexpr, TILE: tl.constexpr, PART: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    source = tl.load(ids_ptr + row) if HAS_IDS else row.to(tl.int64)
    base = words_ptr + source * num_words
    total = tl.zeros((TILE,), dtype=tl.int64)
    for offset in range(0, PART, TILE):
        index = part.to(tl.int64) * PART + offset + tl.arange(0, TILE)
        word = tl.load(base + index, mask=index < num_words, other=0).to(tl.int64)
        total += word * (2 * index + 1)  # wraps modulo 2**64, as the reference's sum does
    tl.store(partials_ptr + row.to(tl.int64) * num_parts + part, tl.sum(total, axis=0))


def word_checksum(rows: torch.Tensor, row_ids: Sequence[int] | None = None) -> torch.Tensor:
    """Per row of `rows` (uint8 `[N, nbytes]`, contiguous, nbytes a multiple of 4), or per
    row `row_ids` names (each in [0, N), given on the host), the weighted word sum described
    in the module docstring, as int64 `[len]` (two's complement of the unsigned value) on
    the rows' device. Raises ValueError for other input."""
    _checks.check_kernel_device("rows", rows)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous uint8 [n, nbytes] tensor, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if rows.shape[1] % 4:
        raise ValueError(f"a row must hold whole 32-bit words, got {rows.shape[1]} bytes")
    ids = None
    if row_ids is not None:
        # Checked here: a row out of range would read another allocation's memory.
        if any(not 0 <= i < rows.shape[0] for i in row_ids):
            raise ValueError(f"row_ids must lie in [0, {rows.shape[0]})")
        # [n] int64, copied on the current stream (the kernel's): from pageable memory,
        # without waiting for the stream's queued work
        ids = torch.tensor(list(row_ids), dtype=torch.int64).to(rows.device, non_blocking=True)
    num_rows = rows.shape[0] if ids is None else ids.shape[0]
    num_words = rows.shape[1] // 4
    num_parts = max(1, triton.cdiv(num_words, WORDS_PER_PROGRAM))
    # [n, num_parts] int64: one partial sum per program
    partials = torch.empty((num_rows, num_parts), dtype=torch.int64, device=rows.device)
    if num_rows == 0:
        return partials.sum(dim=1)
    if num_words == 0:
        return partials.zero_().sum(dim=1)
    _word_checksum_kernel[(num_rows, num_parts)](
        rows.view(torch.int32), ids if ids is not None else partials, partials,
        num_words, num_parts, HAS_IDS=ids is not None, TILE=TILE_WORDS,
        PART=WORDS_PER_PROGRAM)
    return partials.sum(dim=1)
