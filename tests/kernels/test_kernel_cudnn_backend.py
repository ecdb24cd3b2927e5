"""The optional cuDNN backend: which steps it takes, its graph buckets, and on the GPU (with
nvidia-cudnn-frontend installed) results equal to the reference for every step shape.

On the CPU, steps never route to cuDNN: the backend runs the Triton kernel (under the
interpreter) and must give the reference's result.
"""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import cudnn_backend, paged_attention, reference
from kvtier.kernels.cudnn_backend import GraphShape, reachable_shapes, routes_to_cudnn

HAS_CUDNN = cudnn_backend.cudnn_available()
requires_cudnn = pytest.mark.skipif(not HAS_CUDNN, reason="needs CUDA, "
                                    "nvidia-cudnn-frontend and cuDNN >= 9.6")


@pytest.fixture
def small_steps_use_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route steps from 512 query tokens to cuDNN (the engine's threshold is a speed
    policy), so the GPU tests' shapes stay small."""
    monkeypatch.setattr(cudnn_backend, "MIN_STEP_TOKENS", 512)


def expected_output(case: cases.AttentionCase, scale: float) -> torch.Tensor:
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.args()]
    return reference.paged_attention(*cpu_args, scale)


def check_against_reference(case: cases.AttentionCase, scale: float) -> torch.Tensor:
    out = cases.poisoned_like(case.query)
    result = cudnn_backend.paged_attention(*case.args(), scale, out=out)
    assert result is out
    num_valid = int(case.query_start_loc[-1])
    torch.testing.assert_close(out[:num_valid].cpu(), expected_output(case, scale)[:num_valid],
                               **cases.TOLERANCES[case.query.dtype])
    assert torch.isnan(out[num_valid:]).all(), "rows after the last request were written"
    return out


def test_graph_shapes_round_up_to_few_buckets() -> None:
    assert GraphShape.for_step(1, 8192, 2048) == GraphShape(1, 8192, 8192)
    assert GraphShape.for_step(3, 600, 65) == GraphShape(4, 8192, 8192)
    assert GraphShape.for_step(5, 64, 1) == GraphShape(8, 8192, 8192)
    assert GraphShape.for_step(16, 16384, 8193) == GraphShape(16, 16384, 16384)
    # Every step of prompts up to 128K tokens in 8K chunks shares one graph.
    assert len({GraphShape.for_step(1, q, w) for q in (512, 8192) for w in (1, 2049, 8192)}) == 1


def test_only_prefill_shaped_half_precision_cuda_steps_route_to_cudnn() -> None:
    cpu = torch.empty((8192, 32, 128), dtype=torch.bfloat16)
    assert not routes_to_cudnn(cpu, 1, 8192), "a CPU tensor never routes to cuDNN"
    if not torch.cuda.is_available():
        return
    chunk = torch.empty((8192, 32, 128), dtype=torch.bfloat16, device="cuda")
    assert routes_to_cudnn(chunk, 1, 8192)
    assert not routes_to_cudnn(chunk.float(), 1, 8192), "float32 stays on Triton"
    assert not routes_to_cudnn(chunk[:128], 1, 128), "a short step stays on Triton"
    assert not routes_to_cudnn(chunk[:1040], 1, 1040), "so does a 1K-token prompt"
    assert not routes_to_cudnn(chunk[:512], 512, 1), "decodes stay on Triton"
    assert not routes_to_cudnn(chunk, 17, 8000), "many requests stay on Triton"


def test_a_graph_cudnn_fails_to_run_is_never_used_again() -> None:
    prefill = cudnn_backend.CudnnPrefill()
    built = object()  # stands for a built graph; disable only forgets it
    prefill._graphs[("geometry", "shape")] = built
    assert prefill.num_graphs == 1
    prefill.disable(built)
    assert prefill.num_graphs == 0 and prefill._graphs[("geometry", "shape")] is None


@cases.needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_the_cpu_the_backend_is_the_triton_kernel(dtype: torch.dtype) -> None:
    case = cases.build_attention_case([13, 27, 37, 0, 32], [13, 6, 1, 0, 1], num_kv_heads=2,
                                      group=4, head_dim=32, block_size=16, dtype=dtype,
                                      device="cpu", seed=7)
    check_against_reference(case, 32 ** -0.5)


def test_the_backend_refuses_misuse_like_the_triton_launcher() -> None:
    case = cases.build_attention_case([20], [20], num_kv_heads=2, group=2, head_dim=16,
                                      block_size=16, dtype=torch.float16, device="cpu")
    args = list(case.args())
    args[1] = args[1].float()  # k_cache of another dtype
    with pytest.raises(ValueError, match="dtype"):
        cudnn_backend.paged_attention(*args, 0.25)


def chunk_beside_a_prompt(seed: int) -> cases.AttentionCase:
    """A 900-token prompt and a 200-token chunk after 100 tokens, on the GPU (77 blocks)."""
    return cases.build_attention_case([900, 300], [900, 200], num_kv_heads=2, group=4,
                                      head_dim=128, block_size=16, dtype=torch.bfloat16,
                                      device="cuda", seed=seed, poison=1e4)


# Request 0: a fresh prompt; 1: a chunk after a prefix; 2: a decode; 3: padding; 4: a chunk
# that ends exactly on a block boundary; 5: a one-token chunk after a long prefix.
GPU_SEQ_LENS = [1500, 700, 2049, 0, 640, 3001]
GPU_Q_LENS = [1500, 128, 1, 0, 96, 1]


@pytest.mark.gpu
@requires_cudnn
@pytest.mark.usefixtures("small_steps_use_cudnn")
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_cudnn_matches_reference(dtype: torch.dtype, group: int) -> None:
    # cuDNN reads a request's last block whole (masked): unwritten slots hold finite values
    # in the engine's cache (allocated zeroed), so the poison here is large but finite.
    case = cases.build_attention_case(GPU_SEQ_LENS, GPU_Q_LENS, num_kv_heads=4, group=group,
                                      head_dim=128, block_size=16, dtype=dtype,
                                      device="cuda", seed=group, poison=1e4)
    assert routes_to_cudnn(case.query, len(GPU_SEQ_LENS), case.max_query_len)
    check_against_reference(case, 128 ** -0.5)


@pytest.mark.gpu
@requires_cudnn
@pytest.mark.usefixtures("small_steps_use_cudnn")
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32), (128, 64)])
def test_gpu_cudnn_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    case = cases.build_attention_case([600, 1025], [600, 64], num_kv_heads=3, group=3,
                                      head_dim=head_dim, block_size=block_size,
                                      dtype=torch.bfloat16, device="cuda", seed=head_dim,
                                      poison=1e4)
    assert routes_to_cudnn(case.query, 2, case.max_query_len)
    check_against_reference(case, head_dim ** -0.5)


@pytest.mark.gpu
@requires_cudnn
@pytest.mark.usefixtures("small_steps_use_cudnn")
def test_gpu_cudnn_reuses_a_graph_across_steps_of_one_bucket() -> None:
    first = chunk_beside_a_prompt(seed=1)
    assert routes_to_cudnn(first.query, 2, first.max_query_len)
    check_against_reference(first, 128 ** -0.5)
    built = cudnn_backend._PREFILL.num_graphs
    # Other lengths, the same (requests, longest query, table width) buckets: same graph.
    # The same number of blocks (77), so the same cache geometry.
    second = cases.build_attention_case([300, 900], [300, 600], num_kv_heads=2, group=4,
                                        head_dim=128, block_size=16, dtype=torch.bfloat16,
                                        device="cuda", seed=2, poison=1e4)
    check_against_reference(second, 128 ** -0.5)
    assert cudnn_backend._PREFILL.num_graphs == built
    with pytest.raises(ValueError, match="cannot hold this step"):
        cudnn_backend.paged_attention(*second.args(), 128 ** -0.5,
                                      shape=GraphShape(1, 8192, 8192))


@pytest.mark.gpu
@requires_cudnn
@pytest.mark.usefixtures("small_steps_use_cudnn")
def test_gpu_cudnn_takes_queries_that_are_views_of_a_packed_projection() -> None:
    case = cases.build_attention_case([700], [700], num_kv_heads=2, group=4, head_dim=64,
                                      block_size=16, dtype=torch.float16, device="cuda",
                                      seed=3, poison=1e4)
    tokens, heads, dim = case.query.shape
    qkv = torch.randn(tokens, (heads + 4) * dim, dtype=torch.float16, device="cuda")
    qkv[:, :heads * dim] = case.query.reshape(tokens, heads * dim)
    case.query = qkv[:, :heads * dim].view(tokens, heads, dim)  # strided rows
    assert not case.query.is_contiguous() and routes_to_cudnn(case.query, 1, 700)
    check_against_reference(case, 64 ** -0.5)


@pytest.mark.gpu
@requires_cudnn
@pytest.mark.usefixtures("small_steps_use_cudnn")
def test_gpu_decode_steps_and_float32_run_the_triton_kernel() -> None:
    for dtype, q_lens in ((torch.bfloat16, [1, 1, 0]), (torch.float32, [300, 1, 0])):
        case = cases.build_attention_case([700, 33, 0], q_lens, num_kv_heads=2, group=4,
                                          head_dim=128, block_size=16, dtype=dtype,
                                          device="cuda", seed=4)
        assert not routes_to_cudnn(case.query, 3, case.max_query_len)
        got = cudnn_backend.paged_attention(*case.args(), 128 ** -0.5)
        expected = paged_attention(*case.args(), 128 ** -0.5)
        num_valid = int(case.query_start_loc[-1])
        assert torch.equal(got[:num_valid], expected[:num_valid])


def test_an_engine_reaches_one_graph_per_request_bucket() -> None:
    assert reachable_shapes(8192, 256, 131072, 16) == [
        GraphShape(n, 8192, 8192) for n in (1, 2, 4, 8, 16)]
    assert reachable_shapes(2048, 1, 4096, 16) == [GraphShape(1, 8192, 8192)]
    assert [s.num_reqs for s in reachable_shapes(8192, 5, 32768, 16)] == [1, 2, 4, 8]
    assert reachable_shapes(16384, 2, 262144, 16) == [
        GraphShape(1, 16384, 16384), GraphShape(2, 16384, 16384)]


@pytest.mark.gpu
@requires_cudnn
@pytest.mark.usefixtures("small_steps_use_cudnn")
def test_gpu_layers_of_one_step_derive_cudnns_inputs_once() -> None:
    case = chunk_beside_a_prompt(seed=8)
    step_cache: dict = {}
    first = cudnn_backend.paged_attention(*case.args(), 128 ** -0.5, step_cache=step_cache)
    (derived,) = step_cache.values()
    second = cudnn_backend.paged_attention(*case.args(), 128 ** -0.5, step_cache=step_cache)
    (again,) = step_cache.values()
    assert again is derived, "the second layer reused the first one's tensors"
    assert torch.equal(first[:1100], second[:1100])
    check_against_reference(case, 128 ** -0.5)  # and without a cache: the same result
