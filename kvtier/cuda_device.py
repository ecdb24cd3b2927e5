"""Which GPU a thread launches on.

CUDA's current device is per thread, and Triton launches its kernels on the current device
(as do torch's own allocations without an explicit device). An engine on `cuda:1` whose
threads still point at `cuda:0` would launch there with pointers into the other GPU, which
Triton refuses ("cannot be accessed from Triton"). Every thread that runs an engine's
kernels binds itself to the engine's device first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device; nothing for another kind.

    A "cuda" device without an index means the current device of the thread that named it,
    so it changes nothing here: to bind another thread, pass a tensor's device (always
    indexed), e.g. the KV cache's."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """`device` as the calling thread's current CUDA device inside the block, restored
    after it; nothing for another kind."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def used_on_current_stream(tensor: torch.Tensor) -> None:
    """`tensor`, made on another stream, has work queued on the calling thread's current
    stream: its memory is not handed out again before that work ran (nothing off CUDA)."""
    if tensor.device.type == "cuda":
        tensor.record_stream(torch.cuda.current_stream(tensor.device))


def urgent_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream on `device` whose kernels the GPU starts ahead of the default priority's
    whenever an SM comes free. The handoff reads, checks and receives on one: beside a
    prefill, whose matrix products hold every SM, a group's gather on a stream of default
    priority waits behind each of the products' waves."""
    return torch.cuda.Stream(device, priority=-1)  # lower numbers run first


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """`stream` as the current stream inside the block (its device's); nothing for None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
