"""The Triton paged_attention kernel against kernels.reference.paged_attention.

On the CPU these run under TRITON_INTERPRET=1 with tiny shapes; the @gpu tests repeat them
with long sequences, every head dim and the split-KV path chosen by the launcher.
"""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import AttentionConfig, paged_attention, reference
from kvtier.kernels.paged_decode import pick_config

# Request 0: a whole odd-length prompt; 1: a chunk in the middle of a prompt; 2: a decode;
# 3: padding; 4: a decode of a sequence that ends exactly on a block boundary.
MIXED_SEQ_LENS = [13, 27, 37, 0, 32]
MIXED_Q_LENS = [13, 6, 1, 0, 1]


def check_against_reference(case: cases.AttentionCase, scale: float,
                            config: AttentionConfig | None = None) -> None:
    out = cases.poisoned_like(case.query)
    result = paged_attention(*case.args(), scale, out=out, config=config)
    assert result is out
    # The reference runs on the CPU in float32 whatever the kernel's device.
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.args()]
    expected = reference.paged_attention(*cpu_args, scale, out=cases.poisoned_like(cpu_args[0]))
    num_valid = int(case.query_start_loc[-1])
    torch.testing.assert_close(out[:num_valid].cpu(), expected[:num_valid],
                               **cases.TOLERANCES[case.query.dtype])
    assert torch.isnan(out[num_valid:]).all(), "rows after the last request were written"


@cases.needs_interpreter
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_mixed_batch(dtype: torch.dtype, group: int, block_size: int) -> None:
    case = cases.build_attention_case(MIXED_SEQ_LENS, MIXED_Q_LENS, num_kv_heads=2,
                                      group=group, head_dim=32, block_size=block_size,
                                      dtype=dtype, device="cpu", seed=group + block_size)
    check_against_reference(case, 32 ** -0.5)


@cases.needs_interpreter
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim: int) -> None:
    case = cases.build_attention_case([19, 9], [5, 9], num_kv_heads=1, group=3,
                                      head_dim=head_dim, block_size=16, dtype=torch.float16,
                                      device="cpu", seed=head_dim)
    check_against_reference(case, head_dim ** -0.5)


@cases.needs_interpreter
@pytest.mark.parametrize(("block_size", "tile_n"), [(64, 16), (128, 64), (16, 64)])
def test_tiles_smaller_and_larger_than_blocks(block_size: int, tile_n: int) -> None:
    case = cases.build_attention_case([150, 70], [20, 70], num_kv_heads=2, group=2,
                                      head_dim=16, block_size=block_size,
                                      dtype=torch.float32, device="cpu", seed=block_size)
    check_against_reference(case, 0.3, AttentionConfig(block_q=8, tile_n=tile_n))


@cases.needs_interpreter
@pytest.mark.parametrize("num_splits", [3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_split_kv(dtype: torch.dtype, num_splits: int) -> None:
    # Decodes over lengths shorter than, equal to and longer than the splits, plus padding;
    # with 3 splits of >= 16 keys the 1-token request leaves two splits empty. 20 splits
    # take the merge past one tile of 16 splits, most of them empty.
    case = cases.build_attention_case([1, 48, 97, 0, 70], [1, 1, 1, 0, 1], num_kv_heads=2,
                                      group=4, head_dim=32, block_size=16, dtype=dtype,
                                      device="cpu", seed=7)
    check_against_reference(case, 0.2, AttentionConfig(block_q=4, tile_n=16,
                                                       num_splits=num_splits))


@cases.needs_interpreter
def test_split_kv_with_prefill_chunks() -> None:
    case = cases.build_attention_case([40, 33], [7, 33], num_kv_heads=1, group=2,
                                      head_dim=16, block_size=16, dtype=torch.float32,
                                      device="cpu", seed=11)
    check_against_reference(case, 0.5, AttentionConfig(block_q=4, tile_n=16, num_splits=2))


@cases.needs_interpreter
def test_launcher_rejects_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    case = cases.build_attention_case([8, 5], [2, 5], num_kv_heads=2, group=2, head_dim=16,
                                      block_size=16, dtype=torch.float16, device="cpu")
    args = list(case.args())

    def call_with(index: int, value: object, match: str) -> None:
        bad = list(args)
        bad[index] = value
        with pytest.raises(ValueError, match=match):
            paged_attention(*bad, 0.25)

    call_with(0, case.query.float(), "dtype")
    call_with(0, case.query[:, :3], "multiple of num_kv_heads")
    call_with(0, case.query.transpose(1, 2).contiguous().transpose(1, 2), "stride 1")
    call_with(1, case.k_cache[..., :8], "head_dim=16")
    call_with(2, case.v_cache[:, :8], "like k_cache")
    call_with(3, case.query_start_loc.long(), "dtype")
    call_with(3, case.query_start_loc[:2], r"num_reqs \+ 1")
    call_with(4, case.seq_lens.long(), "dtype")
    call_with(5, case.block_tables[:1], "num_reqs=2")
    with pytest.raises(ValueError, match="like query"):
        paged_attention(*args, 0.25, out=case.query[:-1].clone())
    with pytest.raises(ValueError, match="tile_n"):
        AttentionConfig(block_q=4, tile_n=24)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        paged_attention(*args, 0.25)


# --- the same on the GPU, with long sequences -------------------------------------------

GPU_SEQ_LENS = [1500, 700, 2049, 0, 333, 4096, 17]
GPU_Q_LENS = [1500, 128, 1, 0, 333, 1, 17]


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_mixed_batch(dtype: torch.dtype, group: int) -> None:
    case = cases.build_attention_case(GPU_SEQ_LENS, GPU_Q_LENS, num_kv_heads=4, group=group,
                                      head_dim=128, block_size=16, dtype=dtype,
                                      device="cuda", seed=group)
    check_against_reference(case, 128 ** -0.5)


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize(("head_dim", "block_size"),
                         [(64, 16), (80, 32), (96, 64), (256, 16), (128, 128), (128, 256)])
def test_gpu_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    case = cases.build_attention_case(GPU_SEQ_LENS, GPU_Q_LENS, num_kv_heads=2, group=4,
                                      head_dim=head_dim, block_size=block_size,
                                      dtype=torch.bfloat16, device="cuda", seed=head_dim)
    check_against_reference(case, head_dim ** -0.5)


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_long_decodes_use_split_kv(dtype: torch.dtype) -> None:
    seq_lens = [9000, 30, 16384, 0, 12001]
    case = cases.build_attention_case(seq_lens, [1, 1, 1, 0, 1], num_kv_heads=8, group=4,
                                      head_dim=128, block_size=16, dtype=dtype,
                                      device="cuda", seed=3)
    check_against_reference(case, 128 ** -0.5)
    forced = AttentionConfig(block_q=4, tile_n=64, num_splits=7, num_stages=3)
    check_against_reference(case, 128 ** -0.5, forced)



@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_short_question_after_long_context_uses_split_kv(dtype: torch.dtype) -> None:
    # A 17-token question after a 20K-token restored document: 8 programs without splits.
    seq_lens, q_lens = [20017], [17]
    config = pick_config(torch.device("cuda"), dtype, sum(q_lens), len(q_lens), 8, 4, 128,
                         max(q_lens), max(seq_lens))
    assert config.num_splits > 1
    case = cases.build_attention_case(seq_lens, q_lens, num_kv_heads=8, group=4,
                                      head_dim=128, block_size=16, dtype=dtype,
                                      device="cuda", seed=5)
    check_against_reference(case, 128 ** -0.5)
    fresh = pick_config(torch.device("cuda"), dtype, 2048, 1, 8, 4, 128, 2048, 2048)
    assert fresh.num_splits == 1, "a fresh prompt keeps one pass over its keys"
