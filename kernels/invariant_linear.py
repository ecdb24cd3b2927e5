"""invariant_linear: `x @ weight.T (+ bias)` whose every row is the same bits whatever M.

Library GEMMs (cuBLAS, CPU BLAS) pick their algorithm from the problem's shape: the number
of rows M decides the tile sizes and whether K is split across programs, so a token's
projection depends on how many other tokens share its step. Here each program owns one
[BLOCK_M, BLOCK_N] output tile and walks K from 0 upward in BLOCK_K steps, accumulating
in float32 through `acc = tl.dot(a, b, acc)` (a chain of tensor-core MMAs into the same
accumulator); there is no split-K. An output element is therefore always the same chain of
operations over the same K order, and a row never meets another row's values.

The tiling may follow M, because on the GPU it does not change a row's bits: whatever the
tile's rows, columns and load depth, an element is the same chain of 16-deep tensor-core
steps over K into one float32 accumulator, starting from zero (16- to 128-row tiles, 16 to
256 columns, 64- to 256-deep loads, 2 to 8 warps, mma and warpgroup-mma alike give
identical rows on Hopper; `tests/kernels/test_kernel_invariant.py` checks every tiling of
`pick_linear_config` against the others on the GPU). float32 operands (exact dots on CUDA
cores, whose order may follow the thread layout) keep one tiling for every M. Rows past M
in the last tile are masked loads of zeros, which touch no real row.

Prefill-sized steps on Hopper take a second kernel with the same per-element chain: a
persistent one (a program per SM walking output tiles in groups of rows that share weight
tiles in L2) whose operands arrive through the tensor memory accelerator (TMA
descriptors, zero-filled past the edges). It only changes how tiles are loaded and
scheduled, so its rows are the bits of the first kernel's (the GPU tests compare them); it
brings the prefill GEMMs to cuBLAS's time, where the first kernel took about 1.3x
(`docs/DETERMINISM.md`). Operands TMA cannot describe (rows not 16-byte aligned) and
older GPUs take the first kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks
from kvtier.kernels.layer_ops import _on_kernel_device, _round


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """Tiling of one invariant_linear launch (independent of the number of rows)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    #: The persistent TMA kernel (Hopper and later; others fall back to the first kernel).
    tma: bool = False
    #: Row tiles per group of the persistent kernel's tile order (weight tiles reused in L2).
    group_m: int = 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of two >= 16, "
                                 f"got {value}")


#: Tilings by the most rows they serve (bf16 / fp16), the fastest for the Llama-3-8B
#: projections in a sweep on the GPU (`docs/DETERMINISM.md` has the sweep and the timings):
#: decode-sized steps read the weights with many narrow programs and deep loads,
#: prefill-sized ones reuse each weight tile across 128 rows.
_TILINGS_16BIT = (
    (16, LinearConfig(block_m=16, block_n=32, block_k=256, num_warps=2, num_stages=4)),
    (128, LinearConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=4)),
    (1024, LinearConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
    (None, LinearConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)),
)
#: Wide projections (gate/up) of decode- and mid-sized steps: enough programs already, so
#: shallower loads (16 rows) and wider tiles (64 rows).
_WIDE_16_ROWS = LinearConfig(block_m=16, block_n=32, block_k=128, num_warps=2, num_stages=3)
_WIDE_64_ROWS = LinearConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
_WIDE_MIN_COLUMNS = 16384
#: Prefill-sized steps through the persistent TMA kernel: 128 x 256 tiles once the step has
#: more than 1024 rows or the projection is wide, else 128 x 128 (more programs for narrow
#: projections of mid-sized steps); the Llama-3-8B timings are in docs/DETERMINISM.md.
_TMA_MIN_ROWS = 129
_TMA_WIDE = LinearConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3,
                         tma=True)
_TMA_NARROW = LinearConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                           tma=True)
_FLOAT32 = LinearConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
_INTERPRETED = LinearConfig(block_m=64, block_n=64, block_k=64)


def linear_tilings(dtype: torch.dtype) -> tuple[LinearConfig, ...]:
    """Every tiling `pick_linear_config` may choose for `dtype` (they must agree bit for
    bit; the GPU tests compare them)."""
    if dtype == torch.float32:
        return (_FLOAT32,)
    return tuple(config for _, config in _TILINGS_16BIT) + (_WIDE_16_ROWS, _WIDE_64_ROWS,
                                                            _TMA_WIDE, _TMA_NARROW)


def pick_linear_config(m: int, n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """The tiling for `m` rows of weights [n, k] in `dtype` (see the module docstring for
    why m may choose it)."""
    if dtype == torch.float32:
        return _FLOAT32
    if m >= _TMA_MIN_ROWS:
        return _TMA_WIDE if m > 1024 or n > 4096 else _TMA_NARROW
    for max_rows, config in _TILINGS_16BIT:
        if max_rows is None or m <= max_rows:
            if n >= _WIDE_MIN_COLUMNS and config.block_m in (16, 64):
                return _WIDE_16_ROWS if config.block_m == 16 else _WIDE_64_ROWS
            return config
    raise AssertionError("the last tiling serves any number of rows")


# The row count changes from step to step and is not specialised on: Triton would compile
# a variant for 1 and one for multiples of 16, which a new prompt length could meet mid-run.
@triton.jit(do_not_specialize=["M"])
def _invariant_linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             _round(acc, dtype, SOFT_BF16), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """The (row tile, column tile) of the persistent kernel's `tile_id`-th tile: groups of
    GROUP_M row tiles sweep the column tiles together, so their weight tiles stay in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % in_group) % size_m, (tile_id % in_group) // size_m


@triton.jit(do_not_specialize=["M"])
def _invariant_linear_tma_kernel(
    x_desc, w_desc, out_desc, bias_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS,
                            flatten=True):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # the first kernel's chain: K from 0 upward
            a = x_desc.load([pid_m * BLOCK_M, k0])  # [BLOCK_M, BLOCK_K], zeros past M, K
            b = w_desc.load([pid_n * BLOCK_N, k0])  # [BLOCK_N, BLOCK_K], zeros past N, K
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple[bool, int, int]:
    """(whether the GPU has TMA, i.e. is Hopper or later; its multiprocessor count; the
    shared memory a program may use, in bytes)."""
    props = torch.cuda.get_device_properties(device)
    shared = int(getattr(props, "shared_memory_per_block_optin", 0)) or 48 * 1024
    return props.major >= 9, props.multi_processor_count, shared


@functools.lru_cache(maxsize=None)
def _fit_stages(config: LinearConfig, device: torch.device, element_size: int) -> LinearConfig:
    """`config` with as many load stages as the shared memory of the GPU `device` holds
    (at least 2) for operands of `element_size` bytes; worked out once per tiling (every
    projection of every step asks). The stages only pipeline the loads, so they never
    change a row's bits."""
    per_stage = (config.block_m + config.block_n) * config.block_k * element_size
    stages = config.num_stages
    while stages > 2 and stages * per_stage > _device_facts(device)[2]:
        stages -= 1
    return config if stages == config.num_stages else replace(config, num_stages=stages)


def _tma_describable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can load these 2-D tensors: a Hopper or later GPU, 16-byte aligned
    base addresses and row strides, contiguous rows."""
    first = tensors[0]
    if first.device.type != "cuda" or not _device_facts(first.device)[0]:
        return False
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0
               and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _launch_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor, config: LinearConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, k = x.shape
    n = weight.shape[0]
    # A program per SM whatever the tile count (those without a tile return at once): the
    # count is a compile-time constant, and one following the step's rows would compile a
    # kernel for every new count a prompt length brings.
    programs = _device_facts(x.device)[1]
    _invariant_linear_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]),
        TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]),
        TensorDescriptor.from_tensor(out, [config.block_m, config.block_n]),
        x if bias is None else bias, num_tokens, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, NUM_PROGRAMS=programs,
        num_warps=config.num_warps, num_stages=config.num_stages)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _checks.check_shape("x", x, (None, None), "[num_tokens, in_features]")
    _checks.check_shape("weight", weight, (None, x.shape[1]),
                        f"[out_features, in_features={x.shape[1]}]")
    _checks.check_dtype("x", x, _checks.FLOAT_DTYPES)
    _checks.check_same_dtype("x", x, weight=weight)
    _checks.check_kernel_device("x", x)
    _checks.check_same_device("x", x, weight=weight)
    _checks.check_inner_contiguous("x", x)
    _checks.check_inner_contiguous("weight", weight)
    if bias is not None:
        _checks.check_shape("bias", bias, (weight.shape[0],),
                            f"[out_features={weight.shape[0]}]")
        _checks.check_same_dtype("x", x, bias=bias)
        _checks.check_same_device("x", x, bias=bias)
        _checks.check_inner_contiguous("bias", bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     config: LinearConfig | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` with each output row independent of the number of rows.

    x: [num_tokens, in_features] (rows may be strided, the last dim contiguous);
    weight: [out_features, in_features] (the same); bias: [out_features] or None; one
    float dtype. Returns out [num_tokens, out_features] in that dtype: float32
    accumulation over K in a fixed order, the bias added in float32, rounded once.
    config: tiling override (tests, benchmarks); None: `pick_linear_config` (one tiling for
    every M under Triton's interpreter, whose numpy dots round by tile shape). Runs
    asynchronously on the current stream. Raises ValueError on a wrong device, dtype, shape
    or stride.
    """
    if not (x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and x.dtype in _checks.FLOAT_DTYPES and weight.dtype == x.dtype
            and x.device == weight.device and _on_kernel_device(x)
            and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype
                                  and bias.device == x.device and bias.stride(0) == 1))):
        _check_linear(x, weight, bias)
    num_tokens, k = x.shape
    n = weight.shape[0]
    out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or n == 0:
        return out
    interpreting = _checks.interpreting()
    if config is None:
        config = (_INTERPRETED if interpreting
                  else pick_linear_config(num_tokens, n, k, x.dtype))
    if config.tma and not interpreting and x.dtype != torch.float32 \
            and _tma_describable(x, weight, out):
        _launch_tma(x, weight, bias, out, config)
        return out
    if x.device.type == "cuda":
        config = _fit_stages(config, x.device, x.element_size())
    # Triton's interpreter computes bfloat16 dots wrongly; it gets float32 operands instead.
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting)
    grid = (triton.cdiv(num_tokens, config.block_m), triton.cdiv(n, config.block_n))
    _invariant_linear_kernel[grid](
        x, weight, x if bias is None else bias, out, num_tokens, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        DOT_FP32=dot_fp32, SOFT_BF16=interpreting,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
