"""Reads ahead for requests that wait for GPU room (or a seat).

Behind a full GPU pool a request whose prefix lies below the host waits for blocks to
restore into (`RestoreGate.waits_for_room`), and its reads only start once it is admitted,
while its restore holds those blocks. Meanwhile the running requests decode, and the disk
and the I/O threads idle. `WaitingPrefetch` reads the prefix blocks of waiting requests
into the host tier ahead of them, in arrival order (`TierManager.prefetch`): at admission
their restore finds them on the host and copies them to the GPU at the host's speed.

What it reads ahead is bounded twice: the reads in flight by the manager
(`TierManager.prefetch_room`), the blocks planned for requests not yet admitted by half the
host slots (`AHEAD_SHARE`), since blocks read further ahead would be evicted before their
request comes. A request is planned once, from its prompt's block hashes (no lookup, so no
tier is asked and no hit counted): the blocks the GPU pool does not cache, when the gate
would read them for a request beside others (`RestoreGate.worth_prefetching`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.engine.request import Request, RequestId
from kvtier.engine.restore_gate import RestoreGate

from kvtier.stats import Tier
from kvtier.tiers.record import BlockMeta

if TYPE_CHECKING:
    from kvtier.manager import TierManager

#: Share of the host slots that the plans of waiting requests may cover at once.
AHEAD_SHARE = 0.5


class WaitingPrefetch:
    """Per waiting request, the prefix blocks still to read ahead (see the module)."""

    def __init__(self, manager: TierManager, gate: RestoreGate) -> None:
        self.manager = manager
        self.gate = gate
        # Request -> (blocks planned, those whose read has not started yet).
        self._plans: dict[RequestId, tuple[int, list[BlockMeta]]] = {}

    def step(self, waiting: Sequence[Request]) -> None:
        """Start the reads ahead that room allows, for `waiting` (in arrival order) while
        others run. Call once per plan."""
        host = self.manager.tiers.caching_host
        slow = list(dict.fromkeys(tier.kind for tier in self.manager.lower_tiers))
        # Nothing is planned before a restore measured the tiers below: a plan made then
        # would be empty, and kept.
        if host is None or self.gate.tier_rates.expected(slow) is None:
            return
        budget = int(host.num_slots * AHEAD_SHARE)
        for request in waiting:
            if self.manager.prefetch_room == 0 or budget <= 0:
                return
            plan = self._plans.get(request.request_id)
            if plan is None:
                plan = self._plans[request.request_id] = self._plan(request, slow)
            size, todo = plan
            budget -= size
            if todo:
                later = self.manager.prefetch(todo)
                self.gate.counts.prefetched += len(todo) - len(later)
                self._plans[request.request_id] = (size, later)
                if len(later) == len(todo):  # no slot to be had: none for the next either
                    return

    def forget(self, request_id: RequestId) -> None:
        """`request_id` was admitted or stopped: nothing more is read ahead for it."""
        self._plans.pop(request_id, None)

    def _plan(self, request: Request, slow: list[Tier]) -> tuple[int, list[BlockMeta]]:
        """The blocks of `request`'s prefix that the GPU pool does not cache, from the first
        of them on, if the gate would read them from the `slow` tiers (else none)."""
        num_lookup = (request.num_tokens - 1) // request.block_size
        hashes = request.block_hashes[:num_lookup]
        pool = self.manager.pool
        below = [i for i, block_hash in enumerate(hashes)
                 if pool.get_cached_block(block_hash) is None]
        if not below:
            return 0, []
        context = below[0] * request.block_size
        if not self.gate.worth_prefetching(request.num_tokens - context, context, slow):
            return 0, []
        return len(below), [request.block_meta(i) for i in below]
