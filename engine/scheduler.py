"""The scheduler: which requests run in the next step, with which tokens, in which blocks.

First come, first served, under two caps: `max_num_seqs` running requests and a budget of
`max_num_batched_tokens` tokens per step (a prompt longer than the budget is prefilled in
chunks over several steps; decodes take one token each). Running requests go first, oldest
first; then waiting requests are admitted in arrival order until a cap is hit or the pool
runs out of blocks.

Admission looks up the full blocks of the request (never its last token, so at least one
token is computed and sampled) in the tier manager. GPU hits are shared at once; HOST / DISK
hits get fresh GPU blocks and a load, and the request sits in WAITING_FOR_LOAD, not blocking
the queue, until the load is complete. A load that restores only some blocks leaves the rest
to be recomputed (fail closed).

Out of blocks: the newest holder of blocks is preempted (waiting requests that hold restored
blocks first, then the newest running request, possibly the one asking). Its full blocks stay
cached in the pool and were written through to the host tier, so it comes back through the
lookup / restore path. A request that holds every block of the pool and still needs one more
ends with "length".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.engine.request import Request, RequestId, RequestStatus

from kvtier.free_queue import KVCacheBlock
from kvtier.stats import Tier
from kvtier.tiers.record import BlockMeta

if TYPE_CHECKING:
    from kvtier.manager import LoadId, TierManager


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """`num_new_tokens` tokens of `request`, starting at position `start`, run this step.

    `samples` is true when the chunk reaches the end of the known tokens, so a token is
    sampled from its last position.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the batch, and requests that changed state while planning."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class _Admission:
    """Where the KV of an admitted-but-not-yet-running request's prefix came from (tokens)."""

    gpu: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0


@dataclass(slots=True)
class _PendingLoad:
    request: Request
    load_id: LoadId
    loaded_positions: list[int]  # indexes into block_table of the blocks being loaded
    tiers: list[Tier]            # tier of every block of block_table


class Scheduler:
    """FCFS scheduling with chunked prefill, restores and preemption over a `TierManager`.

    The caller runs one `schedule()` and one `update()` per step, from one thread.
    """

    def __init__(self, manager: TierManager, max_num_seqs: int, max_num_batched_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0, "caps must be positive"
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._loads: dict[RequestId, _PendingLoad] = {}
        self._admissions: dict[RequestId, _Admission] = {}

    # ---- queue ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING, f"{request.request_id} is not new"
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._loads)

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Never blocks on a transfer."""
        out = SchedulerOutput()
        self._finish_loads()
        budget = self.max_num_batched_tokens

        # Running requests, oldest first; a preempted one leaves `self.running`.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            if not self._grow(request, num_new, out):
                continue  # `request` left self.running (preempted or finished)
            out.scheduled.append(self._plan(request, num_new))
            budget -= num_new
            index += 1

        # Waiting requests in arrival order; those waiting for a load are stepped over. None
        # is admitted in a step that had to preempt: the pool is short already.
        for request in list(self.waiting):
            if out.preempted or budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if request.status is RequestStatus.WAITING_FOR_LOAD:
                continue
            # One lookup per admission: after a load, even one that restored nothing, the
            # request computes the rest (a failing tier cannot keep it waiting forever).
            if request.request_id not in self._admissions and not self._lookup(request):
                continue  # a load started
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new, out):
                self._release(request)
                break  # FCFS: later requests do not jump ahead of one that does not fit
            self._admit(request)
            out.scheduled.append(self._plan(request, num_new))
            budget -= num_new
        return out

    def update(self, out: SchedulerOutput,
               sampled_token_ids: Sequence[int | None]) -> list[Request]:
        """Account for a finished model step; return the requests that finished in it.

        `sampled_token_ids[i]` is the token sampled for `out.scheduled[i]` (None when it did
        not sample). Newly full blocks are cached and written through; finished requests
        free their blocks.
        """
        assert len(sampled_token_ids) == len(out.scheduled), "one sample slot per request"
        now = self.clock()
        finished = list(out.finished)
        for planned, token_id in zip(out.scheduled, sampled_token_ids):
            request = planned.request
            assert request.num_computed_tokens == planned.start, "request moved since planning"
            request.num_computed_tokens += planned.num_new_tokens
            request.counters.computed += planned.num_new_tokens
            self._cache_full_blocks(request)
            if not planned.samples:
                continue
            assert token_id is not None, f"{request.request_id} should have sampled"
            reason = request.append_token(token_id, now)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    # ---- admission -----------------------------------------------------------------------

    def _lookup(self, request: Request) -> bool:
        """Give a waiting request its cached prefix. False if it now waits for a load."""
        num_lookup = (request.num_tokens - 1) // request.block_size
        hit = self.manager.lookup(request.block_hashes[:num_lookup])
        tiers = list(hit.locations)
        gpu_blocks = list(hit.gpu_blocks)
        # GPU hits leave the free queue before anything is allocated, or the allocation
        # could hand one of them out again.
        self.manager.touch([b for b in gpu_blocks if b is not None])
        load_positions = [i for i, tier in enumerate(tiers) if tier is not Tier.GPU]
        fresh = self.manager.allocate(len(load_positions)) if load_positions else []
        if fresh is None:
            # No room to restore into: keep the GPU part in front of the first lower-tier hit.
            cut = load_positions[0]
            self.manager.free([b for b in gpu_blocks[cut:] if b is not None])
            tiers, gpu_blocks, load_positions, fresh = tiers[:cut], gpu_blocks[:cut], [], []
        table: list[KVCacheBlock] = []
        fresh_iter = iter(fresh)
        for tier, block in zip(tiers, gpu_blocks):
            table.append(block if tier is Tier.GPU else next(fresh_iter))
        assert len({b.block_id for b in table}) == len(table), "a block twice in one table"
        request.block_table = table
        if not load_positions:
            self._set_prefix(request, len(table), tiers)
            return True
        metas = [self._meta(request, i) for i in load_positions]
        load_id = self.manager.prepare_load(metas, [table[i] for i in load_positions])
        pending = _PendingLoad(request, load_id, load_positions, tiers)
        # Host hits on CUDA: the copies are queued on the GPU already, and complete_load
        # orders this step's compute after them, so the request runs now. Anything that
        # needs a poll (disk reads, the CPU's copies) is picked up by a later step.
        if self.manager.is_load_ready(load_id, advance=False):
            self._complete_load(pending)
            return True
        request.status = RequestStatus.WAITING_FOR_LOAD
        self._loads[request.request_id] = pending
        return False

    def _finish_loads(self) -> None:
        """Advance transfers; requests whose loads are complete become schedulable."""
        self.manager.poll()
        for request_id, pending in list(self._loads.items()):
            if self.manager.is_load_ready(pending.load_id):
                del self._loads[request_id]
                if pending.request.is_finished:  # stopped while loading: cache, then free
                    self.manager.complete_load(pending.load_id)
                    self.manager.free(pending.request.reset_blocks())
                    continue
                self._complete_load(pending)

    def _complete_load(self, pending: _PendingLoad) -> None:
        num_loaded = self.manager.complete_load(pending.load_id)
        assert 0 <= num_loaded <= len(pending.loaded_positions), "bad complete_load count"
        # The prefix ends at the first block that was not restored.
        request = pending.request
        num_ok = len(request.block_table)
        if num_loaded < len(pending.loaded_positions):
            num_ok = pending.loaded_positions[num_loaded]
        dropped = request.block_table[num_ok:]
        del request.block_table[num_ok:]
        self.manager.free(dropped)
        request.status = RequestStatus.WAITING
        self._set_prefix(request, num_ok, pending.tiers)

    def _set_prefix(self, request: Request, num_blocks: int, tiers: Sequence[Tier]) -> None:
        """The first `num_blocks` blocks of the table hold valid, cached KV."""
        bs = request.block_size
        request.num_computed_tokens = num_blocks * bs
        request.num_cached_blocks = num_blocks
        restored = list(tiers[:num_blocks])
        self._admissions[request.request_id] = _Admission(
            gpu=restored.count(Tier.GPU) * bs, host=restored.count(Tier.HOST) * bs,
            disk=restored.count(Tier.DISK) * bs, remote=restored.count(Tier.REMOTE) * bs)

    def _admit(self, request: Request) -> None:
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        admission = self._admissions.pop(request.request_id, _Admission())
        request.counters.cached_gpu += admission.gpu
        request.counters.cached_host += admission.host
        request.counters.cached_disk += admission.disk
        request.counters.cached_remote += admission.remote

    def _release(self, request: Request) -> None:
        """Undo a waiting request's blocks (cached ones stay cached in the pool)."""
        self.manager.free(request.reset_blocks())
        self._admissions.pop(request.request_id, None)

    # ---- blocks --------------------------------------------------------------------------

    def _grow(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Make room for `num_new` more tokens of `request`, preempting if needed.

        Returns False when there is no room: a running request has then been preempted or
        finished (and left `self.running`); a waiting one is untouched.
        """
        num_needed = (request.num_blocks_for(request.num_computed_tokens + num_new)
                      - len(request.block_table))
        while True:
            blocks = self.manager.allocate(num_needed) if num_needed > 0 else []
            if blocks is not None:
                request.block_table.extend(blocks)
                return True
            victim = self._pick_victim(request)
            if victim is None:
                break
            self._preempt(victim, out)
        if request.status is not RequestStatus.RUNNING:
            return False
        if len(request.block_table) >= self.manager.pool.num_blocks:
            # It holds every block of the pool and still has no room: it can never grow.
            self._finish(request, "length")
            out.finished.append(request)
        else:
            self._preempt(request, out)
        return False

    def _pick_victim(self, request: Request) -> Request | None:
        """The newest holder of blocks that `request` may take them from, if any."""
        for other in reversed(self.waiting):
            if other is request:
                if request.status is not RequestStatus.RUNNING:
                    return None  # a waiting request only takes from those behind it
                continue
            if other.block_table and other.status is not RequestStatus.WAITING_FOR_LOAD:
                return other
        if request.status is RequestStatus.RUNNING:
            newest = self.running[-1]
            if newest is not request:
                return newest
        return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.counters.num_preemptions += 1
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
        self._release(request)
        out.preempted.append(request)

    def stop(self, request: Request, reason: str) -> None:
        """End `request` outside `update` (an abort, a stop string): it leaves the queues and
        its blocks are freed now, full ones staying cached. A load in flight keeps its blocks
        until it completes (`complete_load` runs for every load); they are freed then."""
        if request.is_finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._admissions.pop(request.request_id, None)
        if request.request_id in self._loads:
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            request.finished_time = self.clock()
            return
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        self.manager.free(request.reset_blocks())
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock()

    def _cache_full_blocks(self, request: Request) -> None:
        num_full = min(request.num_computed_tokens // request.block_size,
                       len(request.block_hashes))
        start = request.num_cached_blocks
        if num_full <= start:
            return
        metas = [self._meta(request, i) for i in range(start, num_full)]
        self.manager.cache_full_blocks(request.block_table[start:num_full], metas)
        request.num_cached_blocks = num_full

    @staticmethod
    def _meta(request: Request, block_index: int) -> BlockMeta:
        return BlockMeta(request.block_hashes[block_index], request.parent_hash(block_index),
                         request.block_token_ids(block_index))

    def _plan(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new,
                                samples=start + num_new == request.num_tokens)
