"""Small values between the GPU and pinned host memory, moved by the SMs.

A `.tolist()`, `copy_` or `.to(device)` of a small tensor goes through the copy engines, in
the queue of every other transfer that way: behind a write-through of a prompt's blocks
(1 GiB for 8K tokens of an 8B model, ~20 ms on the bus) a step's sampled token ids wait
until the bulk copy has passed; behind a host-tier restore's copies (4 GiB for a 32K prefix,
~80 ms) so would a step's input upload. Here small programs load and store the values
through unified addressing (pinned pages are mapped into the GPU's address space), so they
never meet the copy engines: `store_to_host` is the engine's read-back of sampled ids;
`load_from_host` the other way (the engine's step inputs still go by `.to(device)`;
docs/KERNELS.md says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks

#: Values one program stores.
_BLOCK = 1024


@triton.jit
def _copy_values_kernel(src_ptr, dst_ptr, num_values, BLOCK: tl.constexpr):
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
    _copy_values(src, host, to_host=True)


def load_from_host(host: torch.Tensor, dst: torch.Tensor) -> None:
    """Write `host` into `dst[:len(host)]` with a kernel on the current stream.

    host: [n] contiguous, in pinned host memory (plain CPU memory under the interpreter)
    dst: [>= n] contiguous, of host's dtype, on CUDA (or the CPU under TRITON_INTERPRET=1)

    Asynchronous like any launch: the kernels queued after it on the stream see the values.
    The caller must not rewrite `host` before the stream has passed this launch (record an
    event after it). Raises ValueError on misuse.
    """
    _copy_values(host, dst, to_host=False)


def _copy_values(src: torch.Tensor, dst: torch.Tensor, to_host: bool) -> None:
    """Check, then launch the copy of src [n] into dst[:n]: `to_host`, dst is the pinned
    host side (`store_to_host`'s `host`), else src is (`load_from_host`'s)."""
    src_name, dst_name = ("src", "host") if to_host else ("host", "dst")
    host, device, device_name = (dst, src, src_name) if to_host else (src, dst, dst_name)
    _checks.check_kernel_device(device_name, device)
    if src.dim() != 1 or dst.dim() != 1:
        raise ValueError(f"{src_name} and {dst_name} must be 1-D, got shapes "
                         f"{tuple(src.shape)} and {tuple(dst.shape)}; flatten them first")
    if host.device.type != "cpu":
        raise ValueError(f"host is on {host.device}; it must be a pinned CPU tensor")
    if device.device.type == "cuda" and not host.is_pinned():
        raise ValueError(f"host is pageable; the GPU can only {'write' if to_host else 'read'} "
                         "pinned memory: allocate it with torch.empty(..., pin_memory=True)")
    if dst.dtype != src.dtype:
        raise ValueError(f"{dst_name} is {dst.dtype} but {src_name} is {src.dtype}; use one "
                         "dtype")
    if dst.shape[0] < src.shape[0]:
        raise ValueError(f"{dst_name} holds {dst.shape[0]} values, {src_name} has "
                         f"{src.shape[0]}; allocate a larger {'host' if to_host else 'device'} "
                         "buffer")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"{src_name} and {dst_name} must be contiguous; pass .contiguous() "
                         "copies")
    num_values = src.shape[0]
    if num_values == 0:
        return
    _copy_values_kernel[(triton.cdiv(num_values, _BLOCK),)](src, dst, num_values,
                                                            BLOCK=_BLOCK, num_warps=1)
