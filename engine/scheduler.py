"""The scheduler: which requests run in the next step, with which tokens, in which blocks.

First come, first served, under two caps: `max_num_seqs` running requests and a budget of
`max_num_batched_tokens` tokens per step (a prompt longer than the budget is prefilled in
chunks over several steps; decodes take one token each). Running requests go first, oldest
first; then waiting requests are admitted in arrival order until a cap is hit or the pool
runs out of blocks. With `long_prefill_token_threshold`, a prompt chunk takes at most that
many tokens of a step while other prompts wait to start or are part-way through, so the
budget left over goes to them: a short prompt then starts in the next step instead of after
every chunk of a long one.

Admission looks up the full blocks of the request (never its last token, so at least one
token is computed and sampled) in the tier manager. GPU hits are shared at once; HOST / DISK
hits get fresh GPU blocks and a bidirectional restore (`engine.restore`): the request runs at
once, computing forward from its first block not on the GPU, while its hit blocks load
backward from the last one; the compute front skips what has landed and cancels loads not
yet started. A request whose front waits for bytes already on their way computes nothing in
that step, without blocking the others. A load that fails leaves its blocks to be computed
(fail closed).

Out of blocks: queued host copies are started, and in-flight ones that will free enough
blocks are waited for (milliseconds); only then is the newest holder of blocks preempted
(waiting requests that hold restored blocks first, then the newest running request, possibly
the one asking). Its full blocks stay cached in the pool and were written through to the
host tier, so it comes back through the lookup / restore path. A request that holds every
block of the pool and still needs one more ends with "length".
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.engine.block_taps import BlockTap, BlockTaps
from kvtier.engine.prefetch import WaitingPrefetch
from kvtier.engine.request import Request, RequestId, RequestStatus
from kvtier.engine.restore import (
    DISK_GROUP_BYTES,
    Restore,
    RestoreFronts,
)
from kvtier.engine.restore_gate import RestoreCounts, RestoreGate
from kvtier.engine.restore_rates import MIN_SAVING_S, PrefillRate, TierRates, expected_head_tokens
from kvtier.engine.running_restores import RunningRestores
from kvtier.engine.step_plan import ScheduledRequest, SchedulerOutput

from kvtier.free_queue import KVCacheBlock
from kvtier.stats import Tier

if TYPE_CHECKING:
    from kvtier.manager import TierManager

#: Seconds the engine waits at most for a transfer to finish when only transfers can make
#: progress (`Scheduler.idle`) or the GPU is busy (`Scheduler.while_device_busy`): a disk
#: read wakes it as it lands, CUDA copies are polled, and a load that lands is copied on
#: within this; the wait leaves the GIL to the I/O threads.
TRANSFER_WAIT_S = 0.0005
#: Prefill steps the engine queues on the GPU ahead of the one running (see `LLM`): enough to
#: keep it busy while the next is planned; more would only fill CUDA's launch queue, where
#: the engine thread then blocks, unable to land loads, and commit claims earlier than needed.
MAX_STEPS_AHEAD = 1


class Scheduler:
    """FCFS scheduling with chunked prefill, restores and preemption over a `TierManager`.

    The scheduler is the engine's one way into the tier manager: every call into it (poll,
    lookup, allocate, reclaim, loads, stores) is made here or by the restores it drives, in
    the order one step takes. The caller runs, per step and from one thread:

        while more than MAX_STEPS_AHEAD steps are queued on the GPU:
            scheduler.while_device_busy()  # polls, landings
        plan = scheduler.schedule()        # before the step: poll, lookups, allocations
        ... launch the model step ...
        scheduler.launched()               # loads, stores, polls: while the GPU computes
        ... while the sampled ids are computed: scheduler.while_device_busy() ...
        finished = scheduler.update(plan, sampled_token_ids)
        if scheduler.idle(ran=...): wait a little   # only transfers can make progress

    `restore_group_bytes` sizes the groups a restore loads from disk (`engine.restore`).
    """

    def __init__(self, manager: TierManager, max_num_seqs: int, max_num_batched_tokens: int,
                 clock: Callable[[], float] = time.perf_counter,
                 restore_group_bytes: int = DISK_GROUP_BYTES,
                 min_restore_saving_s: float = MIN_SAVING_S,
                 long_prefill_token_threshold: int = 0) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0, "caps must be positive"
        assert long_prefill_token_threshold >= 0, "the threshold is a token count or 0"
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.clock = clock
        self.restore_group_bytes = restore_group_bytes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Tokens of a looked-up, not yet running request's prefix shared from the GPU pool
        # (those from below count as their restore lands them).
        self._gpu_hit_tokens: dict[RequestId, int] = {}
        #: Waiting requests that found no room (for a chunk or their loads) while others
        #: ran: the pool's free blocks then, and when their wait for room runs out
        #: (`_no_room_since`).
        self._no_room_at: dict[RequestId, tuple[int, float]] = {}
        self._jobs_completed_at_plan = 0  # `TierManager.num_jobs_completed` at `schedule`
        # Per request, who is given its prompt blocks as they become ready (`tap_blocks`).
        self._taps = BlockTaps(manager)
        #: Whether the disk and remote tiers are read for a prefix (`engine.restore_gate`).
        self.gate = RestoreGate(min_restore_saving_s)
        self._restores = RunningRestores(self.gate)
        #: Reads ahead for waiting requests (`engine.prefetch`).
        self.prefetch = WaitingPrefetch(manager, self.gate)

    @property
    def prefill_rate(self) -> PrefillRate:
        """The model's measured prefill speed, which sizes restores' claims and weighs
        reads (the engine feeds it: `PrefillRate.observe`)."""
        return self.gate.prefill_rate

    @property
    def tier_rates(self) -> TierRates:
        """What the disk and remote tiers delivered to recent restores."""
        return self.gate.tier_rates

    @property
    def restore_counts(self) -> RestoreCounts:
        """How prefix lookups below the GPU went (for benchmarks and diagnosis)."""
        return self.gate.counts

    @property
    def min_restore_saving_s(self) -> float:
        """Seconds reading from the disk or remote tier must be expected to save before
        they are asked (`restore_rates.worth_reading`); 0 asks them for every prefix."""
        return self.gate.min_saving_s

    @min_restore_saving_s.setter
    def min_restore_saving_s(self, seconds: float) -> None:
        self.gate.min_saving_s = seconds

    # ---- queue ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING, f"{request.request_id} is not new"
        self.waiting.append(request)

    def tap_blocks(self, request_id: RequestId, tap: BlockTap) -> None:
        """Give `tap` the prompt blocks of request `request_id` as they become ready (see
        `BlockTap`): a prefill instance hands them over while later chunks compute."""
        self._taps.add(request_id, tap)

    def has_unfinished(self) -> bool:
        """Requests to run, or loads given up whose I/O has not ended (they hold blocks)."""
        return bool(self.waiting or self.running or self._restores.has_ending)

    @property
    def num_loading(self) -> int:
        """Loads not completed yet (of running restores, or of restores given up)."""
        return self._restores.num_loading

    def restore_fronts(self) -> dict[RequestId, RestoreFronts]:
        """Where each restore in progress stands (for timelines)."""
        return self._restores.fronts([*self.running, *self.waiting])

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. It blocks on a transfer only where that spares a preemption:
        when the host copies in flight will free the blocks a request is short of."""
        out = SchedulerOutput()
        self._finish_loads()
        self._jobs_completed_at_plan = self.manager.num_jobs_completed
        budget = self.max_num_batched_tokens

        # Running requests, oldest first; a preempted one leaves `self.running`.
        index = 0
        # With the long prefill cap: running requests with a prompt chunk to compute (not a
        # decode's one token), and whether a waiting one could start this step (a seat is
        # free). Counted only then: this loop runs every step.
        capped = bool(self.long_prefill_token_threshold)
        num_chunked = sum(1 for r in self.running
                          if r.num_tokens - r.num_computed_tokens > 1) if capped else 0
        admissible = capped and bool(self.waiting) and len(self.running) < self.max_num_seqs
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            chunked = request.num_tokens - request.num_computed_tokens > 1
            others = admissible or num_chunked > chunked
            num_new = self._chunk(request, self._prefill_cap(budget, others))
            if num_new == 0:  # its restore waits for bytes on their way
                index += 1
                continue
            if not self._grow(request, num_new, out):
                continue  # `request` left self.running (preempted or finished)
            out.scheduled.append(self._plan(request, num_new))
            budget -= num_new
            index += 1

        # Waiting requests in arrival order; those waiting for a load are stepped over. None
        # is admitted in a step that had to preempt: the pool is short already.
        waiting = list(self.waiting)
        for position, request in enumerate(waiting):
            if out.preempted or budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._no_room_since(request):
                break  # as last time: FCFS as below
            # One lookup per admission: a failing tier cannot keep a request waiting.
            if request.request_id not in self._gpu_hit_tokens \
                    and not self._lookup(request):
                # It waits for GPU blocks to restore into; FCFS as below.
                self._note_no_room(request, self.gate.room_wait_ends(request.request_id))
                break
            num_new = self._chunk(request,
                                  self._prefill_cap(budget, position + 1 < len(waiting)))
            if not self._grow(request, num_new, out):
                self._release(request)
                self._note_no_room(request, math.inf)
                break  # FCFS: later requests do not jump ahead of one that does not fit
            self._admit(request)
            if num_new:
                out.scheduled.append(self._plan(request, num_new))
                budget -= num_new
        if self.running and self.waiting:  # those left wait for room: read ahead for them
            self.prefetch.step(self.waiting)
        return out

    def _note_no_room(self, request: Request, until: float) -> None:
        """`request` found no room at its admission while others run: for a chunk (`until`
        infinite), or for its restore's loads, whose wait for blocks runs out at `until`
        (`RestoreGate.room_wait_ends`, monotonic seconds)."""
        if self.running:
            self._no_room_at[request.request_id] = (self.manager.pool.num_free_blocks, until)

    def _no_room_since(self, request: Request) -> bool:
        """Whether `request` found no room at its last admission, and no block came free
        since while others run (nor did its wait for room run out): it would find none
        again. Its lookup is then not made (a long prompt's lookup walks hundreds of blocks,
        asks the disk and waits for store copies to reclaim their blocks; behind a full
        pool, waiting requests were looked up at every step in vain). Once nothing runs,
        blocks came free or the wait ran out, it is looked up again."""
        noted = self._no_room_at.get(request.request_id)
        if noted is None:
            return False
        free_then, until = noted
        if self.running and self.manager.pool.num_free_blocks <= free_then \
                and time.monotonic() < until:
            return True
        del self._no_room_at[request.request_id]
        return False

    def launched(self, batch_stores: bool = True) -> None:
        """The step is queued on the GPU: issue the restores' groups its claims left to the
        tiers, start the host copies the last `update` queued and advance the transfers,
        host work that the step's compute then hides. `batch_stores`: start the copies only
        once enough are queued (see `TierManager.submit_stores`). Called once per step, also
        when the plan is empty (then right after `schedule`).

        The transfers are advanced here as well as in `schedule`: behind a small host tier
        the engine thread's share of a step went mostly to polling and landing loads, with
        the GPU idle behind it (docs/BENCHMARKS.md, "24 conversations behind a 3 GB host
        tier"); done here, most of it overlaps the step, and `schedule` finds less."""
        self.issue_loads()
        self._finish_loads()  # before the stores start: its offers go with them
        self.manager.submit_stores(batch=batch_stores)

    def while_device_busy(self) -> None:
        """One turn of host work while the GPU runs steps already queued (the engine calls
        it in a loop until the step it waits for is done): advance the transfers and land
        the restores' groups, then wait at most `TRANSFER_WAIT_S` for a transfer to
        finish. Without it, loads that landed during a long prefill step waited for the
        step's end to be copied to the GPU and to hand their host slots on (behind a 1 GB
        host tier, a restore's reads then stalled for whole steps)."""
        self._finish_loads()
        self.manager.wait_for_transfers(TRANSFER_WAIT_S)

    def idle(self, ran: bool) -> bool:
        """After `update`: whether the caller should wait a little before the next step,
        because only transfers in flight can make progress (`ran`: the step computed or
        finished something; transfers that completed since `schedule`, in `launched`,
        count as progress too). With nothing left to run, the queued stores start now (no
        next step to overlap them with). Raises RuntimeError if no request can make
        progress and nothing is in flight (a scheduling bug; never expected)."""
        if not self.has_unfinished():
            self.manager.submit_stores()
            return False
        if ran or self.manager.num_jobs_completed != self._jobs_completed_at_plan:
            return False  # transfers completed since the plan: the next one may run more
        if self.manager.num_stores_queued:  # held blocks come free as copies land
            self.manager.submit_stores()
        elif not (self.num_loading
                  or self.manager.stats(lower_tiers=False).num_jobs_in_flight):
            raise RuntimeError("the scheduler could not run any request and no transfer is "
                               "in flight to make room")
        return True

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
            self._taps.give(request)
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
        """Give a waiting request its cached prefix: GPU hits shared, a restore started for
        the rest. False: the pool has no room to restore its hits below the GPU into yet,
        and it waits for room rather than computing them (`RestoreGate.waits_for_room`); it
        holds no block then."""
        num_lookup = (request.num_tokens - 1) // request.block_size
        began = time.monotonic()
        # Past blocks no tier holds: a stored tail behind a head that was never written.
        hit = self.manager.lookup(request.block_hashes[:num_lookup],
                                  read_slow=lambda i: self._worth_reading(request, i),
                                  gaps=True)
        tiers = list(hit.locations)
        gpu_blocks = list(hit.gpu_blocks)
        # GPU hits leave the free queue before anything is allocated, or the allocation
        # could hand one of them out again.
        self.manager.touch([b for b in gpu_blocks if b is not None])
        load_positions = [i for i, tier in enumerate(tiers) if tier is not Tier.GPU]
        fresh = self._allocate_for_loads(len(load_positions)) if load_positions else []
        if fresh is None:
            if self.gate.waits_for_room(request.request_id,
                                        len(load_positions) * request.block_size,
                                        load_positions[0] * request.block_size,
                                        others_run=bool(self.running)):
                self.manager.free([b for b in gpu_blocks if b is not None])
                return False
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
        num_leading = next((i for i, tier in enumerate(tiers) if tier is not Tier.GPU),
                           len(tiers))
        request.num_computed_tokens = num_leading * request.block_size
        request.num_cached_blocks = num_leading
        self._gpu_hit_tokens[request.request_id] = tiers.count(Tier.GPU) * request.block_size
        probe = self.gate.take_probe(request.request_id)
        if load_positions:
            # A probe restores as if the slow tiers' rates were not known: it measures them.
            restore = Restore(self.manager, tiers, table,
                              request.block_meta, request.block_size,
                              self.restore_group_bytes,
                              None if probe else self.tier_rates.expected(tiers),
                              lookup_began=began, probe=probe)
            self._restores.start(request.request_id, restore)
            self.restore_counts.started += 1
            # Before the compute front claims anything: a tier that lands at once wins. Of
            # the slow tiers' groups, once the model's speed is known, those they read
            # while the first steps compute: the rest are issued once the step with the
            # front's first claim is launched.
            restore.issue(num_leading, self.prefill_rate,
                          max_slow_groups=restore.slow_groups_at_admission(
                              num_leading, self.prefill_rate, self.max_num_batched_tokens),
                          others=self._num_others(request.request_id))
        return True

    def _allocate_for_loads(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """GPU blocks for a restore's loads, or None. Blocks that host stores hold are
        reclaimed first, waiting for copies in flight if need be: behind a small host tier
        the write-throughs waiting for slots hold much of the pool, and a restore given up
        here computes its whole prefix instead of reading it (milliseconds of copies
        against a prefill)."""
        while True:
            blocks = self.manager.allocate(num_blocks)
            short = num_blocks - self.manager.pool.num_free_blocks
            if blocks is not None or not self.manager.reclaim_store_blocks(short, wait=True):
                return blocks

    def _worth_reading(self, request: Request, first_block: int) -> bool:
        """Whether `request`'s tokens from block `first_block` on (the first block neither
        the GPU nor the host holds) are worth looking up in the tiers below the host
        (`RestoreGate.worth_reading`)."""
        slow = list(dict.fromkeys(tier.kind for tier in self.manager.lower_tiers))
        # Host blocks further on (a conversation's later ones outlive its first) come at once.
        on_host = bool(slow) and self.manager.any_on_host(
            request.block_hashes[first_block + 1:(request.num_tokens - 1) // request.block_size])
        context = first_block * request.block_size
        busy = bool(self.running) or len(self.waiting) > 1
        return self.gate.worth_reading(request.request_id, request.num_tokens - context,
                                       context, slow, on_host, busy=busy)

    def _finish_loads(self) -> None:
        """Advance transfers; land the restores' groups; complete loads given up."""
        self.manager.poll()
        self._restores.collect()

    def _prefill_cap(self, budget: int, others_wait: bool) -> int:
        """The tokens a request may compute this step out of `budget`: at most
        `long_prefill_token_threshold` while `others_wait` (requests waiting to start, or
        running ones with prompt tokens left), so that the rest of the budget goes to them.
        A decode takes one token either way."""
        if self.long_prefill_token_threshold and others_wait:
            return min(budget, self.long_prefill_token_threshold)
        return budget

    def _chunk(self, request: Request, budget: int) -> int:
        """How many tokens `request` computes next, at most `budget`: past a restore's
        landed blocks, up to what its compute front may claim (0: it waits this step)."""
        restore = self._restores.get(request.request_id)
        if restore is not None and request.num_computed_tokens % request.block_size == 0:
            front = restore.skip(request.num_computed_tokens // request.block_size)
            request.num_computed_tokens = front * request.block_size
            self._cache_full_blocks(request)
            if front >= restore.num_blocks:  # the fronts met: the restore is over
                self._end_restore(request)
                restore = None
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if restore is None:
            assert num_new > 0, f"{request.request_id} has nothing to compute"
            return num_new
        front = request.num_computed_tokens // request.block_size
        rate = self.prefill_rate
        if restore.holds_first_claim(front, rate):  # a tier that answers delivers first
            return 0
        others = self._num_others(request.request_id)
        num_new = restore.balanced_tokens(front, num_new, rate, others)
        if num_new == 0:  # the tiers deliver the rest sooner than a block is computed
            restore.issue(front, rate, others=others)  # the head too, if left to the front
            return 0
        num_new = restore.claim(request.num_computed_tokens, num_new)
        self._restores.after_launch(
            request.request_id, -(-(request.num_computed_tokens + num_new) // request.block_size))
        return num_new

    def issue_loads(self) -> None:
        """Issue the groups that this step's claims left to the tiers (`launched` does, once
        the step is queued on the GPU)."""
        self._restores.issue_after_launch(self.prefill_rate, self._num_others)

    def _num_others(self, request_id: RequestId) -> int:
        """Requests running beside `request_id` (running or about to be admitted): a
        restore's compute front holds each of them up for as long as its steps take
        (`PrefillRate.head_pays`)."""
        return len(self.running) - any(r.request_id == request_id for r in self.running)

    def _end_restore(self, request: Request) -> None:
        """Count what a restore restored, complete its loads given up; forget it."""
        restore = self._restores.end(request.request_id)
        if restore is None:
            return
        request.counters.cached_host += restore.restored[Tier.HOST] * request.block_size
        request.counters.cached_disk += restore.restored[Tier.DISK] * request.block_size
        request.counters.cached_remote += restore.restored[Tier.REMOTE] * request.block_size

    def _admit(self, request: Request) -> None:
        self.waiting.remove(request)
        self.gate.left_waiting(request.request_id)
        self.prefetch.forget(request.request_id)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.counters.cached_gpu += self._gpu_hit_tokens.pop(request.request_id, 0)
        self._no_room_at.pop(request.request_id, None)

    def _release(self, request: Request) -> None:
        """Undo a waiting request's blocks (cached ones stay cached in the pool)."""
        self._restores.end(request.request_id)  # given up: nothing counted
        self.manager.free(request.reset_blocks())
        self._gpu_hit_tokens.pop(request.request_id, None)

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
            # Stores hold blocks: take those first. Where someone would be preempted (a
            # running request without a victim preempts itself), even wait for copies in
            # flight: milliseconds, against a prefill done again.
            if self.manager.reclaim_store_blocks(
                    num_needed - self.manager.pool.num_free_blocks,
                    wait=victim is not None or request.status is RequestStatus.RUNNING):
                continue
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
            if other.block_table:
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
        its blocks are freed now, full ones staying cached. Loads of its restore that are
        still in flight are given up: their blocks are freed when their I/O has ended."""
        if request.is_finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._gpu_hit_tokens.pop(request.request_id, None)
        self._no_room_at.pop(request.request_id, None)
        self.gate.left_waiting(request.request_id)
        self.prefetch.forget(request.request_id)
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        self._taps.drop(request.request_id)
        if request in self.running:
            self.running.remove(request)
        self._restores.end(request.request_id)  # given up: nothing counted
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
        metas = [request.block_meta(i) for i in range(start, num_full)]
        # Placement: the blocks past where a later restore's fronts are expected to meet go
        # to the disk first, the deepest first (a restore loads those from the prompt's end
        # backward, and computes the head anyway).
        slow = [tier.kind for tier in self.manager.lower_tiers]
        head = expected_head_tokens(request.num_tokens, self.prefill_rate,
                                    self.tier_rates.expected(slow)) // request.block_size
        self.manager.cache_full_blocks(request.block_table[start:num_full], metas,
                                       [i if i >= head else None
                                        for i in range(start, num_full)])
        request.num_cached_blocks = num_full

    def _plan(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new,
                                samples=start + num_new == request.num_tokens)
