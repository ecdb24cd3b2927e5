"""store_to_host: a few values from the GPU into pinned host memory, written by the SMs.

A `.tolist()` or `copy_` of a GPU tensor goes through the copy engines, in the queue of
every other device-to-host transfer: behind a write-through of a prompt's blocks (1 GiB for
8K tokens of an 8B model, ~20 ms on the bus), a step's sampled token ids wait until the bulk
copy has passed. Here one small program stores the values through unified addressing
(pinned pages are mapped into the GPU's address space), so the read-back never meets the
copy engines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks

#: Values one program stores.
_BLOCK = 1024


@triton.jit
def _store_to_host_kernel(src_ptr, dst_ptr, num_values, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_values
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=valid), mask=valid)


def store_to_host(src: torch.Tensor, host: torch.Tensor) -> None:
    """Write `src` into `host[:len(src)]` with a kernel on the current stream.

    src: [n] contiguous, on CUDA (or the CPU under TRITON_INTERPRET=1)
    host: [>= n] contiguous, of src's dtype, in pinned host memory (plain CPU memory under
        the interpreter)

    Asynchronous like any launch: synchronize the stream (or an event recorded after this
    call) before reading `host`. Raises ValueError on misuse.
    """
    _checks.check_kernel_device("src", src)
    if src.dim() != 1 or host.dim() != 1:
        raise ValueError(f"src and host must be 1-D, got shapes {tuple(src.shape)} and "
                         f"{tuple(host.shape)}; flatten them first")
    if host.device.type != "cpu":
        raise ValueError(f"host is on {host.device}; it must be a pinned CPU tensor")
    if src.device.type == "cuda" and not host.is_pinned():
        raise ValueError("host is pageable; the GPU can only write pinned memory: allocate "
                         "it with torch.empty(..., pin_memory=True)")
    if host.dtype != src.dtype:
        raise ValueError(f"host is {host.dtype} but src is {src.dtype}; use one dtype")
    if host.shape[0] < src.shape[0]:
        raise ValueError(f"host holds {host.shape[0]} values, src has {src.shape[0]}; "
                         "allocate a larger host buffer")
    if not (src.is_contiguous() and host.is_contiguous()):
        raise ValueError("src and host must be contiguous; pass .contiguous() copies")
    num_values = src.shape[0]
    if num_values == 0:
        return
    _store_to_host_kernel[(triton.cdiv(num_values, _BLOCK),)](src, host, num_values,
                                                              BLOCK=_BLOCK, num_warps=1)
