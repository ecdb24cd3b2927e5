"""Triton kernels for the paged KV cache, each with a typed launcher and a pure-torch
reference in `kernels.reference` (the CPU path and the ground truth in tests)."""

from kernels import reference

__all__ = ["reference"]
