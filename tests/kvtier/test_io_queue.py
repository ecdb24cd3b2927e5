"""IOQueue with real threads: reads before reads ahead before writes, a thread always left
to reads, backpressure, and a close that lets the queued jobs run first."""

import threading

import pytest

from kvtier.io_queue import IOQueue


def handed_out(q: IOQueue[str], num_jobs: int) -> list[str]:
    """The next `num_jobs` jobs `get` hands out on one thread, each write marked done."""
    order = []
    for _ in range(num_jobs):
        job, is_write = q.get()
        order.append(job)
        if is_write:
            q.write_done()
    return order


def test_reads_go_before_writes_each_in_submission_order():
    q: IOQueue[str] = IOQueue(capacity=8, num_threads=1)
    for name, is_write in (("w1", True), ("r1", False), ("w2", True), ("r2", False)):
        q.put(name, is_write)
    assert handed_out(q, 4) == ["r1", "r2", "w1", "w2"]


def test_reads_ahead_go_after_the_reads_restores_wait_on_and_before_writes():
    q: IOQueue[str] = IOQueue(capacity=8, num_threads=1)
    for name, is_write, ahead in (("a1", False, True), ("w1", True, False),
                                  ("a2", False, True), ("r1", False, False)):
        q.put(name, is_write, ahead=ahead)
    assert len(q) == 4
    assert handed_out(q, 4) == ["r1", "a1", "a2", "w1"]
    q.close()
    assert q.get() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_threads", "max_writers"), [(1, 1), (2, 1), (4, 3)])
def test_writes_wait_for_a_writer_to_finish_while_reads_do_not(num_threads, max_writers):
    q: IOQueue[str] = IOQueue(capacity=16, num_threads=num_threads)
    assert q.max_writers == max_writers
    for i in range(max_writers + 1):
        q.put(f"w{i}", is_write=True)
    for _ in range(max_writers):
        assert q.get()[1] is True
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # the last write waits for a writer
    q.put("r", is_write=False)
    waiter.join(timeout=30)
    assert got == [("r", False)]  # a read is handed out at once
    q.write_done()
    assert q.get() == (f"w{max_writers}", True)


@pytest.mark.timeout(60)
def test_a_full_queue_blocks_put_until_a_job_is_taken():
    q: IOQueue[str] = IOQueue(capacity=1, num_threads=2)
    q.put("a", is_write=False)
    putter = threading.Thread(target=q.put, args=("b", False))
    putter.start()
    putter.join(timeout=0.2)
    assert putter.is_alive() and len(q) == 1
    assert q.get() == ("a", False)
    putter.join(timeout=30)
    assert not putter.is_alive() and q.get() == ("b", False)


@pytest.mark.timeout(60)
def test_close_lets_queued_jobs_run_then_stops_every_thread():
    q: IOQueue[str] = IOQueue(capacity=8, num_threads=2)
    q.put("w1", is_write=True)
    q.put("w2", is_write=True)
    q.close()
    with pytest.raises(ValueError, match="closed"):
        q.put("late", is_write=False)
    ran: list[str] = []

    def worker() -> None:
        while (item := q.get()) is not None:
            ran.append(item[0])
            q.write_done()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and sorted(ran) == ["w1", "w2"]


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        IOQueue(capacity=0, num_threads=1)
    with pytest.raises(ValueError, match="positive"):
        IOQueue(capacity=1, num_threads=0)


@pytest.mark.timeout(60)
def test_serial_writes_run_one_at_a_time_leaving_threads_to_reads():
    """Two serial writes (the disk's) on four threads: the second waits for the first,
    and so does an ordinary write queued behind it, while reads are handed out."""
    q: IOQueue[str] = IOQueue(capacity=16, num_threads=4)
    for name, serial in (("disk1", True), ("disk2", True), ("remote", False)):
        q.put(name, is_write=True, serial=serial)
    assert q.get() == ("disk1", True)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # a writer is free, but disk2 waits for disk1
    q.put("r", is_write=False)
    waiter.join(timeout=30)
    assert got == [("r", False)]
    q.write_done(serial=True)
    assert q.get() == ("disk2", True)
    assert q.get() == ("remote", True)  # not serial: it runs beside disk2
