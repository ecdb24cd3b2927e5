"""TransferEngine: swaps and I/O jobs report through get_finished, failures are ok=False,
many threads may submit at once, and a full I/O queue blocks the submitter."""

import threading

import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.stats import Direction
from kvtier.transfer import IOJob, SwapJob, TransferEngine

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_blocks(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included): copies must be byte-exact."""
    generator = torch.Generator().manual_seed(seed)
    num_bytes = num_blocks * layout.bytes_per_block
    raw = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)
    return raw.view(layout.dtype).view(num_blocks, *layout.block_shape)


@pytest.fixture
def engine():
    transfers = TransferEngine("cpu", io_threads=2, max_pending_io=4)
    yield transfers
    transfers.close()


def drain(engine: TransferEngine, num_jobs: int) -> dict:
    results: dict = {}
    while len(results) < num_jobs:
        engine.wait_all()
        for job_id, ok in engine.get_finished():
            assert job_id not in results, f"job {job_id} reported twice"
            results[job_id] = ok
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_copies_blocks_byte_exact(engine, dtype):
    layout = KVLayout(2, 2, 8, 4, dtype)
    src = random_blocks(layout, 5, seed=1)  # [5, *block_shape]
    dst = torch.zeros(4, *layout.block_shape, dtype=dtype)
    mapping = torch.tensor([[4, 0], [1, 3], [2, 1]], dtype=torch.int64)
    job_id = engine.submit(SwapJob(Direction.GPU_TO_HOST, src, dst, mapping))
    assert engine.get_finished() == [(job_id, True)]
    assert engine.get_finished() == []
    for src_index, dst_index in mapping.tolist():
        assert torch.equal(dst[dst_index].view(torch.uint8), src[src_index].view(torch.uint8))
    assert torch.count_nonzero(dst[2].view(torch.uint8)) == 0  # untouched
    stats = engine.stats()[Direction.GPU_TO_HOST]
    assert stats.num_jobs == 1 and stats.num_bytes == 3 * layout.bytes_per_block


def test_failing_jobs_report_not_ok(engine):
    layout = KVLayout(1, 1, 4, 2, torch.float32)
    src = random_blocks(layout, 2, seed=2)
    wrong = torch.zeros(2, 3, dtype=torch.float32)  # not block-shaped: the copy raises
    swap_id = engine.submit(SwapJob(Direction.HOST_TO_GPU, src, wrong,
                                    torch.tensor([[0, 0]], dtype=torch.int64)))

    def broken() -> int:
        raise OSError("disk gone")

    io_id = engine.submit(IOJob(Direction.HOST_TO_DISK, broken))
    assert drain(engine, 2) == {swap_id: False, io_id: False}
    stats = engine.stats()
    assert stats[Direction.HOST_TO_GPU].failures == 1
    assert stats[Direction.HOST_TO_DISK].failures == 1
    assert stats[Direction.HOST_TO_DISK].num_bytes == 0


def test_jobs_must_fit_their_kind(engine):
    src = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="GPU <-> host"):
        engine.submit(SwapJob(Direction.HOST_TO_DISK, src, src, torch.zeros(0, 2)))
    with pytest.raises(ValueError, match="host <-> disk"):
        engine.submit(IOJob(Direction.GPU_TO_HOST, lambda: 0))
    with pytest.raises(ValueError, match="never submitted"):
        engine.wait([12345])


def test_many_threads_submit_at_once(engine):
    layout = KVLayout(1, 1, 4, 2, torch.float16)
    num_threads, jobs_per_thread = 8, 40
    src = random_blocks(layout, num_threads, seed=3)
    dst = torch.zeros_like(src)
    written = [[0] * jobs_per_thread for _ in range(num_threads)]
    submitted: list[list[int]] = [[] for _ in range(num_threads)]
    barrier = threading.Barrier(num_threads)

    def submitter(t: int) -> None:
        barrier.wait()
        for j in range(jobs_per_thread):
            if j % 4 == 0:
                mapping = torch.tensor([[t, t]], dtype=torch.int64)
                job = SwapJob(Direction.GPU_TO_HOST, src, dst, mapping)
            else:
                def run(t=t, j=j) -> int:
                    written[t][j] += 1
                    return 1
                job = IOJob(Direction.DISK_TO_HOST, run)
            submitted[t].append(engine.submit(job))

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    all_ids = [job_id for ids in submitted for job_id in ids]
    assert len(set(all_ids)) == num_threads * jobs_per_thread, "job ids are not unique"
    results = drain(engine, len(all_ids))
    assert set(results) == set(all_ids) and all(results.values())
    # Every I/O job ran exactly once, every swap landed.
    assert all(written[t][j] == (0 if j % 4 == 0 else 1)
               for t in range(num_threads) for j in range(jobs_per_thread))
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    stats = engine.stats()
    assert stats[Direction.DISK_TO_HOST].num_jobs == num_threads * 30
    assert engine.num_in_flight == 0


def test_wait_blocks_until_the_job_finished(engine):
    release = threading.Event()
    job_id = engine.submit(IOJob(Direction.DISK_TO_HOST, lambda: int(release.wait()) * 7))
    waiter_done = threading.Event()

    def waiter() -> None:
        engine.wait([job_id])
        waiter_done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert engine.num_in_flight == 1 and not waiter_done.is_set()
    release.set()
    thread.join()
    assert waiter_done.is_set()
    assert engine.get_finished() == [(job_id, True)]
    engine.wait([job_id])  # already reported: returns at once
    assert engine.stats()[Direction.DISK_TO_HOST].num_bytes == 7


def test_a_full_io_queue_blocks_the_submitter():
    engine = TransferEngine("cpu", io_threads=1, max_pending_io=1)
    running, release = threading.Event(), threading.Event()

    def blocked() -> int:
        running.set()
        release.wait()
        return 0

    engine.submit(IOJob(Direction.HOST_TO_DISK, blocked))
    running.wait()  # the only worker is busy
    engine.submit(IOJob(Direction.HOST_TO_DISK, lambda: 0))  # fills the one queue place
    third_submitted = threading.Event()

    def submit_third() -> None:
        engine.submit(IOJob(Direction.HOST_TO_DISK, lambda: 0))
        third_submitted.set()

    thread = threading.Thread(target=submit_third)
    thread.start()
    thread.join(timeout=0.2)
    # Backpressure: the third submit waits for room instead of growing the queue.
    assert thread.is_alive() and not third_submitted.is_set()
    release.set()
    thread.join()
    assert third_submitted.is_set()
    engine.close()
    assert engine.stats()[Direction.HOST_TO_DISK].num_jobs == 3
    with pytest.raises(ValueError, match="closed"):
        engine.submit(IOJob(Direction.HOST_TO_DISK, lambda: 0))


def test_queued_reads_run_before_queued_writes():
    engine = TransferEngine("cpu", io_threads=1, max_pending_io=8)
    running, release = threading.Event(), threading.Event()
    order: list[str] = []

    def blocked() -> int:
        running.set()
        release.wait()
        return 0

    def job(name: str):
        return lambda: order.append(name) or 0

    engine.submit(IOJob(Direction.HOST_TO_DISK, blocked))
    running.wait()  # the only worker is busy: everything below queues
    for name in ("write 1", "write 2", "read 1", "write 3", "read 2"):
        direction = Direction.DISK_TO_HOST if name.startswith("read") else \
            Direction.HOST_TO_DISK
        engine.submit(IOJob(direction, job(name)))
    release.set()
    engine.close()
    # A restore has a request waiting on it; write-backs run ahead of demand.
    assert order == ["read 1", "read 2", "write 1", "write 2", "write 3"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_swaps_on_the_copy_stream(dtype):
    layout = KVLayout(2, 2, 64, 16, dtype)
    engine = TransferEngine("cuda", io_threads=1)
    source = random_blocks(layout, 6, seed=4).cuda()
    host = torch.zeros(6, *layout.block_shape, dtype=dtype, pin_memory=True)
    mapping = torch.tensor([[i, 5 - i] for i in range(6)], dtype=torch.int64)
    gpu = torch.zeros_like(source)
    torch.cuda._sleep(50_000_000)  # keeps the compute stream busy ...
    gpu.copy_(source)  # ... so this write is still queued when the swap is submitted
    out_id = engine.submit(SwapJob(Direction.GPU_TO_HOST, gpu, host, mapping))
    engine.wait([out_id])
    back = torch.zeros_like(gpu)
    in_id = engine.submit(SwapJob(Direction.HOST_TO_GPU, host, back, mapping))
    engine.wait([in_id])
    assert sorted(engine.get_finished()) == [(out_id, True), (in_id, True)]
    assert torch.equal(back.view(torch.uint8), gpu.view(torch.uint8))
    assert engine.stats()[Direction.HOST_TO_GPU].seconds > 0
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_triton_copies_need_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TransferEngine("cpu", swap_method="triton")


@pytest.mark.timeout(60)
def test_a_read_runs_while_writes_hold_every_thread_they_may():
    engine = TransferEngine("cpu", io_threads=4, max_pending_io=16)
    release = threading.Event()
    writing = threading.Semaphore(0)
    read_done = threading.Event()

    def held_write() -> int:
        writing.release()
        release.wait()
        return 0

    try:
        for _ in range(4):  # more writes than threads
            engine.submit(IOJob(Direction.HOST_TO_DISK, held_write))
        for _ in range(3):  # all threads but one write
            assert writing.acquire(timeout=30)
        assert not writing.acquire(timeout=0.2)  # the fourth write waits for one of them
        engine.submit(IOJob(Direction.DISK_TO_HOST, lambda: read_done.set() or 0))
        assert read_done.wait(timeout=30)  # a free thread took the read at once
    finally:
        release.set()
    engine.close()
    assert engine.stats()[Direction.HOST_TO_DISK].num_jobs == 4


@pytest.mark.timeout(30)
def test_wait_any_returns_as_an_io_job_finishes():
    engine = TransferEngine("cpu", io_threads=1, max_pending_io=4)
    landed = threading.Event()
    try:
        job = engine.submit(IOJob(Direction.DISK_TO_HOST, lambda: landed.wait() and 0))
        threading.Timer(0.05, landed.set).start()
        engine.wait_any(timeout_s=600)  # woken by the read, long before its timeout
        assert engine.get_finished() == [(job, True)]
    finally:
        landed.set()
        engine.close()
