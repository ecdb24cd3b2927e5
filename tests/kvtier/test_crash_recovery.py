"""A process killed with SIGKILL while it writes blocks to the disk tier loses nothing it
committed and leaves nothing half-written.

A real child process writes batches of blocks from two threads (as the tier manager's I/O
threads do) and prints each batch's hashes once `put()` returned. The parent kills it at a
seeded random moment, then opens the directory as the next process would: every printed
block is there byte for byte, every stored value passes its checks, the access-order index
and the byte counter agree with the values, and the directory takes new writes (the next
child goes on writing into it, and is killed in turn).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.disk import admin as disk_admin
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, encode_record, metas_for

REPO_ROOT = Path(__file__).resolve().parents[2]
# 64 KiB blocks, 8 per batch: a commit writes half a MiB, so a kill often lands inside one.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16,
                  dtype=torch.float32)
BLOCKS_PER_BATCH = 8
NUM_WRITER_THREADS = 2
BIG_BUDGET = 1 << 30

# The child runs `writer_main` of this very file (through runpy: tests is not a package).
CHILD = ("import runpy, sys; "
         "runpy.run_path(sys.argv[1])['writer_main'](sys.argv[2], int(sys.argv[3]), "
         "int(sys.argv[4]))")


def batch_blocks(batch: int) -> tuple[list[BlockMeta], list[np.ndarray]]:
    """The blocks of batch `batch`: one chained sequence, payloads random bytes seeded by
    the batch, so the parent regenerates exactly what the child wrote."""
    parent = namespace_hash("crash-writer", LAYOUT)
    token_ids = [(batch * 131 + i) % 50_000 for i in range(BLOCKS_PER_BATCH * LAYOUT.block_size)]
    hashes = hash_blocks(parent, token_ids, LAYOUT.block_size)
    metas = metas_for(parent, hashes, token_ids, LAYOUT.block_size)
    rng = np.random.default_rng(batch)
    payloads = [rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8) for _ in metas]
    return metas, payloads


def writer_main(path: str, budget: int, first_batch: int) -> None:
    """The child: thread t writes batches first + t, first + t + 2, ... forever; a batch's
    line (batch, blocks present, hashes) is printed only after its put() returned."""
    torch.set_num_threads(1)
    tier = DiskTier(path, LAYOUT, budget)
    print_lock = threading.Lock()

    def write(batch: int) -> None:
        while True:
            metas, payloads = batch_blocks(batch)
            num_present = sum(tier.put(metas, payloads))
            with print_lock:
                print(batch, num_present, *(m.block_hash.hex() for m in metas), flush=True)
            batch += NUM_WRITER_THREADS

    print("ready", flush=True)  # before any batch line: the parent reads it first
    threads = [threading.Thread(target=write, args=(first_batch + t,))
               for t in range(NUM_WRITER_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_and_kill(disk_dir: Path, budget: int, first_batch: int,
                 rng: random.Random) -> list[tuple[int, list[str]]]:
    """Start a writer, let it commit a random number of batches, SIGKILL it at a random
    moment after that. Returns the batches it reported as committed, in report order."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, __file__, str(disk_dir), str(budget),
                             str(first_batch)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reported: list[tuple[int, list[str]]] = []
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline().strip()
        if first != "ready":
            proc.kill()  # so that its stderr ends and can be read whole
            pytest.fail(f"the writer said {first!r} first:\n{proc.stderr.read()[-3000:]}")
        wanted = rng.randint(2, 8)
        while len(reported) < wanted:
            line = proc.stdout.readline()
            assert line, f"the writer died on its own:\n{proc.stderr.read()[-3000:]}"
            if not stored_whole(line):
                proc.kill()  # so that its stderr ends and can be read whole
                pytest.fail(f"the writer could not store: {line}\n{proc.stderr.read()[-3000:]}")
            reported.append(parse(line))
        time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside a later commit, or between
        proc.send_signal(signal.SIGKILL)
        remaining, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # Lines printed between the last read and the kill report commits too; a line cut short
    # by the kill proves nothing.
    for line in remaining.splitlines():
        if len(line.split()) == 2 + BLOCKS_PER_BATCH:
            reported.append(parse(line))
    return reported


def stored_whole(line: str) -> bool:
    """Whether a batch line reports all of its blocks present after its put()."""
    return int(line.split()[1]) == BLOCKS_PER_BATCH


def parse(line: str) -> tuple[int, list[str]]:
    batch, num_present, *hashes = line.split()
    assert int(num_present) == BLOCKS_PER_BATCH, f"the writer could not store: {line}"
    return int(batch), hashes


def check_directory(disk_dir: Path, budget: int, must_hold: list[int],
                    may_hold: list[int] = ()) -> int:
    """What the next process must find: every block of `must_hold` byte-exact, those of
    `may_hold` byte-exact or absent (pruned), every stored value whole, and the index in
    agreement with the values. Returns the number of stored blocks."""
    report = disk_admin.verify(disk_dir)
    assert report.bad == () and report.index_errors == 0, report
    with DiskTier(disk_dir, LAYOUT, budget) as tier:
        assert not tier.format_reset
        for batch in [*must_hold, *may_hold]:
            metas, payloads = batch_blocks(batch)
            for meta, payload in zip(metas, payloads):
                dest = torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8)
                if tier.get_into(meta, dest):
                    assert np.array_equal(dest.numpy(), payload), f"batch {batch}: other bytes"
                else:
                    assert batch not in must_hold, f"a committed block of batch {batch} is lost"
        stats = tier.stats()
        assert stats.rejected == 0, "a stored value failed its checks"
        assert stats.bytes_used <= budget
        return stats.num_blocks


@pytest.mark.timeout(300)
def test_sigkill_while_writing_loses_no_committed_block(tmp_path):
    rng = random.Random(0)
    disk_dir = tmp_path / "kv"
    # Three writers in a row on one directory, each killed: each starts on what the one
    # before left, so the recovery from a kill is exercised again by the next.
    committed: list[int] = []
    first_batch = 0
    for _ in range(3):
        for batch, hashes in run_and_kill(disk_dir, BIG_BUDGET, first_batch, rng):
            assert hashes == [m.block_hash.hex() for m in batch_blocks(batch)[0]]
            committed.append(batch)
        num_blocks = check_directory(disk_dir, BIG_BUDGET, committed)
        # Anything more is a batch a thread was committing when the kill came; it too
        # passed verify() above, so it is whole.
        assert num_blocks >= len(committed) * BLOCKS_PER_BATCH
        first_batch = max(committed) + 1 + NUM_WRITER_THREADS
    # The directory still takes writes, here in this process.
    metas, payloads = batch_blocks(10_000)
    with DiskTier(disk_dir, LAYOUT, BIG_BUDGET) as tier:
        assert sum(tier.put(metas, payloads)) == BLOCKS_PER_BATCH


@pytest.mark.timeout(300)
def test_sigkill_while_pruning_keeps_every_value_whole(tmp_path):
    """A budget of six batches: from the seventh on, every commit also prunes, so the kill
    lands in pruning commits. The newest reported batch is there (at most one unreported
    commit per thread, and one reordering, came after it); older ones are there byte-exact
    or pruned, never damaged."""
    rng = random.Random(7)
    disk_dir = tmp_path / "kv"
    metas, payloads = batch_blocks(0)
    record_bytes = len(encode_record(metas[0], LAYOUT, payloads[0]))
    budget = 6 * BLOCKS_PER_BATCH * record_bytes
    reported: list[tuple[int, list[str]]] = []
    for run in range(10):  # more than six batches, so pruning happened before the last kill
        reported += run_and_kill(disk_dir, budget, 1000 * run, rng)
        if len(reported) > 8:
            break
    batches = [batch for batch, _ in reported]
    num_blocks = check_directory(disk_dir, budget, must_hold=batches[-1:],
                                 may_hold=batches[:-1])
    assert num_blocks <= 6 * BLOCKS_PER_BATCH < len(batches) * BLOCKS_PER_BATCH  # it pruned
    with DiskTier(disk_dir, LAYOUT, budget) as tier:
        assert tier.stats().pruned == 0  # opening pruned nothing: the counter was right
