"""The fused layer kernels (rms_norm, silu_and_mul, rotary_embedding_) against
kernels.reference and against transformers' RMSNorm and rotary embedding.

16-bit results are compared in ulps of the dtype (bit patterns as ordered integers), so
"within one ulp" means exactly that, at any magnitude.
"""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
import torch.nn.functional as F
from kvtier.kernels import reference, rms_norm, rotary_embedding_, silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def ordered_bits(tensor: torch.Tensor) -> torch.Tensor:
    """16-bit floats as int32 that grow by one per ulp along the number line (+0 == -0)."""
    bits = tensor.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_ulp_close(got: torch.Tensor, expected: torch.Tensor, max_ulps: int = 1) -> None:
    """At most `max_ulps` apart everywhere, and bitwise equal in all but 1% of elements:
    the kernels round where the reference rounds, so only last-bit float32 differences
    (summation order, exp, rsqrt) may flip a rounding, which is rare. Rounding once where
    the reference rounds twice would differ by an ulp in a large share of elements."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, \
        f"{tuple(got.shape)} {got.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    assert not expected.isnan().any() and not got.isnan().any(), "unexpected NaN"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    ulps = (ordered_bits(got) - ordered_bits(expected)).abs()
    worst = int(ulps.max()) if ulps.numel() else 0
    assert worst <= max_ulps, (f"{int((ulps > max_ulps).sum())} of {ulps.numel()} elements "
                               f"differ by more than {max_ulps} ulp (worst {worst})")
    num_differing = int((ulps > 0).sum())
    assert num_differing <= 0.01 * ulps.numel(), \
        f"{num_differing} of {ulps.numel()} elements differ (rounding at other points?)"


def check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool,
                   device: str, seed: int, max_ulps: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    # x is a strided slice of a wider buffer, as a projection output slice would be.
    wide = (torch.randn(num_tokens, hidden + 24, generator=generator) * 3).to(dtype).to(device)
    x = wide[:, 8:8 + hidden]  # [num_tokens, hidden]
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype).to(device)
    if not with_residual:
        assert_ulp_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS), max_ulps)
        return
    residual = torch.randn(num_tokens, hidden, generator=generator).to(dtype).to(device)
    summed = x + residual  # [num_tokens, hidden], rounded to the dtype by torch
    expected_residual = residual.clone()
    expected, _ = reference.rms_norm(x, weight, EPS, expected_residual)
    out, returned = rms_norm(x, weight, EPS, residual)
    assert returned is residual, "the residual stream is updated in place and returned"
    assert torch.equal(residual, summed), "residual must hold x + residual, bit for bit"
    assert torch.equal(expected_residual, summed)
    assert_ulp_close(out, expected, max_ulps)


@cases.needs_interpreter
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int,
                                    with_residual: bool) -> None:
    check_rms_norm(5, hidden, dtype, with_residual, "cpu", seed=hidden)


@cases.needs_interpreter
def test_rms_norm_wide_rows() -> None:
    # 5120 pads to an 8192-wide block: the mask must keep the padding out of the mean.
    check_rms_norm(2, 5120, torch.bfloat16, True, "cpu", seed=7)


@cases.needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    # transformers' decoder layer: hidden = hidden + attn_out, then post_attention_layernorm.
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    generator = torch.Generator().manual_seed(11)
    norm = modeling.LlamaRMSNorm(96, EPS)
    norm.weight.data = torch.randn(96, generator=generator).to(dtype)
    hidden = torch.randn(4, 96, generator=generator).to(dtype)
    attn_out = torch.randn(4, 96, generator=generator).to(dtype)
    with torch.no_grad():
        expected_plain = norm(hidden)
        expected_hidden = hidden + attn_out
        expected_fused = norm(expected_hidden)
    assert_ulp_close(rms_norm(hidden, norm.weight.data, EPS), expected_plain)
    out, residual = rms_norm(attn_out, norm.weight.data, EPS, hidden.clone())
    assert torch.equal(residual, expected_hidden)
    assert_ulp_close(out, expected_fused)


def check_silu_and_mul(num_tokens: int, d: int, dtype: torch.dtype, device: str, seed: int,
                       max_ulps: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, 2 * d + 16, generator=generator) * 4
    wide[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 300.0])
    x = wide.to(dtype).to(device)[:, :2 * d]  # [num_tokens, 2 * d], strided rows
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, d) and out.is_contiguous()
    assert_ulp_close(out, reference.silu_and_mul(x), max_ulps)
    assert_ulp_close(out, F.silu(x[:, :d]) * x[:, d:], max_ulps)


# Gates of -100 overflow exp(-gate) to inf (silu is then -0), which numpy reports.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@cases.needs_interpreter
@pytest.mark.parametrize("d", [100, 1100])  # 1100 spans two tiles of d, the second partial
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_reference(dtype: torch.dtype, d: int) -> None:
    check_silu_and_mul(5, d, dtype, "cpu", seed=d)


def packed_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str, generator: torch.Generator,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed projection output [num_tokens, (heads + 2 kv_heads) * head_dim] and its q, k
    views (strided on the token dim, like the engine's)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator)
    qkv = qkv.to(dtype).to(device)
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    return qkv, query, key


def model_layers():
    """engine.models.llama, imported only where compared against: the GPU test run has the
    kernels' dependencies (torch, triton) but maybe not the engine's (lmdb, xxhash)."""
    return pytest.importorskip("kvtier.engine.models.llama")


def rope_cache(head_dim: int, max_position: int, dtype: torch.dtype, device: str,
               ) -> torch.Tensor:
    """[max_position, head_dim] cos | sin of position * theta^(-2i / head_dim), theta 5e5."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] / (500000.0 ** exponents)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(device)


def check_rotary(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    qkv, query, key = packed_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device,
                                 generator)
    max_position = 4 * num_tokens + 8
    cache = rope_cache(head_dim, max_position, dtype, device)
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator)
    positions[-1] = positions[0]  # a repeated position
    positions = positions.to(device)
    expected_qkv = qkv.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected_query = expected_qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    expected_key = expected_qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads,
                                                                 head_dim)
    value_before = qkv[:, q_size + kv_size:].clone()
    rotary_embedding_(query, key, positions, cache)
    reference.rotary_embedding_(expected_query, expected_key, positions, cache)
    assert_ulp_close(query, expected_query)
    assert_ulp_close(key, expected_key)
    assert torch.equal(qkv[:, q_size + kv_size:], value_before), "v must stay untouched"


@cases.needs_interpreter
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_reference(dtype: torch.dtype, head_dim: int) -> None:
    check_rotary(5, 3, 2, head_dim, dtype, "cpu", seed=head_dim)


@cases.needs_interpreter
def test_rotary_loops_over_head_tiles() -> None:
    # head_dim 256 allows 16 heads per tile: 20 query heads take a second, partial tile.
    check_rotary(2, 20, 4, 256, torch.bfloat16, "cpu", seed=5)


@cases.needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_matches_transformers(dtype: torch.dtype) -> None:
    llama = model_layers()
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    generator = torch.Generator().manual_seed(3)
    _, query, key = packed_qkv(6, 4, 2, 64, dtype, "cpu", generator)
    rotary = llama.RotaryEmbedding(64, 128, 500000.0, None)
    rotary.reset_cache(torch.device("cpu"), dtype)
    positions = torch.tensor([0, 1, 2, 17, 100, 127])
    # transformers' tables repeat each half: [num_tokens, head_dim]; heads are its dim 1.
    cos, sin = rotary.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    expected_query, expected_key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    rotary_embedding_(query, key, positions, rotary.cos_sin_cache)
    # transformers rounds each product to the dtype, the kernel only the result.
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(query, expected_query, **tolerance)
    torch.testing.assert_close(key, expected_key, **tolerance)
    assert torch.equal(query[0], expected_query[0]), "position 0 is the identity"


@cases.needs_interpreter
def test_layer_ops_accept_zero_tokens() -> None:
    weight = torch.ones(8)
    assert rms_norm(torch.zeros(0, 8), weight, EPS).shape == (0, 8)
    assert silu_and_mul(torch.zeros(0, 8)).shape == (0, 4)
    rotary_embedding_(torch.zeros(0, 2, 8), torch.zeros(0, 1, 8),
                      torch.zeros(0, dtype=torch.int64), torch.zeros(4, 8))


@cases.needs_interpreter
def test_rms_norm_rejects_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight = torch.zeros(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight has dtype"):
        rms_norm(x, weight.bfloat16(), EPS)
    with pytest.raises(ValueError, match=r"weight must be \[hidden=8\]"):
        rms_norm(x, torch.ones(6), EPS)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, hidden\]"):
        rms_norm(x[None], weight, EPS)
    with pytest.raises(ValueError, match="residual must be like x"):
        rms_norm(x, weight, EPS, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="residual has dtype"):
        rms_norm(x, weight, EPS, torch.zeros(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="stride 1"):
        rms_norm(torch.zeros(8, 3).t(), weight, EPS)
    with pytest.raises(ValueError, match="x has dtype"):
        rms_norm(x.int(), weight.int(), EPS)
    with pytest.raises(ValueError, match="exceeds"):
        rms_norm(torch.zeros(1, 40000), torch.ones(40000), EPS)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        rms_norm(x, weight, EPS)


@cases.needs_interpreter
def test_silu_and_mul_rejects_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="odd last dimension 7"):
        silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul(torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match="dtype"):
        silu_and_mul(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="stride 1"):
        silu_and_mul(torch.zeros(8, 3).t())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        silu_and_mul(torch.zeros(3, 8))


@cases.needs_interpreter
def test_rotary_rejects_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    query, key = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    positions, cache = torch.zeros(3, dtype=torch.int64), torch.zeros(16, 8)
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        rotary_embedding_(torch.zeros(3, 4, 7), torch.zeros(3, 2, 7), positions,
                          torch.zeros(16, 7))
    with pytest.raises(ValueError, match="key must be"):
        rotary_embedding_(query, torch.zeros(3, 2, 6), positions, cache)
    with pytest.raises(ValueError, match="key must be"):
        rotary_embedding_(query, torch.zeros(2, 2, 8), positions, cache)
    with pytest.raises(ValueError, match="positions has dtype"):
        rotary_embedding_(query, key, positions.int(), cache)
    with pytest.raises(ValueError, match=r"positions must be \[num_tokens=3\]"):
        rotary_embedding_(query, key, positions[:2], cache)
    with pytest.raises(ValueError, match="cos_sin_cache has dtype"):
        rotary_embedding_(query, key, positions, cache.bfloat16())
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        rotary_embedding_(query, key, positions, torch.zeros(16, 4))
    with pytest.raises(ValueError, match="key has dtype"):
        rotary_embedding_(query, key.half(), positions, cache)
    with pytest.raises(ValueError, match="stride 1"):
        rotary_embedding_(torch.zeros(3, 8, 4).transpose(1, 2), key, positions, cache)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        rotary_embedding_(query, key, positions, cache)


# On the GPU the mean square's summation order and rsqrt / exp differ from torch's in the
# last float32 bit, which can flip the rounding of rms_norm's normalized row or silu's
# activation by one ulp before the final product: two ulps there. Rope rounds once.
@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_layer_ops_match_reference(dtype: torch.dtype) -> None:
    for with_residual in (False, True):
        check_rms_norm(64, 4096, dtype, with_residual, "cuda", seed=1, max_ulps=2)
    check_rms_norm(64, 5120, dtype, True, "cuda", seed=2, max_ulps=2)
    check_silu_and_mul(64, 14336, dtype, "cuda", seed=3, max_ulps=2)
    check_rotary(64, 32, 8, 128, dtype, "cuda", seed=4)


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_layer_ops_replay_in_cuda_graph() -> None:
    # Capture fails on a host sync; replay must read the static inputs' new contents.
    dtype, device = torch.bfloat16, "cuda"
    generator = torch.Generator().manual_seed(9)
    qkv, query, key = packed_qkv(64, 32, 8, 128, dtype, device, generator)
    cache = rope_cache(128, 4096, dtype, device)
    positions = torch.zeros(64, dtype=torch.int64, device=device)
    x = torch.zeros(64, 4096, dtype=dtype, device=device)
    residual = torch.zeros_like(x)
    weight = torch.randn(4096, generator=generator).to(dtype).to(device)
    gate_up = torch.zeros(64, 2 * 14336, dtype=dtype, device=device)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = rms_norm(x, weight, EPS, residual)
        rotary_embedding_(query, key, positions, cache)
        return out, silu_and_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_act = step()

    new_x = torch.randn(64, 4096, generator=generator).to(dtype).to(device)
    new_residual = torch.randn(64, 4096, generator=generator).to(dtype).to(device)
    new_gate_up = torch.randn(64, 2 * 14336, generator=generator).to(dtype).to(device)
    new_qkv = torch.randn(qkv.shape, generator=generator).to(dtype).to(device)
    new_positions = torch.randint(0, 4096, (64,), generator=generator).to(device)
    x.copy_(new_x)
    residual.copy_(new_residual)
    gate_up.copy_(new_gate_up)
    qkv.copy_(new_qkv)
    positions.copy_(new_positions)
    graph.replay()
    torch.cuda.synchronize()

    expected_residual = new_residual.clone()
    expected_out, _ = reference.rms_norm(new_x, weight, EPS, expected_residual)
    assert torch.equal(residual, expected_residual)
    assert_ulp_close(static_out, expected_out, max_ulps=2)
    assert_ulp_close(static_act, reference.silu_and_mul(new_gate_up), max_ulps=2)
    expected_qkv = new_qkv.clone()
    expected_query = expected_qkv[:, :32 * 128].view(64, 32, 128)
    expected_key = expected_qkv[:, 32 * 128:40 * 128].view(64, 8, 128)
    reference.rotary_embedding_(expected_query, expected_key, new_positions, cache)
    assert_ulp_close(qkv, expected_qkv)
