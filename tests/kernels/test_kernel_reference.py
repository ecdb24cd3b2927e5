"""The pure-torch reference kernels against plainly written versions of the same math."""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import reference


def naive_attention(case: cases.AttentionCase, scale: float) -> list[torch.Tensor]:
    """Per request: contiguous K/V, every query head against its kv head, explicit causal
    mask, float64. Returns each request's [q_len, num_heads, head_dim] float64 output."""
    num_heads = case.query.shape[1]
    num_kv_heads = case.keys[0].shape[1] if case.keys else 1
    group = num_heads // num_kv_heads
    starts = case.query_start_loc.tolist()
    outputs = []
    for r, seq_len in enumerate(case.seq_lens.tolist()):
        q_len = case.q_lens[r]
        q = case.query[starts[r]:starts[r] + q_len].cpu().double()  # [q_len, heads, d]
        k = case.keys[r].double().repeat_interleave(group, dim=1)  # [seq_len, heads, d]
        v = case.values[r].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return outputs


# Request 0: a whole odd-length prompt; 1: a chunk in the middle of a prompt; 2: a decode;
# 3: padding; 4: a decode of a sequence that ends exactly on a block boundary.
MIXED_SEQ_LENS = [13, 27, 37, 0, 32]
MIXED_Q_LENS = [13, 6, 1, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_attention_matches_naive(dtype: torch.dtype, group: int) -> None:
    case = cases.build_attention_case(MIXED_SEQ_LENS, MIXED_Q_LENS, num_kv_heads=2,
                                      group=group, head_dim=32, block_size=16, dtype=dtype,
                                      device="cpu", seed=group)
    out = cases.poisoned_like(case.query)
    reference.paged_attention(*case.args(), 0.2, out=out)
    starts = case.query_start_loc.tolist()
    for r, expected in enumerate(naive_attention(case, 0.2)):
        got = out[starts[r]:starts[r] + case.q_lens[r]].double()
        torch.testing.assert_close(got, expected, **cases.TOLERANCES[dtype])
    # Rows after the last request are not the reference's to write.
    assert torch.isnan(out[starts[-1]:]).all()


@pytest.mark.parametrize("block_size", [32, 128])
def test_paged_attention_long_chunk_other_block_sizes(block_size: int) -> None:
    # A 150-token chunk after 200 cached tokens, beside a fresh 70-token prompt.
    case = cases.build_attention_case([350, 70], [150, 70], num_kv_heads=1, group=3,
                                      head_dim=16, block_size=block_size,
                                      dtype=torch.float32, device="cpu", seed=block_size)
    out = reference.paged_attention(*case.args(), 0.25)
    expected = torch.cat(naive_attention(case, 0.25))
    torch.testing.assert_close(out[:220].double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_rejects_bad_batches() -> None:
    case = cases.build_attention_case([8], [8], num_kv_heads=2, group=2, head_dim=16,
                                      block_size=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        reference.paged_attention(case.query[:, :3], *case.args()[1:], 1.0)
    too_many = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        reference.paged_attention(case.query, case.k_cache, case.v_cache, too_many,
                                  case.seq_lens, case.block_tables, 9, 8, 1.0)


def test_store_kv_writes_slots_and_skips_minus_one() -> None:
    generator = torch.Generator().manual_seed(3)
    cache = torch.zeros(4, 3, 2, 8, 2, 4)  # [blocks, layers, 2, block_size, kv_heads, dim]
    k_cache, v_cache = cache[:, 2, 0], cache[:, 2, 1]
    key = torch.randn(5, 2, 4, generator=generator)
    value = torch.randn(5, 2, 4, generator=generator)
    slots = torch.tensor([17, -1, 3, 31, -1])
    reference.store_kv(key, value, k_cache, v_cache, slots)
    expected = torch.zeros_like(cache)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 8, 2, 0, slot % 8] = key[token]
            expected[slot // 8, 2, 1, slot % 8] = value[token]
    assert torch.equal(cache, expected)


def test_copy_and_swap_blocks_match_loops() -> None:
    generator = torch.Generator().manual_seed(5)
    cache = torch.randn(6, 2, 3, generator=generator)
    expected = cache.clone()
    mapping = torch.tensor([[0, 4], [2, 5]])
    reference.copy_blocks(cache, mapping)
    for src, dst in mapping.tolist():
        expected[dst] = expected[src]
    assert torch.equal(cache, expected)

    dst = torch.zeros(3, 2, 3)
    reference.swap_blocks(cache, dst, torch.tensor([[5, 0], [1, 2]]))
    assert torch.equal(dst[0], cache[5]) and torch.equal(dst[2], cache[1])
    assert torch.equal(dst[1], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="method"):
        reference.swap_blocks(cache, dst, mapping, method="fast")
