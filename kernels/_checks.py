"""Argument checks shared by the kernel launchers.

Every check raises ValueError naming the argument, what was wrong and what to pass instead;
launchers call them before touching the GPU so misuse never reaches a kernel.
"""

from __future__ import annotations

import os

import torch

#: Cache / activation dtypes the attention and store kernels accept.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """The tensor must live where Triton kernels run: CUDA, or the CPU under the interpreter."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and interpreting():
        return
    raise ValueError(f"{name} is on {tensor.device}; Triton kernels need CUDA tensors (or "
                     "TRITON_INTERPRET=1 for CPU tensors). Use kernels.reference on the CPU.")


def check_same_device(reference_name: str, reference: torch.Tensor,
                      **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        if tensor.device != reference.device:
            raise ValueError(f"{name} is on {tensor.device} but {reference_name} is on "
                             f"{reference.device}; move them to one device")


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of "
                         f"{[str(d) for d in allowed]}")


def check_same_dtype(reference_name: str, reference: torch.Tensor,
                     **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        if tensor.dtype != reference.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype} but {reference_name} has "
                             f"{reference.dtype}; cast them to one dtype")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int | None, ...],
                meaning: str) -> None:
    """`shape` entries of None match any size; `meaning` spells the expected shape."""
    ok = tensor.dim() == len(shape) and all(
        want is None or want == got for want, got in zip(shape, tensor.shape))
    if not ok:
        raise ValueError(f"{name} must be {meaning}, got shape {tuple(tensor.shape)}")


def check_inner_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The last dimension must be contiguous (stride 1) so rows load as wide vectors."""
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides "
                         f"{tensor.stride()}; pass a .contiguous() tensor or a layer view")


def check_blocks_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Each block `tensor[i]` must be one contiguous span (blocks may be spaced apart)."""
    inner = tensor[0] if tensor.shape[0] > 0 else tensor.new_empty(tensor.shape[1:])
    if not inner.is_contiguous():
        raise ValueError(f"{name} must hold each block as one contiguous span, got strides "
                         f"{tensor.stride()}; pass the cross-layer cache or a host slab")


def check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    """An int64 [n, 2] tensor of (src_index, dst_index) rows within range.

    Index ranges are checked only for CPU mappings: reading a device tensor back would
    stall the stream the caller is trying to keep busy.
    """
    check_dtype("block_mapping", block_mapping, (torch.int64,))
    check_shape("block_mapping", block_mapping, (None, 2), "[n, 2] rows (src_index, dst_index)")
    if block_mapping.device.type != "cpu" or block_mapping.shape[0] == 0:
        return
    rows = block_mapping.numpy()  # a view: numpy's reductions cost a fraction of torch's
    low, src_high, dst_high = int(rows.min()), int(rows[:, 0].max()), int(rows[:, 1].max())
    if low < 0 or src_high >= num_src or dst_high >= num_dst:
        raise ValueError(f"block_mapping indices out of range: sources must lie in "
                         f"[0, {num_src}) and destinations in [0, {num_dst}), got min {low}, "
                         f"max source {src_high}, max destination {dst_high}")
