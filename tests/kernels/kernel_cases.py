"""Builders shared by the kernel tests: paged batches with known contiguous K/V.

Every cache is a cross-layer cache `[num_blocks, num_layers, 2, block_size, heads, dim]`
poisoned with NaN and filled through the reference store_kv, so a kernel that reads a slot
nobody wrote, or a block outside a request's table, turns its output into NaN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from kvtier.kernels import reference

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Tests of Triton kernels on CPU tensors need the interpreter.
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1")
#: GPU tests carry @pytest.mark.gpu and this, so they skip cleanly without CUDA.
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass(slots=True)
class AttentionCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], rows past the last request unused
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] layer view
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], as cached
    values: list[torch.Tensor]
    q_lens: list[int]

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                self.block_tables, self.max_query_len, self.max_seq_len)


def build_attention_case(seq_lens: list[int], q_lens: list[int], *, num_kv_heads: int,
                         group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                         device: str, seed: int = 0, extra_rows: int = 2,
                         num_layers: int = 2, layer: int = 1,
                         poison: float = float("nan")) -> AttentionCase:
    """A batch whose request r has seq_lens[r] cached tokens and queries the last q_lens[r].

    Blocks are a random permutation (so tables are scattered), one spare block stays
    unused, and `extra_rows` query rows follow the last request (they must stay unwritten).
    Slots nobody wrote hold `poison`.
    """
    assert len(seq_lens) == len(q_lens), "one q_len per request"
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    cache = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim),
                       poison, dtype=dtype, device=device)
    k_cache, v_cache = cache[:, layer, 0], cache[:, layer, 1]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros((len(seq_lens), max(1, max(blocks_per_req))), dtype=torch.int32)
    keys, values = [], []
    used = 0
    for r, seq_len in enumerate(seq_lens):
        table = order[used:used + blocks_per_req[r]]
        used += blocks_per_req[r]
        block_tables[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size
                              for i in range(seq_len)], dtype=torch.int64)
        reference.store_kv(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))
        keys.append(k)
        values.append(v)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    num_tokens = starts[-1] + extra_rows
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=generator)
    return AttentionCase(
        query=query.to(dtype).to(device), k_cache=k_cache, v_cache=v_cache,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), keys=keys, values=values, q_lens=list(q_lens))


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))
