"""store_to_host and load_from_host (small values moved by the SMs through unified addressing)
against the reference."""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import load_from_host, reference, store_to_host

COPIES = {"store_to_host": store_to_host, "load_from_host": load_from_host}


@cases.needs_interpreter
@pytest.mark.parametrize("way", ["store_to_host", "load_from_host"])
@pytest.mark.parametrize("num_values", [1, 7, 1024, 1500])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32], ids=str)
def test_copies_match_reference(way: str, dtype: torch.dtype, num_values: int) -> None:
    src = (torch.arange(num_values) * 7919 - 5).to(dtype)
    dst = torch.full((num_values + 3,), -1).to(dtype)
    expected = dst.clone()
    COPIES[way](src, dst)
    getattr(reference, way)(src, expected)
    assert torch.equal(dst, expected)
    assert (dst[num_values:] == -1).all(), "values past src were written"


@cases.needs_interpreter
@pytest.mark.parametrize(("way", "dst_kind"), [("store_to_host", "host"),
                                               ("load_from_host", "device")])
def test_copies_reject_misuse(way: str, dst_kind: str) -> None:
    copy = COPIES[way]
    src = torch.arange(4)
    with pytest.raises(ValueError, match="1-D"):
        copy(src.view(2, 2), torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype|int32"):
        copy(src, torch.empty(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"larger {dst_kind} buffer"):
        copy(src, torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        copy(torch.arange(8)[::2], torch.empty(4, dtype=torch.int64))


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_store_to_host_lands_in_pinned_memory() -> None:
    src = torch.randint(0, 128_000, (300,), device="cuda")
    host = torch.empty(512, dtype=torch.int64, pin_memory=True)
    store_to_host(src, host)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host[:300], src.cpu())
    with pytest.raises(ValueError, match="pageable"):
        store_to_host(src, torch.empty(512, dtype=torch.int64))
    with pytest.raises(ValueError, match="pinned CPU tensor"):
        store_to_host(src, torch.empty(512, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_store_to_host_does_not_wait_for_a_bulk_device_to_host_copy() -> None:
    """The ids land while a long copy-engine transfer on another stream is still running:
    the read-back does not queue behind it (a tiny copy_ would)."""
    bulk_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    bulk_dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    ids = torch.arange(16, device="cuda")
    host = torch.empty(16, dtype=torch.int64, pin_memory=True)
    bulk_done, ids_done = torch.cuda.Event(), torch.cuda.Event()
    store_to_host(ids, host)  # compiled and loaded before the timed part
    torch.cuda.synchronize()
    host.fill_(-1)
    with torch.cuda.stream(side):
        for _ in range(4):  # ~80 ms on a 50 GB/s bus
            bulk_dst.copy_(bulk_src, non_blocking=True)
        bulk_done.record(side)
    store_to_host(ids, host)
    ids_done.record()
    ids_done.synchronize()
    assert not bulk_done.query(), "the bulk copy ended first: the test proves nothing"
    assert torch.equal(host, torch.arange(16)), "the ids had not landed at their event"
    torch.cuda.synchronize()


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_load_from_host_reads_pinned_memory() -> None:
    host = torch.randint(0, 128_000, (3000,)).pin_memory()
    dst = torch.full((4096,), -1, dtype=torch.int64, device="cuda")
    load_from_host(host, dst)
    assert torch.equal(dst[:3000].cpu(), host) and (dst[3000:] == -1).all()
    with pytest.raises(ValueError, match="pageable"):
        load_from_host(torch.arange(8), dst)
    with pytest.raises(ValueError, match="pinned CPU tensor"):
        load_from_host(dst[:8].clone(), dst)


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_load_from_host_does_not_wait_for_a_bulk_host_to_device_copy() -> None:
    """The values land, and a kernel queued after them runs, while a long copy-engine
    transfer to the GPU on another stream still runs (GPU time, from CUDA events): a tiny
    `.to(device)` would queue behind it (docs/KERNELS.md, "store_to_host and load_from_host")."""
    bulk_src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    bulk_dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    host = torch.arange(16).pin_memory()
    dst = torch.empty(16, dtype=torch.int64, device="cuda")
    start, bulk_done, used = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    load_from_host(host, dst)  # compiled and loaded before the timed part, and so is the
    doubled = dst * 2  # kernel that reads the values: loading a module may wait for the GPU
    torch.cuda.synchronize()
    dst.fill_(-1)
    start.record()
    side.wait_event(start)
    with torch.cuda.stream(side):
        for _ in range(4):  # ~80 ms on a 50 GB/s bus
            bulk_dst.copy_(bulk_src, non_blocking=True)
        bulk_done.record(side)
    load_from_host(host, dst)
    doubled = dst * 2  # a kernel that reads the values
    used.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(used) < start.elapsed_time(bulk_done) / 4
    assert torch.equal(doubled.cpu(), torch.arange(16) * 2)
