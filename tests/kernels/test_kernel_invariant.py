"""invariant_linear and invariant_attention: close to the plain computation, and each row the
same bits whatever else shares its launch.

A row's independence is tested exactly (`torch.equal`). On the CPU the Triton kernels run
under the interpreter, whose dots are numpy matrix products: those round a row differently
depending on where it sits in the tile, so there the kernels' own invariance is tested only
where a row keeps its place in its tile (other requests in the batch, one program against
one program per split, chunks cut at tile boundaries). The @gpu tests check every case with
the compiled kernels; the torch versions (the CPU path of the deterministic mode) are
checked for every case everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from kvtier.kernels import invariant_attention, invariant_linear, reference
from kvtier.kernels.invariant_attention import InvariantAttentionConfig, pick_invariant_config
from kvtier.kernels.invariant_linear import LinearConfig, linear_tilings

from tests.kernels.kernel_cases import TOLERANCES, needs_interpreter, requires_cuda

Piece = tuple[int, int, int]  # (sequence, first token, end token) of one request's queries


class Sequences:
    """Sequences whose K/V sit in one paged cache (scrambled blocks) with a query per token.

    query: [num_seqs, seq_len, num_heads, head_dim]; k_cache/v_cache: layer views."""

    def __init__(self, num_seqs: int, seq_len: int, *, num_kv_heads: int, group: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, device: str,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = -(-seq_len // block_size)
        num_blocks = num_seqs * blocks_per_seq + 1
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
        cache = torch.randn(shape, generator=gen).to(dtype)
        self.kv = cache.to(device)
        self.k_cache, self.v_cache = self.kv[:, 0], self.kv[:, 1]
        order = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks_per_seq]
        self.tables = order.view(num_seqs, blocks_per_seq).to(torch.int32).to(device)
        self.query = torch.randn((num_seqs, seq_len, num_kv_heads * group, head_dim),
                                 generator=gen).to(dtype).to(device)
        self.scale = head_dim ** -0.5

    def attend(self, fn: Callable[..., torch.Tensor], pieces: Sequence[Piece],
               **options) -> dict[tuple[int, int], torch.Tensor]:
        """Run `fn` over one launch holding `pieces`; each token's output row by
        (sequence, position)."""
        device = self.query.device
        query = torch.cat([self.query[s, lo:hi] for s, lo, hi in pieces])
        starts = [0]
        for _, lo, hi in pieces:
            starts.append(starts[-1] + hi - lo)
        seq_lens = [hi for _, _, hi in pieces]
        out = fn(query, self.k_cache, self.v_cache,
                 torch.tensor(starts, dtype=torch.int32, device=device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 self.tables[[s for s, _, _ in pieces]], max(hi - lo for _, lo, hi in pieces),
                 max(seq_lens), self.scale, **options)
        return {(s, pos): out[starts[i] + pos - lo]
                for i, (s, lo, hi) in enumerate(pieces) for pos in range(lo, hi)}


def assert_rows_equal(a: dict, b: dict) -> None:
    common = sorted(a.keys() & b.keys())
    assert common
    for key in common:
        assert torch.equal(a[key], b[key]), \
            f"row {key} differs by {(a[key].float() - b[key].float()).abs().max().item():.3g}"


def linear_rows_equal(fn: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, cuts: Sequence[tuple[int, int]]) -> None:
    full = fn(x, weight, bias)
    for lo, hi in cuts:
        part = fn(x[lo:hi], weight, bias)
        assert torch.equal(part, full[lo:hi]), f"rows {lo}:{hi} differ from the full product"


# ---- CPU: the torch versions (the deterministic mode's CPU path) --------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_rows_do_not_depend_on_the_others(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((70, 96), generator=gen).to(dtype)
    weight = torch.randn((80, 96), generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    out = reference.invariant_linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), **TOLERANCES[dtype])
    linear_rows_equal(reference.invariant_linear, x, weight, bias,
                      [(0, 1), (3, 4), (5, 22), (17, 70), (0, 3)])
    assert reference.invariant_linear(x[:0], weight).shape == (0, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_is_invariant_and_close(dtype: torch.dtype) -> None:
    seqs = Sequences(3, 150, num_kv_heads=2, group=2, head_dim=16, block_size=16, dtype=dtype,
                     device="cpu")
    fn = reference.invariant_attention
    whole = seqs.attend(fn, [(0, 0, 150), (1, 0, 150)], split_len=64)
    chunks = {**seqs.attend(fn, [(0, 0, 37)], split_len=64),
              **seqs.attend(fn, [(2, 0, 5), (0, 37, 130), (1, 0, 99)], split_len=64),
              **seqs.attend(fn, [(0, 130, 150), (1, 99, 150)], split_len=64)}
    decodes = seqs.attend(fn, [(0, 149, 150), (1, 63, 64), (1, 64, 65), (0, 127, 128)],
                          split_len=64)
    assert_rows_equal(whole, chunks)
    assert_rows_equal(whole, decodes)
    plain = seqs.attend(reference.paged_attention, [(0, 0, 150), (1, 0, 150)])
    for key, row in whole.items():
        torch.testing.assert_close(row, plain[key], **TOLERANCES[dtype])


# ---- CPU: the Triton kernels under the interpreter ---------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_matches_linear_and_keeps_rows_apart(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((70, 48), generator=gen).to(dtype)
    weight = torch.randn((80, 48), generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    expected = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
    torch.testing.assert_close(invariant_linear(x, weight, bias), expected, **TOLERANCES[dtype])
    strided = torch.randn((70, 64), generator=gen).to(dtype)[:, :48]  # rows 64 apart
    torch.testing.assert_close(invariant_linear(strided, weight), F.linear(
        strided.float(), weight.float()).to(dtype), **TOLERANCES[dtype])
    # Cuts on 64-row tile boundaries keep every row in its place in its tile.
    linear_rows_equal(invariant_linear, x, weight, bias, [(0, 1), (0, 64), (64, 70), (0, 65)])


@needs_interpreter
def test_invariant_linear_rejects_bad_input() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="in_features"):
        invariant_linear(x, torch.randn(5, 7))
    with pytest.raises(ValueError, match="dtype"):
        invariant_linear(x, torch.randn(5, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="stride 1"):
        invariant_linear(torch.randn(8, 4).t(), torch.randn(5, 8))
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig(block_m=48, block_n=64, block_k=64)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_matches_reference_and_keeps_rows_apart(dtype: torch.dtype) -> None:
    seqs = Sequences(3, 150, num_kv_heads=2, group=2, head_dim=16, block_size=16, dtype=dtype,
                     device="cpu")
    block_q = pick_invariant_config(2, 16, dtype).block_q
    whole = seqs.attend(invariant_attention, [(0, 0, 150)], split_len=64)
    plain = seqs.attend(reference.paged_attention, [(0, 0, 150)])
    for key, row in whole.items():
        torch.testing.assert_close(row, plain[key], **TOLERANCES[dtype])
    # Other requests in the launch; one program per split against one for all splits.
    batched = seqs.attend(invariant_attention, [(1, 0, 77), (0, 0, 150), (2, 0, 3)],
                          split_len=64)
    split = seqs.attend(invariant_attention, [(0, 0, 150), (1, 140, 141)], split_len=64,
                        split_programs=True)
    # A second chunk starting on a query-tile boundary.
    cut = 4 * block_q
    chunked = {**seqs.attend(invariant_attention, [(0, 0, cut)], split_len=64),
               **seqs.attend(invariant_attention, [(2, 0, 9), (0, cut, 150)], split_len=64)}
    for other in (batched, split, chunked):
        assert_rows_equal(whole, other)


@needs_interpreter
def test_invariant_attention_rejects_bad_input() -> None:
    seqs = Sequences(1, 20, num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="split_len"):
        seqs.attend(invariant_attention, [(0, 0, 20)], split_len=100)
    with pytest.raises(ValueError):
        invariant_attention(seqs.query[0, :4, :3], seqs.k_cache, seqs.v_cache,
                            torch.tensor([0, 4], dtype=torch.int32),
                            torch.tensor([4], dtype=torch.int32), seqs.tables, 4, 4, 0.25)


# ---- GPU: every case, compiled ----------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 200)])
def test_gpu_invariant_linear_rows_are_the_same_bits_at_any_row_count(
        dtype: torch.dtype, shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((2100, k), generator=gen, device="cuda").to(dtype)
    weight = (torch.randn((n, k), generator=gen, device="cuda") * k ** -0.5).to(dtype)
    out = invariant_linear(x, weight)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()),
                               atol=3e-2, rtol=3e-2)
    linear_rows_equal(invariant_linear, x, weight, None,
                      [(0, 1), (5, 6), (3, 11), (7, 71), (100, 164), (13, 2100), (1, 2049)])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_every_linear_tiling_gives_the_same_bits(dtype: torch.dtype) -> None:
    # pick_linear_config chooses the tiling by the number of rows: on this GPU every
    # tiling it may choose must round every element alike.
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn((300, 4096), generator=gen, device="cuda").to(dtype)
    weight = (torch.randn((1000, 4096), generator=gen, device="cuda") * 0.02).to(dtype)
    bias = torch.randn(1000, generator=gen, device="cuda").to(dtype)
    tilings = linear_tilings(dtype)
    first = invariant_linear(x, weight, bias, config=tilings[0])
    for config in tilings[1:]:
        assert torch.equal(invariant_linear(x, weight, bias, config=config), first), config


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_invariant_attention_rows_are_the_same_bits_in_any_step(dtype: torch.dtype) -> None:
    seqs = Sequences(4, 2300, num_kv_heads=8, group=4, head_dim=128, block_size=16,
                     dtype=dtype, device="cuda")
    fn = invariant_attention
    whole = seqs.attend(fn, [(0, 0, 2300), (1, 0, 2300)])
    plain = seqs.attend(reference.paged_attention, [(0, 0, 2300), (1, 0, 2300)])
    for key in list(whole)[::97]:
        torch.testing.assert_close(whole[key].float(), plain[key].float(), atol=2e-2,
                                   rtol=2e-2)
    chunked = {**seqs.attend(fn, [(0, 0, 777)]),
               **seqs.attend(fn, [(2, 0, 100), (0, 777, 2048), (1, 0, 1000)]),
               **seqs.attend(fn, [(0, 2048, 2300), (1, 1000, 2300), (3, 0, 5)])}
    decodes = seqs.attend(fn, [(0, p, p + 1) for p in (0, 1, 511, 512, 1500, 2299)]
                          + [(1, 2298, 2299)])
    single_decode = seqs.attend(fn, [(0, 2299, 2300)])
    split = seqs.attend(fn, [(0, 1900, 2300), (1, 5, 6)], split_programs=True)
    one_program = seqs.attend(fn, [(0, 2290, 2300), (1, 2290, 2300)], split_programs=False)
    for other in (chunked, decodes, single_decode, split, one_program):
        assert_rows_equal(whole, other)


@pytest.mark.gpu
@requires_cuda
def test_gpu_every_attention_tile_height_gives_the_same_bits() -> None:
    # pick_invariant_config chooses the query tile's height by the step: on this GPU every
    # height and warp count must give a row the same bits (the key tile's width is fixed).
    seqs = Sequences(3, 2300, num_kv_heads=8, group=4, head_dim=128, block_size=16,
                     dtype=torch.bfloat16, device="cuda")
    tile_n = pick_invariant_config(4, 128, torch.bfloat16, 1).tile_n
    pieces = [(0, 0, 2300), (1, 700, 1500), (2, 2299, 2300)]
    first = None
    for rows, warps in [(16, 4), (64, 4), (128, 4), (128, 8), (256, 8)]:
        config = InvariantAttentionConfig(block_q=rows // 4, tile_n=tile_n, num_warps=warps)
        for split_programs in (False, True):
            got = seqs.attend(invariant_attention, pieces, config=config,
                              split_programs=split_programs)
            if first is None:
                first = got
            assert_rows_equal(first, got)
