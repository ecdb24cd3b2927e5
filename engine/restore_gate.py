"""Whether a prefix's blocks below the GPU are read or computed, and how lookups went.

At admission, at the first block that neither the GPU nor the host holds, the scheduler asks
`RestoreGate.worth_reading` whether the disk and remote tiers are worth looking up for the
tokens from there on: `restore_rates.worth_reading` at the model's measured prefill rate and
those tiers' measured rates. A gate closed on measured rates would never learn that a tier
became faster (a cold first read after start), so a prefix it turns away is read anyway now
and then (`TierRates.turned_away`): a probe, which restores as if the rates were not known
and whose rates replace the old ones. Hits that find no GPU blocks to load into wait for
some while other requests run, for at most the time computing them would take
(`RestoreGate.waits_for_room`). `RestoreCounts` keeps the account of every lookup.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.engine.request import RequestId
from kvtier.engine.restore import Restore
from kvtier.engine.restore_rates import (
    BUSY_MIN_SAVING_S,
    MIN_SAVING_S,
    PrefillRate,
    TierRates,
    worth_reading,
)

from kvtier.stats import Tier


@dataclass(slots=True)
class RestoreCounts:
    """How prefix lookups below the GPU went, counted per lookup (a waiting request that
    cannot be admitted is looked up again at each step).

    started: lookups that started a restore (host hits, or hits below it).
    no_room: lookups whose hits below the GPU were given up because no GPU blocks could be
        had to load them into (the request computes that part).
    room_waits: lookups that found no GPU blocks to load into and left the request waiting
        for running requests to free some (`RestoreGate.waits_for_room`).
    turned_away: prefixes the measured prefill and tier rates said to compute rather than
        read from the disk or remote tier (not looked up there).
    probes: prefixes read from those tiers although the rates said not to, to measure them
        again.
    prefetched: blocks (not lookups) whose read ahead into the host tier started for
        requests waiting for GPU room (`engine.prefetch`).
    """

    started: int = 0
    no_room: int = 0
    room_waits: int = 0
    turned_away: int = 0
    probes: int = 0
    prefetched: int = 0


class RestoreGate:
    """The read-or-compute decision of one scheduler (see the module docstring).

    prefill_rate: the model's measured speed (the engine feeds it). start_rate: a rough
    one, timed at start from one short prefill where nothing else is (the CPU, which has no
    warm-up): it only answers whether a prefix is worth looking for at all while
    `prefill_rate` has seen no step, and never sizes a restore's fronts (from one fresh
    step, it knows nothing of attention's cost over a context). tier_rates: what the
    disk and remote tiers delivered to recent restores (`learn`). min_saving_s: seconds
    reading must be expected to save before those tiers are asked; 0 asks them for every
    prefix. counts: how lookups went (the scheduler counts restores started and given up).
    """

    def __init__(self, min_saving_s: float = MIN_SAVING_S) -> None:
        self.prefill_rate = PrefillRate()
        self.start_rate = PrefillRate()
        self.tier_rates = TierRates()
        self.min_saving_s = min_saving_s
        self.counts = RestoreCounts()
        self._probes: set[RequestId] = set()  # their lookups read to measure the rates
        #: When each waiting request first found no GPU blocks to load into.
        self._room_wait_began: dict[RequestId, float] = {}
        self._room_wait_ends: dict[RequestId, float] = {}  # monotonic seconds

    def worth_reading(self, request_id: RequestId, num_tokens: int, context: int,
                      slow: Sequence[Tier], fast_blocks_behind: bool,
                      busy: bool = False) -> bool:
        """Whether the `num_tokens` tokens after `context` of request `request_id` are worth
        looking up in the `slow` tiers (those below the host); `fast_blocks_behind`: the
        host holds some of their blocks further on (they come at once). A probe when the
        measured rates say no but the tiers are due to be measured again (`take_probe`).

        `busy`: other requests run or wait. Then, once the tiers' rates are measured, a
        read is worth it when the tokens it covers take `BUSY_MIN_SAVING_S` to compute,
        whenever its first read lands: the GPU time it saves goes to the other requests,
        and the request's wait for it overlaps their steps (beside others a restore's head
        shrinks to what pays for their wait, `PrefillRate.head_pays`). A request alone keeps
        the margin over the fronts' meeting, first read's latency included, as do all
        while the rates are unknown: there a read that lands later than measured makes its
        own prompt slower. (Serving many conversations behind a small host tier, the margin
        turned most reads away, and later the latency turned the short ones away while the
        disk asked for every prefix served more; docs/BENCHMARKS.md, "The disk tier behind
        a small host tier".)"""
        if not slow:
            return False  # nothing below the host to read from
        prefill = self._prefill_tokens_per_s(num_tokens, context)
        load_rate = self.tier_rates.expected(slow)
        if busy and load_rate is not None:
            worth = self._worth_beside_others(num_tokens, prefill)
        else:
            worth = worth_reading(num_tokens, prefill, load_rate, self.min_saving_s,
                                  self.tier_rates.expected_latency(slow),
                                  fast_blocks_behind=fast_blocks_behind)
        if worth:
            if load_rate is not None:
                self.tier_rates.opened(slow)
            return True
        # Turned away on measured rates. A probe reads it anyway now and then, if the prefix
        # is long enough to be worth reading from a tier of unknown speed (the rule before
        # any read): with no latency, the fronts together are never slower than the
        # model alone, and the compute front waits for a first landing at most
        # `FIRST_LANDING_WAIT_SHARE` of the compute time.
        if worth_reading(num_tokens, prefill, None, self.min_saving_s) \
                and self.tier_rates.turned_away(slow):
            self._probes.add(request_id)
            self.counts.probes += 1
            return True
        self.counts.turned_away += 1
        return False

    def worth_prefetching(self, num_tokens: int, context: int, slow: Sequence[Tier]) -> bool:
        """Whether the `num_tokens` tokens after `context` of a request waiting for GPU room
        are worth reading ahead from the `slow` tiers: their rate was measured (a restore
        read them) and the read is worth it by the rule for a request beside others
        (`worth_reading` with `busy`). Counts nothing and starts no probe."""
        if not slow or self.tier_rates.expected(slow) is None:
            return False
        return self._worth_beside_others(num_tokens,
                                         self._prefill_tokens_per_s(num_tokens, context))

    def _worth_beside_others(self, num_tokens: int, prefill: float | None) -> bool:
        """The rule for a read beside other requests, once the tiers' rates are measured:
        the tokens take `BUSY_MIN_SAVING_S` (or the gate's own margin, if smaller) to
        compute at `prefill` tokens/s."""
        return worth_reading(num_tokens, prefill, None, min(self.min_saving_s,
                                                            BUSY_MIN_SAVING_S))

    def _prefill_tokens_per_s(self, num_tokens: int, context: int) -> float | None:
        """The model's speed over `num_tokens` prompt tokens after `context` (the measured
        rate, else the one timed at start); None while neither is known."""
        rate = self.prefill_rate if self.prefill_rate.tokens_per_s is not None \
            else self.start_rate
        seconds = rate.seconds(num_tokens, context)
        return None if not seconds else num_tokens / seconds

    def waits_for_room(self, request_id: RequestId, num_tokens: int, context: int,
                       others_run: bool) -> bool:
        """Whether request `request_id`, whose `num_tokens` tokens after `context` were
        found below the GPU but find no GPU blocks to load into, waits for blocks (True)
        or computes those tokens (False, the hits given up): it waits while other requests
        run (`others_run`: they free blocks as they finish), for at most the time computing
        the tokens is expected to take (the first step only, while the rate is unknown).
        Computing instead takes blocks a chunk at a time and gives the restore up for
        good: behind a full pool (many conversations in lockstep) most restores were given
        up that way, each prefix computed at the GPU's cost."""
        if others_run:
            now = time.monotonic()
            began = self._room_wait_began.setdefault(request_id, now)
            ends = began + (self.prefill_rate.seconds(num_tokens, context) or 0.0)
            if began == now or now < ends:
                self._room_wait_ends[request_id] = ends
                self.counts.room_waits += 1
                return True
        self.counts.no_room += 1
        return False

    def room_wait_ends(self, request_id: RequestId) -> float:
        """When (`time.monotonic()`) the wait for blocks that `waits_for_room` last granted
        `request_id` runs out; 0 when it waits for none."""
        return self._room_wait_ends.get(request_id, 0.0)

    def left_waiting(self, request_id: RequestId) -> None:
        """`request_id` was admitted or stopped: its wait for blocks, if any, is over."""
        self._room_wait_began.pop(request_id, None)
        self._room_wait_ends.pop(request_id, None)

    def take_probe(self, request_id: RequestId) -> bool:
        """Whether the lookup of `request_id` that just ran was a probe (asked once)."""
        if request_id in self._probes:
            self._probes.discard(request_id)
            return True
        return False

    def learn(self, restore: Restore) -> None:
        """The slow tiers' rates as `restore` measured them (a probe's replace the old)."""
        for tier, num_tokens, seconds, latency_s in restore.measured_rates():
            self.tier_rates.observe(tier, num_tokens, seconds, latency_s,
                                    replace=restore.probe)
