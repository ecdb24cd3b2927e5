"""Shared pieces of the restore tests: a disk tier's read hook that slows, gates or fails
reads, and `Driver`, which plays the model's part over a real scheduler and TierManager (it
writes a value derived from (token id, position) into every slot a chunk computes, and
checks before each chunk that the context it attends to holds exactly the values of its
tokens, so a block served wrong fails at once)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from kvtier.engine.request import Request, RequestId
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.step_plan import SchedulerOutput

from kvtier.config import TierConfig
from kvtier.hashing import BlockHash, BlockHasher, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.tiers.record import BlockMeta

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS,
                  dtype=torch.float32)
SAMPLED = 7
NAMESPACE = namespace_hash("bidirectional-restore-test", LAYOUT)


class ReadHook:
    """The disk tier's read hook: records the blocks read (in order), sleeps `delay_s` per
    block, holds the `gate_at`-th read and every later one until `release()`, and fails
    the blocks in `fail`."""

    def __init__(self, delay_s: float = 0.0, gate_at: int | None = None,
                 fail: frozenset[BlockHash] = frozenset()) -> None:
        self.delay_s, self.gate_at, self.fail = delay_s, gate_at, fail
        self.read: list[BlockHash] = []
        self.started = threading.Event()  # a read has begun (clear it to wait for the next)
        self.gated = threading.Event()  # a read is held at the gate
        self._open = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, meta: BlockMeta) -> None:
        with self._lock:
            self.read.append(meta.block_hash)
            held = self.gate_at is not None and len(self.read) >= self.gate_at
        self.started.set()
        if held:
            self.gated.set()
            assert self._open.wait(timeout=120), "the test never released the gate"
        if self.delay_s:
            time.sleep(self.delay_s)
        if meta.block_hash in self.fail:
            raise OSError("injected read failure")

    def release(self) -> None:
        self._open.set()


def kv_value(token_id: int, position: int) -> float:
    return float(token_id * 1000 + position)


def config(disk_dir: Path, num_gpu_blocks: int = 16) -> TierConfig:
    # A lookup may wait its turn for a core on a loaded test machine: these scenarios are
    # not about the deadline, so they do not let a slow one turn the disk off.
    return TierConfig.from_slots(LAYOUT, num_gpu_blocks=num_gpu_blocks, num_host_slots=32,
                                 disk_path=disk_dir, num_disk_blocks=256,
                                 io_threads=1, disk_lookup_deadline_s=10.0)


class Driver:
    """A scheduler over a real TierManager, stepped like the engine steps it."""

    def __init__(self, manager: TierManager, max_num_batched_tokens: int = 8) -> None:
        self.manager = manager
        # One block per load group: the fronts can meet at any block.
        self.scheduler = Scheduler(manager, 8, max_num_batched_tokens,
                                   restore_group_bytes=LAYOUT.bytes_per_block)
        self.count = 0

    def add(self, prompt: list[int], max_tokens: int = 1) -> Request:
        request = Request(RequestId(f"r{self.count}"), tuple(prompt), params=None,
                          hasher=BlockHasher(NAMESPACE, BS),
                          max_num_tokens=len(prompt) + max_tokens, arrival_time=0.0)
        self.count += 1
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        self.compute(plan)
        # The restores' further loads and the last update's stores start with the step, as
        # in LLM.
        self.scheduler.launched(batch_stores=False)
        self.scheduler.update(plan, [SAMPLED if p.samples else None for p in plan.scheduled])
        self.manager.pool.check_invariants()
        return plan

    def compute(self, plan: SchedulerOutput) -> None:
        """The model's part of a step: check the context each chunk attends to, write the
        chunk's values."""
        kv = self.manager.kv_cache  # [num_blocks, num_layers, 2, BS, kv_heads, head_dim]
        for planned in plan.scheduled:
            request = planned.request
            for pos in range(planned.start):  # the context this chunk attends to
                block = request.block_table[pos // BS]
                expected = kv_value(request.token_ids[pos], pos)
                assert torch.all(kv[block.block_id, :, :, pos % BS] == expected), \
                    f"{request.request_id} position {pos}: wrong KV served"
            for pos in range(planned.start, planned.start + planned.num_new_tokens):
                block = request.block_table[pos // BS]
                kv[block.block_id, :, :, pos % BS] = kv_value(request.token_ids[pos], pos)

    def run_until_done(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
            time.sleep(0.001 if self.scheduler.num_loading else 0)
        raise AssertionError("requests did not finish")


def prompt_of(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


PROMPT = prompt_of(33)  # 8 full blocks and one token


def warm(disk_dir: Path, prompts: list[list[int]]) -> list[BlockHash]:
    """Compute `prompts` once and close: their full blocks end up on disk only."""
    manager = TierManager(LAYOUT, config(disk_dir))
    driver = Driver(manager)
    requests = [driver.add(p) for p in prompts]
    driver.run_until_done()
    manager.close()
    return requests[0].block_hashes


def restored_blocks(request: Request) -> int:
    return request.counters.cached_disk // BS


def finish_idle(driver: Driver) -> None:
    driver.run_until_done()
    driver.manager.flush()
    driver.step()  # completes the loads given up (cancelled ones hold their blocks till then)
    driver.manager.pool.check_invariants()
    assert driver.manager.pool.num_free_blocks == driver.manager.pool.num_blocks
    assert driver.scheduler.num_loading == 0


def restored_blocks_now(driver: Driver, request: Request) -> int:
    driver.scheduler._finish_loads()  # noqa: SLF001
    fronts = driver.scheduler.restore_fronts()[request.request_id]
    return fronts.num_restored


def wait_for_landed(driver: Driver, request: Request, num_blocks: int) -> None:
    """Take in the transfers, without stepping, until `num_blocks` blocks of `request`'s
    restore have landed. A test waits here where the engine lets the compute front claim
    after a wall-clock bound: how soon the I/O thread runs is up to the machine, and a
    front that claims first cancels the reads not started yet."""
    assert request.request_id in driver.scheduler.restore_fronts(), \
        f"{request.request_id} restores nothing: the tiers below were not asked"
    deadline = time.monotonic() + 60
    while restored_blocks_now(driver, request) < num_blocks:
        assert time.monotonic() < deadline, \
            f"{num_blocks} blocks of {request.request_id} never landed"
        driver.manager.wait_for_transfers(0.05)
