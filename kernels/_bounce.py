"""The "bounce" swap: scattered blocks on both sides moved as a few large DMA copies.

Small blocks in random host slots make one DMA copy each, and the copy engines move small
copies well below the bus's rate. Here both sides are gathered instead, a chunk at a time:

    GPU -> host: device gather (index_select)  -> device staging
                 one DMA                       -> pinned host staging
                 CPU scatter (index_copy_)     -> the host slots      (a host function)
    host -> GPU: the reverse: CPU gather, one DMA, device scatter.

Three streams form a pipeline: the caller's stream carries the DMA copies, in order (the
bus is the bottleneck and one copy at a time keeps it full), a high-priority side stream
the device gathers / scatters (HBM speed, a few percent of the bus time), and a second side
stream the CPU copies as stream-ordered host functions (`kernels._host_fn`). Each of the
`NUM_BUFFERS` staging buffers is reused only once the chunk that used it has passed every
stage (events). The GPU's SMs are busy only for the device gathers; the CPU copies run on
torch's intra-op threads.

With both tensors on the CPU the same chunk plan runs synchronously (how the tests
exercise it).
"""

from __future__ import annotations

import numpy as np
import torch
from kvtier.kernels._host_copy import HostCopier, host_copier
from kvtier.kernels._host_fn import HostFunctions

#: Staging buffers per side (a chunk waits for the one used `NUM_BUFFERS` chunks earlier).
NUM_BUFFERS = 3
#: A call aims for this many chunks: fewer cost less host time per call, more shorten the
#: pipeline's fill and drain (one chunk's gather and scatter are not overlapped).
_TARGET_CHUNKS = 12
_MIN_CHUNK_BYTES = 4 << 20


def chunk_blocks(num_blocks: int, block_bytes: int, staging_bytes: int) -> int:
    """Blocks per chunk: about `_TARGET_CHUNKS` chunks of at least 4 MiB, with
    `NUM_BUFFERS` chunks fitting in `staging_bytes` (at least one block)."""
    total = num_blocks * block_bytes
    wanted = max(_MIN_CHUNK_BYTES, -(-total // _TARGET_CHUNKS))
    chunk_bytes = min(wanted, staging_bytes // NUM_BUFFERS)
    return max(1, min(num_blocks, chunk_bytes // block_bytes))


def swap_bounce(gpu_words: torch.Tensor, host_words: torch.Tensor, gpu_ids: np.ndarray,
                host_ids: np.ndarray, to_gpu: bool, staging_bytes: int,
                host_fns: HostFunctions | None) -> None:
    """Copy `host_words[host_ids[i]] -> gpu_words[gpu_ids[i]]` (`to_gpu`) or the reverse.

    gpu_words / host_words: [n, words] views of the two sides (one word dtype); gpu_ids /
    host_ids: [num_blocks] int64; staging_bytes: bound on each side's staging memory.
    `host_fns` is required when `gpu_words` is on a GPU; with both on the CPU the plan runs
    synchronously. Enqueued on the current stream (see the module docstring).
    """
    order = np.argsort(host_ids, kind="stable")  # the CPU copies walk host memory in order
    gpu_ids, host_ids = gpu_ids[order], host_ids[order]
    num = gpu_ids.shape[0]
    words = gpu_words.shape[1]
    chunk = chunk_blocks(num, words * gpu_words.element_size(), staging_bytes)
    bounds = [(a, min(a + chunk, num)) for a in range(0, num, chunk)]
    copier = host_copier()
    host_slab = host_words.numpy()  # [n, words], shares memory
    if not gpu_words.is_cuda:
        gpu_index = torch.from_numpy(gpu_ids)
        host_rows, gpu_rows = host_words.new_empty((chunk, words)), gpu_words.new_empty(
            (chunk, words))
        for a, b in bounds:
            staged_host, staged_gpu = host_rows[:b - a], gpu_rows[:b - a]
            if to_gpu:
                copier.gather(host_slab, host_ids[a:b], staged_host.numpy())
                staged_gpu.copy_(staged_host)
                gpu_words.index_copy_(0, gpu_index[a:b], staged_gpu)
            else:
                torch.index_select(gpu_words, 0, gpu_index[a:b], out=staged_gpu)
                staged_host.copy_(staged_gpu)
                copier.scatter(host_slab, host_ids[a:b], staged_host.numpy())
        return
    assert host_fns is not None, "a CUDA bounce needs the host-function binding"
    _bounce_cuda(gpu_words, host_words, gpu_ids, host_ids, bounds, chunk, to_gpu, host_fns,
                 copier)


def _bounce_cuda(gpu_words: torch.Tensor, host_words: torch.Tensor, gpu_ids: np.ndarray,
                 host_ids: np.ndarray, bounds: list[tuple[int, int]], chunk: int,
                 to_gpu: bool, host_fns: HostFunctions, copier: HostCopier) -> None:
    stream = torch.cuda.current_stream(gpu_words.device)
    num_buffers = min(NUM_BUFFERS, len(bounds))
    words = gpu_words.shape[1]
    # [buffers, chunk, words]. The device staging is allocated on the caller's stream and
    # every use of it is joined back into that stream, so the allocator may hand it out
    # again afterwards. The pinned staging is freed only on an issuing thread (the host
    # functions' jobs hold it), after the caller's stream recorded its last copy.
    gpu_staging = gpu_words.new_empty((num_buffers, chunk, words))
    host_fns.collect()  # frees finished calls' pinned staging, for the allocator to reuse
    host_staging = torch.empty((num_buffers, chunk, words), dtype=host_words.dtype,
                               pin_memory=True)
    host_slab, host_rows = host_words.numpy(), host_staging.numpy()  # views, no copies
    ready = torch.cuda.Event()
    ready.record(stream)
    device_side = torch.cuda.Stream(gpu_words.device, priority=-1)
    host_side = torch.cuda.Stream(gpu_words.device)
    device_side.wait_event(ready)
    host_side.wait_event(ready)
    with torch.cuda.stream(device_side):
        # From pageable memory: the runtime copies the ids before the call returns.
        gpu_index = torch.from_numpy(gpu_ids).to(gpu_words.device, non_blocking=True)
    copied: list[torch.cuda.Event] = []  # per chunk: its DMA is done
    finished: list[torch.cuda.Event] = []  # per chunk: its last stage is done
    for i, (a, b) in enumerate(bounds):
        staged_gpu = gpu_staging[i % num_buffers, :b - a]
        staged_host = host_staging[i % num_buffers, :b - a]
        rows, slots = host_rows[i % num_buffers, :b - a], host_ids[a:b]
        first, dma, last = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()
        if to_gpu:
            if i >= num_buffers:
                host_side.wait_event(copied[i - num_buffers])
            host_fns.launch(host_side.cuda_stream, _gather_job(copier, host_slab, slots, rows))
            first.record(host_side)
            stream.wait_event(first)
            if i >= num_buffers:
                stream.wait_event(finished[i - num_buffers])
            staged_gpu.copy_(staged_host, non_blocking=True)
            dma.record(stream)
            device_side.wait_event(dma)
            with torch.cuda.stream(device_side):
                gpu_words.index_copy_(0, gpu_index[a:b], staged_gpu)
            last.record(device_side)
        else:
            if i >= num_buffers:
                device_side.wait_event(copied[i - num_buffers])
            with torch.cuda.stream(device_side):
                torch.index_select(gpu_words, 0, gpu_index[a:b], out=staged_gpu)
            first.record(device_side)
            stream.wait_event(first)
            if i >= num_buffers:
                stream.wait_event(finished[i - num_buffers])
            staged_host.copy_(staged_gpu, non_blocking=True)
            dma.record(stream)
            host_side.wait_event(dma)
            host_fns.launch(host_side.cuda_stream, _scatter_job(copier, host_slab, slots, rows))
            last.record(host_side)
        copied.append(dma)
        finished.append(last)
    for side in (device_side, host_side):
        done = torch.cuda.Event()
        done.record(side)
        stream.wait_event(done)


def _gather_job(copier: HostCopier, slab: np.ndarray, slots: np.ndarray, rows: np.ndarray):
    # The numpy views keep the pinned staging tensor alive (their base) until the job is
    # dropped on an issuing thread (see kernels._host_fn).
    def run() -> None:
        copier.gather(slab, slots, rows)
    return run


def _scatter_job(copier: HostCopier, slab: np.ndarray, slots: np.ndarray, rows: np.ndarray):
    def run() -> None:
        copier.scatter(slab, slots, rows)
    return run
