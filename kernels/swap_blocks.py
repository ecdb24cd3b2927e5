"""swap_blocks: whole-block copies between GPU memory and pinned host memory.

Two methods move the same bytes:

* "triton": `kernels.copy_blocks._copy_blocks_kernel` run with one side in pinned host
  memory, which the GPU reads and writes directly through unified virtual addressing; many
  programs per block keep enough PCIe requests in flight. It occupies SMs while it runs.
* "dma": the copy engines. Mapping rows are sorted by source and runs of consecutive
  (src, dst) indices become single copies; all runs go to the runtime in one
  cudaMemcpyBatchAsync call when the runtime has it, else one `copy_(non_blocking=True)`
  per run. The SMs stay free for the model.

"auto" is the method measured faster on the GPU (docs/KERNELS.md has the numbers).
With both tensors on the CPU every method is a plain index copy, except "triton" under
TRITON_INTERPRET=1, which runs the kernel in the interpreter (how the tests exercise it).
"""

from __future__ import annotations

import contextlib

import torch
from kvtier.kernels import _checks
from kvtier.kernels._memcpy_batch import memcpy_batch
from kvtier.kernels.copy_blocks import launch_block_copy

SWAP_METHODS = ("auto", "triton", "dma")
#: What "auto" runs; chosen from the side-by-side measurement in docs/KERNELS.md.
AUTO_METHOD = "dma"
#: Programs of the "triton" method per SM: a few PCIe requests in flight per SM saturate the
#: link, and the rest of the GPU stays with the model (and a swap the other way).
_SWAP_PROGRAMS_PER_SM = 1


def coalesce_runs(pairs: list[list[int]]) -> list[tuple[int, int, int]]:
    """Rows (src, dst) -> runs (src_start, dst_start, num_blocks), sorted by source."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if runs:
            src_start, dst_start, count = runs[-1]
            if src == src_start + count and dst == dst_start + count:
                runs[-1] = (src_start, dst_start, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _dense(blocks: torch.Tensor) -> bool:
    """Consecutive blocks touch, so a run of them is one contiguous span."""
    return blocks.shape[0] <= 1 or blocks.stride(0) == blocks[0].numel()


def _swap_dma(src: torch.Tensor, dst: torch.Tensor, pairs: list[list[int]],
              use_batch: bool) -> None:
    """Copy engines on the current stream; see the module docstring."""
    runs = coalesce_runs(pairs)
    if not (_dense(src) and _dense(dst)):
        runs = [(s + i, d + i, 1) for s, d, n in runs for i in range(n)]
    binding = memcpy_batch() if use_batch else None
    stream = torch.cuda.current_stream() if src.is_cuda or dst.is_cuda else None
    if binding is not None and stream is not None and stream.cuda_stream != 0:
        block_bytes = src[0].numel() * src.element_size()
        src_stride = src.stride(0) * src.element_size()
        dst_stride = dst.stride(0) * dst.element_size()
        binding.copy([dst.data_ptr() + d * dst_stride for _, d, _ in runs],
                     [src.data_ptr() + s * src_stride for s, _, _ in runs],
                     [n * block_bytes for _, _, n in runs], stream.cuda_stream)
        return
    for s, d, n in runs:
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


def _check_swap_args(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                     method: str) -> None:
    if method not in SWAP_METHODS:
        raise ValueError(f"method must be one of {SWAP_METHODS}, got {method!r}")
    if src.dim() < 2 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src and dst must be [n, *block_shape] with one block shape, got "
                         f"{tuple(src.shape)} and {tuple(dst.shape)}")
    _checks.check_same_dtype("src", src, dst=dst)
    _checks.check_blocks_contiguous("src", src)
    _checks.check_blocks_contiguous("dst", dst)
    if block_mapping.device.type != "cpu":
        raise ValueError(f"block_mapping must be a CPU tensor (the DMA path reads it on the "
                         f"host), got one on {block_mapping.device}")
    _checks.check_block_mapping(block_mapping, src.shape[0], dst.shape[0])
    devices = {src.device.type, dst.device.type}
    if devices - {"cpu", "cuda"}:
        raise ValueError(f"swap_blocks moves blocks between CUDA and CPU tensors, got "
                         f"{src.device} and {dst.device}")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise ValueError(f"src is on {src.device} and dst on {dst.device}; swap_blocks copies "
                         "within one GPU or between a GPU and host memory")
    if devices == {"cpu", "cuda"}:
        host_name, host = ("src", src) if src.device.type == "cpu" else ("dst", dst)
        if not host.is_pinned():
            raise ValueError(f"{host_name} is in pageable host memory; asynchronous copies "
                             f"(both methods) need pinned memory: allocate it with "
                             f"pin_memory=True or call .pin_memory()")


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                method: str = "auto", stream: torch.cuda.Stream | None = None) -> None:
    """Copy whole blocks `src[m[i, 0]] -> dst[m[i, 1]]`, asynchronously when a GPU is involved.

    src: [n_src, *block_shape]; dst: [n_dst, *block_shape]; one dtype, each block one
        contiguous span. One on a GPU and the other in pinned host memory, both on the same
        GPU, or both on the CPU.
    block_mapping: [n, 2] int64 CPU tensor of (src_index, dst_index) rows; destinations
        must be distinct.
    method: "triton", "dma" or "auto" (see the module docstring).
    stream: where the copies are enqueued; None means the current stream. The caller keeps
        src, dst and the host memory alive and unchanged until the stream reaches them.

    Raises ValueError for an unknown method, mismatched blocks, out-of-range indices,
    pageable host memory, or "triton" with only CPU tensors outside the interpreter;
    OSError when the CUDA runtime rejects a batched copy.
    """
    _check_swap_args(src, dst, block_mapping, method)
    if block_mapping.shape[0] == 0:
        return
    if method == "auto":
        method = AUTO_METHOD
    gpu = src if src.is_cuda else dst if dst.is_cuda else None
    if gpu is None:
        if method == "triton":
            if not _checks.interpreting():
                raise ValueError("method='triton' needs a CUDA tensor (or TRITON_INTERPRET=1); "
                                 "use method='dma' or 'auto' for CPU tensors")
            launch_block_copy(src, dst, block_mapping.contiguous())
        else:
            _swap_dma(src, dst, block_mapping.tolist(), use_batch=False)
        return
    with contextlib.ExitStack() as scope:
        scope.enter_context(torch.cuda.device(gpu.device))
        if stream is not None:
            scope.enter_context(torch.cuda.stream(stream))
        if method == "triton":
            mapping = block_mapping.to(gpu.device, non_blocking=True).contiguous()
            num_sms = torch.cuda.get_device_properties(gpu.device).multi_processor_count
            launch_block_copy(src, dst, mapping, _SWAP_PROGRAMS_PER_SM * num_sms)
        else:
            _swap_dma(src, dst, block_mapping.tolist(), use_batch=True)
