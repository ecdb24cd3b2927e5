"""Prepared paged_attention launches: the geometry key, and launches through compiled
handles against kernels.reference.

The key tests run on any machine (they only read tensor geometry); the interpreter test
checks that the CPU path never prepares a launch; the @gpu tests check that repeated calls
take the prepared path, stay exact on fresh data, and fall back whenever the geometry
changes.
"""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import AttentionConfig, paged_attention, reference
from kvtier.kernels._attention_launch import PreparedLaunches, call_key
from kvtier.kernels.paged_attention import prepared_launches


def decode_case(seq_lens: list[int], *, dtype: torch.dtype = torch.float16,
                device: str = "cpu", seed: int = 0, head_dim: int = 32) -> cases.AttentionCase:
    return cases.build_attention_case(seq_lens, [1 if s else 0 for s in seq_lens],
                                      num_kv_heads=2, group=4, head_dim=head_dim,
                                      block_size=16, dtype=dtype, device=device, seed=seed)


def key_of(case: cases.AttentionCase, out: torch.Tensor | None = None) -> tuple | None:
    return call_key(case.query, case.k_cache, case.v_cache, case.query_start_loc,
                    case.seq_lens, case.block_tables, out)


def test_key_is_the_geometry_not_the_data() -> None:
    first = decode_case([20, 20, 0], seed=1)
    # Other data, other lengths and a wider block table (as many blocks): the same launch.
    second = decode_case([40, 7, 0], seed=2)
    assert second.block_tables.shape[1] != first.block_tables.shape[1]
    assert key_of(first) is not None
    assert key_of(first) == key_of(second)


def test_key_changes_with_dtype_shape_strides_and_out() -> None:
    case = decode_case([40, 7, 0])
    key = key_of(case)
    assert key_of(decode_case([40, 7, 0], dtype=torch.bfloat16)) != key
    assert key_of(decode_case([40, 7, 0], head_dim=64)) != key
    assert key_of(decode_case([40, 7, 0, 5])) != key  # one more request and token
    wide = torch.zeros(case.query.shape[0], case.query.shape[1] + 8, case.query.shape[2],
                       dtype=case.query.dtype)
    strided = wide[:, :case.query.shape[1]]  # a view cut from a packed projection
    strided.copy_(case.query)
    assert call_key(strided, case.k_cache, case.v_cache, case.query_start_loc,
                    case.seq_lens, case.block_tables, None) != key
    contiguous_k = case.k_cache.contiguous()  # not a layer view of the cross-layer cache
    assert call_key(case.query, contiguous_k, case.v_cache, case.query_start_loc,
                    case.seq_lens, case.block_tables, None) != key
    out = torch.empty_like(case.query)
    assert key_of(case, out) != key
    assert key_of(case, out) == key_of(decode_case([40, 7, 0], seed=5), torch.empty_like(out))


def test_key_refuses_unaligned_pointers_and_odd_block_tables() -> None:
    case = decode_case([40, 7, 0])
    flat = torch.zeros(case.query.numel() + 1, dtype=case.query.dtype)
    shifted = flat[1:].view_as(case.query)  # 2 bytes off a 16-byte boundary
    assert call_key(shifted, case.k_cache, case.v_cache, case.query_start_loc,
                    case.seq_lens, case.block_tables, None) is None
    assert key_of(case, flat[1:].view_as(case.query)) is None
    assert call_key(case.query, case.k_cache, case.v_cache, case.query_start_loc,
                    case.seq_lens, case.block_tables.flatten(), None) is None


def test_memo_without_a_compiled_handle_prepares_nothing() -> None:
    memo = PreparedLaunches()
    case = decode_case([40, 7, 0])
    key = key_of(case)
    config = AttentionConfig(block_q=4, tile_n=16)
    memo.record(key, case.query, 3, 2, config, (None, (1, 1, 1), ()), None)
    assert memo.lookup(key, config, 1, 40) is None
    assert (memo.hits, memo.misses) == (0, 1)


@cases.needs_interpreter
def test_interpreter_path_prepares_nothing_and_stays_exact() -> None:
    prepared_launches().clear()
    for seed in (1, 2):
        case = decode_case([40, 7, 0], seed=seed)
        check(case, 0.3, AttentionConfig(block_q=4, tile_n=16, num_splits=2))
    assert not prepared_launches().geometries


def check(case: cases.AttentionCase, scale: float, config: AttentionConfig | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention on `case` against the float32 reference; returns the output."""
    result = paged_attention(*case.args(), scale, out=out, config=config)
    assert out is None or result is out
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.args()]
    expected = reference.paged_attention(*cpu_args, scale)
    num_valid = int(case.query_start_loc[-1])
    torch.testing.assert_close(result[:num_valid].cpu(), expected[:num_valid],
                               **cases.TOLERANCES[case.query.dtype])
    return result


# --- on the GPU: launches through compiled handles ------------------------------------------

LONG = [9000, 30, 16384, 0, 12001]  # decodes that split the keys (split-KV)
MIXED = ([1500, 700, 2049, 0, 17], [1500, 128, 1, 0, 17])  # one pass, no split
#: Other lengths over as many blocks (the same cache shape), table widths 1023 and 129.
OTHER_LENS = {"split": [9016, 30, 16368, 0, 12001], "mixed": [1516, 684, 2049, 0, 17]}


def gpu_case(seq_lens: list[int], q_lens: list[int], seed: int,
             dtype: torch.dtype = torch.bfloat16) -> cases.AttentionCase:
    return cases.build_attention_case(seq_lens, q_lens, num_kv_heads=8, group=4,
                                      head_dim=128, block_size=16, dtype=dtype,
                                      device="cuda", seed=seed)


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", ["split", "mixed"])
def test_gpu_repeated_calls_take_the_prepared_path(dtype: torch.dtype, shape: str) -> None:
    memo = prepared_launches()
    memo.clear()
    lens = (LONG, [1 if s else 0 for s in LONG]) if shape == "split" else MIXED
    check(gpu_case(*lens, seed=1, dtype=dtype), 128 ** -0.5)
    assert memo.geometries, "the first call prepares its geometry"
    hits = memo.hits
    # Fresh data, other lengths of the same shapes, another scale, out given or not.
    other = OTHER_LENS[shape]
    for seed, scale in ((2, 0.05), (3, 0.11)):
        check(gpu_case(other, lens[1], seed=seed, dtype=dtype), scale)
    assert memo.hits == hits + 2
    case = gpu_case(*lens, seed=4, dtype=dtype)
    out = cases.poisoned_like(case.query)
    check(case, 0.07, out=out)  # a new geometry (out given): prepared now
    case = gpu_case(*lens, seed=5, dtype=dtype)
    out = cases.poisoned_like(case.query)
    check(case, 0.07, out=out)
    assert memo.hits == hits + 3
    num_valid = int(case.query_start_loc[-1])
    assert torch.isnan(out[num_valid:]).all(), "rows after the last request were written"


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_changed_geometry_falls_back_and_stays_exact() -> None:
    memo = prepared_launches()
    memo.clear()
    lens = [1 if s else 0 for s in LONG]
    check(gpu_case(LONG, lens, seed=1), 0.09)
    misses = memo.misses
    check(gpu_case(LONG, lens, seed=2, dtype=torch.float16), 0.09)  # dtype
    case = gpu_case(LONG, lens, seed=3)
    wide = torch.empty(case.query.shape[0], 40, 128, dtype=case.query.dtype, device="cuda")
    wide[:, :32].copy_(case.query)
    case.query = wide[:, :32]  # strides
    check(case, 0.09)
    check(gpu_case(LONG + [300], lens + [1], seed=4), 0.09)  # shape
    forced = AttentionConfig(block_q=4, tile_n=64, num_splits=7, num_stages=3)
    check(gpu_case(LONG, lens, seed=5), 0.09, forced)  # tiling
    assert memo.misses == misses + 4


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_prepared_split_launch_in_a_cuda_graph_and_on_two_streams() -> None:
    memo = prepared_launches()
    memo.clear()
    lens = [1 if s else 0 for s in LONG]
    case = gpu_case(LONG, lens, seed=1)
    check(case, 0.09)  # prepares
    out = torch.empty_like(case.query)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm the side stream (its own scratch)
        paged_attention(*case.args(), 0.09, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*case.args(), 0.09, out=out)
    fresh = gpu_case(LONG, lens, seed=2)
    for name in ("query", "k_cache", "v_cache", "block_tables"):
        getattr(case, name).copy_(getattr(fresh, name))
    out.fill_(float("nan"))
    graph.replay()
    expected = check(fresh, 0.09)  # eager, prepared, between replays
    torch.cuda.synchronize()
    num_valid = int(case.query_start_loc[-1])
    torch.testing.assert_close(out[:num_valid], expected[:num_valid], atol=0, rtol=0)
    with torch.cuda.stream(side):
        check(fresh, 0.09)
    torch.cuda.synchronize()
    kept = [p for g in memo.geometries.values() for p in g.tilings.values() if p.scratch]
    assert kept and max(len(p.scratch) for p in kept) == 2, "one scratch per stream"
