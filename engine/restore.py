"""Bidirectional restore: a request computes its prompt forward while its cached blocks load
backward from the tail, and the two fronts meet where they meet.

Computing block i needs the KV of every block before it; loading block i needs nothing. So
for a prefix whose blocks sit in a slower tier (host, disk), the compute front starts at the
first block that is not on the GPU and moves forward a chunk per step, while the load front
issues small groups of blocks from the last hit backwards. The head is the cheap part to
compute (short context), the tail the dear part, and no calibration is needed: a fast tier
lands everything before the compute front claims a block (a pure restore), a slow disk meets
it in the middle, a broken tier at the end (a pure recompute).

Each hit block is in one of four states:

    VALID    its KV is in its GPU block (a GPU hit, or a load that landed)
    PENDING  a hit not loaded yet: either front may take it
    LOADING  part of a group in flight
    COMPUTE  the compute front's: claimed by a chunk, its load failed or was cancelled, or no
             tier holds it (a gap in the hit: a stored tail behind a head never written)

The compute front skips VALID blocks. A chunk claims PENDING blocks and cancels groups whose
bytes have not started towards the GPU (`TierManager.cancel_load`); it stops at a VALID block
or at a group whose bytes are on their way, and waits for that group when it stops at once
(at most one group's read: groups are a few MiB). Groups are only issued above the chunk just
claimed, so a block is never both computed and loaded. A load that fails leaves its blocks to
be computed: never a block served wrong.

Speeds measured in the running process size the two fronts (`engine.restore_rates`): with
the model's prefill cost (per token and per key attended to) and the slow tiers' rate L
known, a claim takes the head that the model computes while the tiers deliver the rest of
the tokens still to come, so both fronts finish together, and disk or remote
groups are only issued above that head (`reserved_head`), so the compute front does not run
into reads under way. Until the rates are known the fronts meet where they meet. Before any
of this, the scheduler does not even look in the slow tiers for a prefix that reading could
not shorten by `restore_rates.MIN_SAVING_S` (`restore_rates.worth_reading`); a gate closed
on measured rates is probed now and then, so that it follows what the tiers deliver now
(`restore_rates.TierRates.turned_away`).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.engine.restore_rates import SLOW_TIERS, PrefillRate

from kvtier.free_queue import KVCacheBlock
from kvtier.stats import Tier, busy_seconds
from kvtier.tiers.record import BlockMeta

if TYPE_CHECKING:
    from kvtier.manager import LoadId, TierManager

#: Bytes per load group from disk: large enough that per-read costs on the host are small,
#: small enough that cancelling the groups not yet started leaves little to wait for.
DISK_GROUP_BYTES = 16 << 20
#: Blocks per load group from the host tier: its copies are queued on the GPU at once, so a
#: group only bounds the size of one copy job.
HOST_GROUP_BLOCKS = 256
#: Bytes of disk groups in flight per restore: enough to keep a disk busy through a long
#: prefill step, and bounded so the I/O queue never blocks the engine.
WINDOW_BYTES = 4 << 30
#: Seconds a restore's compute front waits, at most, for the first group to land before it
#: starts computing the head. A tier that answers at all lands its first group sooner (a
#: 16 MiB read from a cold 1 GB/s disk takes ~16 ms); a dead or hanging one costs this much.
FIRST_LANDING_WAIT_S = 0.05
#: ... and at most this share of the time the model takes to compute the prefix, so that
#: waiting never makes a prompt more than 2% slower than computing it: a cold disk's first
#: group can land after a good share of a short prefix's compute time (docs/BENCHMARKS.md,
#: "Figures behind the engine's constants").
FIRST_LANDING_WAIT_SHARE = 0.02
#: Disk or remote groups issued while the request is admitted, at least; the rest are issued
#: once the step that computes the head is queued on the GPU (`Scheduler.launched`).
#: Issuing is host work on the engine thread that would otherwise keep the GPU idle before
#: the first step (docs/BENCHMARKS.md, "Figures behind the engine's constants"); these few
#: keep the disk busy and tell when it answers.
FIRST_SLOW_GROUPS = 4
#: ... and, with the model's speed and the slow tiers' rate known, as many as those tiers
#: are expected to read while this many steps of the request compute
#: (`Restore.slow_groups_at_admission`). The engine thread issues the rest only once the
#: first step's launch returns, and a large model's launch takes about as long as the step
#: computes, so reads issued then start a step late and land after the claim of the second
#: step was sized without them (docs/BENCHMARKS.md, "Short prompts: restores against
#: recompute", has the timeline).
ADMISSION_STEPS = 2
#: Tokens the compute front claims first while the model's prefill rate is not known yet (no
#: prefill step timed since start: `engine.step_timer`): enough to measure it.
PROBE_TOKENS = 64


class BlockState(enum.Enum):
    VALID = "valid"
    PENDING = "pending"
    LOADING = "loading"
    COMPUTE = "compute"


@dataclass(slots=True)
class _Group:
    load_id: LoadId
    start: int  # first block index
    stop: int   # one past the last
    tier: Tier


@dataclass(frozen=True, slots=True)
class RestoreFronts:
    """Where a restore stands (block indexes): the compute front, the lowest block issued for
    loading (`num_blocks` when none), and the blocks restored / computed so far."""

    compute_block: int
    load_block: int
    num_blocks: int
    num_restored: int
    num_computed: int


class Restore:
    """The meeting of the two fronts over one request's prefix hit.

    `tiers[i]` is where block i of the hit lives (None: nowhere, the compute front's),
    `block_table[i]` its GPU block (a GPU hit's own block, else one allocated for its load or
    its computing, held by the request). `meta(i)` gives the
    `BlockMeta` of block i. `group_bytes` sizes the disk groups. `expected_load_rate`
    (tokens/s) is what the slow tiers delivered to recent restores (`TierRates`), None
    when unknown. `probe`: the restore was let through to measure slow tiers the
    scheduler's gate had closed. Driven from the
    scheduler's thread: `collect` (landed groups),
    `skip` (the front over VALID blocks), `claim` (a chunk), `issue` (more groups), and
    `abandon` when the request gives its blocks back.
    """

    def __init__(self, manager: TierManager, tiers: Sequence[Tier | None],
                 block_table: Sequence[KVCacheBlock], meta: Callable[[int], BlockMeta],
                 block_size: int, group_bytes: int = DISK_GROUP_BYTES,
                 expected_load_rate: float | None = None,
                 lookup_began: float | None = None, probe: bool = False) -> None:
        assert len(tiers) <= len(block_table), "a GPU block for every hit block"
        self.manager = manager
        self.tiers = list(tiers)
        self.blocks = list(block_table[:len(tiers)])
        self.meta = meta
        self.block_size = block_size
        #: This restore probes slow tiers the scheduler's gate had closed: the rates it
        #: measures replace the old ones (`TierRates`).
        self.probe = probe
        self.states = [BlockState.VALID if t is Tier.GPU else
                       BlockState.COMPUTE if t is None else BlockState.PENDING for t in tiers]
        bytes_per_block = manager.layout.bytes_per_block
        slow_group = max(1, group_bytes // bytes_per_block)
        self._group_blocks = {Tier.HOST: HOST_GROUP_BLOCKS, Tier.DISK: slow_group,
                              Tier.REMOTE: slow_group}
        # A group is one I/O job: keep half the queue for write-backs and other requests.
        self._max_groups = max(1, min(WINDOW_BYTES // (self._group_blocks[Tier.DISK]
                                                        * bytes_per_block),
                                      manager.config.max_pending_io // 2))
        self._top = len(tiers) - 1  # the highest block that may still be PENDING
        self._in_flight: list[_Group] = []  # tail first
        self._draining: list[_Group] = []   # cancelled groups, completed once their I/O ends
        self.restored = {Tier.HOST: 0, Tier.DISK: 0, Tier.REMOTE: 0}  # blocks landed, per tier
        #: The compute front has not claimed yet: it first gives the tiers the rest of the
        #: step, then waits for their first group to land (see `holds_first_claim`).
        self.fresh = True
        self._hold_began: float | None = None  # the first `holds_first_claim` call
        self._hold_limit_s = FIRST_LANDING_WAIT_S  # how long it may hold (see there)
        self._num_completed = 0  # groups landed or failed
        self._expected_load_rate = expected_load_rate
        #: Per slow tier, (start, end) of the reads of its groups that ended (landed or
        #: overtaken), and the seconds at least one of them (of any slow tier) was under
        #: way (None: not summed since the last read counted; summed when a rate is asked
        #: for, not at every landing).
        self._read_spans: dict[Tier, list[tuple[float, float]]] = {}
        #: Per slow tier, tokens its reads delivered to host memory (used or overtaken by
        #: the compute front), and when its first group was issued: its rate and latency.
        self._read_tokens: dict[Tier, int] = {}
        self._first_issue: dict[Tier, float] = {}
        #: When the lookup that found the hits began (`time.monotonic`): a slow tier's
        #: latency counts from there, its index lookup included (after a dropped page
        #: cache, LMDB's reads for a long prefix take a noticeable share of it).
        self._lookup_began = lookup_began
        self._busy_s: float | None = 0.0
        #: The last `issue` stopped at `max_slow_groups`: slow groups are still to come.
        self._issue_capped = False

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def num_in_flight(self) -> int:
        """Loads not completed yet (in flight or cancelled and draining)."""
        return len(self._in_flight) + len(self._draining)

    def fronts(self, compute_block: int) -> RestoreFronts:
        load_block = min((g.start for g in self._in_flight), default=self.num_blocks)
        return RestoreFronts(compute_block, load_block, self.num_blocks,
                             sum(self.restored.values()),
                             self.states.count(BlockState.COMPUTE))

    # ---- the load front ------------------------------------------------------------------

    def issue(self, floor: int, prefill: PrefillRate | None = None,
              max_slow_groups: int | None = None, others: int = 0) -> None:
        """Issue groups of PENDING blocks at or above block `floor`, from the tail down,
        while the window has room (and, given `max_slow_groups`, until that many disk or
        remote groups are issued); groups whose bytes are queued on the GPU at once (host
        hits on CUDA) land right away. With the prefill rate and the slow tiers' rate known,
        disk and remote groups stay above the head the compute front will compute anyway
        (`reserved_head`, with `others` requests running beside this one): a read there
        would only make the front wait for it."""
        reserve = self.reserved_head(floor, prefill, others)
        slow_left = max_slow_groups
        self._issue_capped = False
        while len(self._in_flight) < self._max_groups:
            while self._top >= floor and self.states[self._top] is not BlockState.PENDING:
                self._top -= 1
            if self._top < floor:
                return
            stop = self._top + 1
            tier = self.tiers[self._top]
            low = max(floor, reserve) if tier in SLOW_TIERS else floor
            if self._top < low:
                return  # the reserved head: the compute front's
            if tier in SLOW_TIERS and slow_left is not None:
                if slow_left == 0:
                    self._issue_capped = True
                    return
                slow_left -= 1
            start = stop
            while (start > low and stop - start < self._group_blocks[tier]
                   and self.states[start - 1] is BlockState.PENDING
                   and self.tiers[start - 1] is tier):
                start -= 1
            # The lookup found them: no second disk lookup on the engine thread while the
            # I/O threads read (each LMDB call there gives up the GIL and waits to get it
            # back behind them).
            load_id = self.manager.prepare_load([self.meta(i) for i in range(start, stop)],
                                                self.blocks[start:stop], split_reads=False,
                                                known_on_disk=tier is Tier.DISK)
            for i in range(start, stop):
                self.states[i] = BlockState.LOADING
            self._top = start - 1
            self._in_flight.append(_Group(load_id, start, stop, tier))
            self._first_issue.setdefault(tier, self._lookup_began if self._lookup_began
                                         is not None else time.monotonic())
            if self.manager.is_load_ready(load_id, advance=False):
                self._land(self._in_flight.pop())

    def slow_groups_at_admission(self, compute_block: int, prefill: PrefillRate,
                                 step_tokens: int) -> int | None:
        """How many disk or remote groups to issue while the request is admitted: those the
        slow tiers are expected to read (at their rate in recent restores) while
        `ADMISSION_STEPS` steps of `step_tokens` prompt tokens from `compute_block` on
        compute, at least `FIRST_SLOW_GROUPS` (just those while the tiers' rate is not
        known). None (no cap) while the model's speed is unknown: its first claim then only
        measures it (`PROBE_TOKENS`), and the reads are the restore."""
        if prefill.tokens_per_s is None:
            return None
        load_rate = self._expected_load_rate
        pending = self._pending_tokens(compute_block)
        step_s = prefill.seconds(min(step_tokens, pending), compute_block * self.block_size)
        if load_rate is None or not step_s:
            return FIRST_SLOW_GROUPS
        group_tokens = self._group_blocks[Tier.DISK] * self.block_size
        return max(FIRST_SLOW_GROUPS,
                   math.ceil(load_rate * ADMISSION_STEPS * step_s / group_tokens))

    def reserved_head(self, floor: int, prefill: PrefillRate | None, others: int = 0) -> int:
        """The first block from `floor` on that the slow tiers should load: above the head
        that the model computes (`PrefillRate.head_tokens`, its cost growing with the
        context and with the `others` requests its steps hold up) while they deliver the
        other tokens still to come at L tokens/s (`floor` while either rate is unknown)."""
        load_rate = self._load_rate()
        if prefill is None or prefill.tokens_per_s is None or load_rate is None:
            return floor
        share = prefill.head_tokens(self._pending_tokens(floor), floor * self.block_size,
                                    load_rate, others=others)
        return floor + share // self.block_size

    def _load_rate(self) -> float | None:
        """Tokens/s the slow tiers delivered to this restore while they were reading, or
        what they delivered to recent ones before the first landing here; None when
        neither is known."""
        landed = sum(self._read_tokens.values())
        if self._busy_s is None:
            self._busy_s = busy_seconds([span for tier_spans in self._read_spans.values()
                                         for span in tier_spans])
        if landed and self._busy_s > 0:
            return landed / self._busy_s
        return self._expected_load_rate

    def measured_rates(self) -> list[tuple[Tier, int, float, float]]:
        """(tier, tokens read, seconds that tier's reads were under way, seconds from the
        lookup (or its first group's issue) to the end of its first read) of each slow tier
        that delivered
        to this restore, for `TierRates`. Reads the compute front overtook count: a tier
        too slow to land anything in time still shows how slow it is."""
        rates = []
        for tier, spans in self._read_spans.items():
            seconds = busy_seconds(spans)
            tokens = self._read_tokens.get(tier, 0)
            if tokens and seconds > 0 and tier in self._first_issue:
                latency = max(0.0, min(end for _, end in spans) - self._first_issue[tier])
                rates.append((tier, tokens, seconds, latency))
        return rates

    def _count_read(self, group: _Group) -> None:
        """Count what a slow tier's group read into host memory, landed or overtaken (call
        before completing it)."""
        read, spans = self.manager.load_reads(group.load_id)
        if group.tier in SLOW_TIERS and read and spans:
            self._read_spans.setdefault(group.tier, []).extend(spans)
            self._read_tokens[group.tier] = (self._read_tokens.get(group.tier, 0)
                                             + read * self.block_size)
            self._busy_s = None

    def collect(self) -> bool:
        """Complete groups that landed (call after `TierManager.poll`). True if any did."""
        for group in list(self._draining):
            if self.manager.is_load_ready(group.load_id, advance=False):
                self._count_read(group)
                self.manager.complete_load_blocks(group.load_id)
                self._draining.remove(group)
        landed = [g for g in self._in_flight
                  if self.manager.is_load_ready(g.load_id, advance=False)]
        for group in landed:
            self._in_flight.remove(group)
            self._land(group)
        return bool(landed)

    def _land(self, group: _Group) -> None:
        self._num_completed += 1
        self._count_read(group)
        arrived = self.manager.complete_load_blocks(group.load_id)
        for i, ok in zip(range(group.start, group.stop), arrived):
            self.states[i] = BlockState.VALID if ok else BlockState.COMPUTE
            self.restored[group.tier] += ok

    # ---- the compute front ---------------------------------------------------------------

    def holds_first_claim(self, compute_block: int, prefill: PrefillRate | None) -> bool:
        """Whether the compute front should still wait before its first claim: while groups
        are in flight, none has landed (or failed) yet, and less than
        `FIRST_LANDING_WAIT_S` has passed since it was first asked (the admitting step
        always waits). Without this, a request alone in the engine would claim its head
        after one empty step, before a fast tier had read anything, and compute what the
        tier would have delivered. The bound keeps a tier that never answers from holding
        the request: it then computes everything, as it would without a tier, that much
        later. With the model's speed known (`prefill`), the bound is also at most
        `FIRST_LANDING_WAIT_SHARE` of the time to compute the prefix from `compute_block`
        on; a prefix whose slow tiers' rate is known from recent restores is not held at
        all (the claims are sized from it)."""
        if not self.fresh:
            return False
        now = time.monotonic()
        if self._hold_began is None:
            self._hold_began = now
            known = prefill is not None and prefill.tokens_per_s is not None
            if known and self._expected_load_rate is not None:
                self.fresh = False
                return False
            if known:
                compute_s = prefill.seconds(self._pending_tokens(compute_block),
                                            compute_block * self.block_size)
                self._hold_limit_s = min(FIRST_LANDING_WAIT_S,
                                         FIRST_LANDING_WAIT_SHARE * compute_s)
        if self._in_flight and self._num_completed == 0 \
                and now - self._hold_began < self._hold_limit_s:
            return True
        self.fresh = False
        return False

    def _pending_tokens(self, compute_block: int) -> int:
        """Tokens from `compute_block` on that the tiers may still deliver."""
        rest = self.states[compute_block:]  # counted in C: this runs several times a step
        return self.block_size * (rest.count(BlockState.PENDING) + rest.count(BlockState.LOADING))

    def balanced_tokens(self, compute_block: int, num_tokens: int,
                        prefill: PrefillRate | None, others: int = 0) -> int:
        """How many of `num_tokens` tokens from `compute_block` the compute front should
        claim now, so that it and the loads finish together. With R tokens the tiers may
        still deliver (PENDING or LOADING from the front on), the load front landing L
        tokens/s (the slow tiers' landings so far, else their rate in recent restores) and the
        model's measured speed (`PrefillRate.head_tokens`, with the `others` requests its
        steps hold up), that is the head it computes while the tiers deliver the rest,
        whole blocks, after the blocks at the front that no tier holds (a gap: computed
        whatever the rates say): 0 (wait this step) when there is no gap there and the tiers
        would deliver everything before one block is computed. While the prefill rate is
        unknown the front claims `PROBE_TOKENS` to measure it; while the load rate is
        unknown, or nothing is in flight or about to be issued, it claims all of
        `num_tokens` (the plain meeting point)."""
        bs = self.block_size
        if prefill is None or prefill.tokens_per_s is None:
            return min(num_tokens, PROBE_TOKENS)
        load_rate = self._load_rate()
        if not (self._in_flight or self._issue_capped) or load_rate is None:
            return num_tokens
        gap = compute_block
        while gap < self.num_blocks and self.states[gap] is BlockState.COMPUTE:
            gap += 1
        share = prefill.head_tokens(self._pending_tokens(gap), gap * bs, load_rate,
                                    others=others)
        return min(num_tokens, (gap - compute_block) * bs + share // bs * bs)

    def skip(self, compute_block: int) -> int:
        """The compute front after skipping the VALID blocks at `compute_block` onwards."""
        while compute_block < self.num_blocks \
                and self.states[compute_block] is BlockState.VALID:
            compute_block += 1
        return compute_block

    def claim(self, start_token: int, num_tokens: int) -> int:
        """Claim up to `num_tokens` tokens from `start_token` for computing; returns how many
        may be computed now (0: the front waits for a group whose bytes are on their way).
        PENDING blocks in the way become COMPUTE, groups in the way not started yet are
        cancelled; the chunk stops at a VALID block or a group already arriving."""
        bs = self.block_size
        end = stop = start_token + num_tokens
        index = start_token // bs
        while index < self.num_blocks and index * bs < end:
            state = self.states[index]
            if state is BlockState.LOADING and self._cancel(index):
                continue  # the group's blocks are PENDING again: claim them
            if state in (BlockState.LOADING, BlockState.VALID):
                stop = index * bs
                break
            self.states[index] = BlockState.COMPUTE
            index += 1
        return max(0, stop - start_token)

    def _cancel(self, block_index: int) -> bool:
        """Cancel the group holding `block_index`; False if its bytes are already on their
        way (it stays in flight and lands)."""
        group = next(g for g in self._in_flight if g.start <= block_index < g.stop)
        arriving = self.manager.cancel_load(group.load_id)
        if any(arriving):
            return False
        self._in_flight.remove(group)
        self._draining.append(group)
        for i in range(group.start, group.stop):
            self.states[i] = BlockState.PENDING
        self._top = max(self._top, group.stop - 1)
        return True

    def abandon(self) -> None:
        """The request gave its blocks back (or finished): cancel every group in flight.
        `collect` completes them as their I/O ends (their blocks are not cached: the
        request no longer holds them) and counts what they read; `num_in_flight` says
        how many are left."""
        for group in self._in_flight:
            self.manager.cancel_load(group.load_id)
        self._draining.extend(self._in_flight)
        self._in_flight = []
