"""The restores a scheduler drives: one per request whose prefix is being restored, and
those given up (the request finished, was preempted, or the fronts met) whose loads are
still in flight.

A restore given up cancels its loads; what was already reading goes on holding host slots
and GPU blocks until its I/O ends, so it is kept (`num_loading`, `has_ending`) and collected
like the others, and the slow tiers' rates are learnt from it once nothing of it is in
flight, reads the compute front overtook included (`RestoreGate.learn`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.engine.request import Request, RequestId
from kvtier.engine.restore import Restore, RestoreFronts
from kvtier.engine.restore_gate import RestoreGate
from kvtier.engine.restore_rates import PrefillRate


class RunningRestores:
    """Restores by request id, those ending, and the groups each issues once the step that
    made its claim is queued on the GPU (`after_launch`, `issue_after_launch`)."""

    def __init__(self, gate: RestoreGate) -> None:
        self.gate = gate
        self._by_request: dict[RequestId, Restore] = {}
        # Restores that ended with loads whose I/O has not ended (they hold host slots).
        self._ending: list[Restore] = []
        # Restores whose next groups are issued once the step is queued, and the block
        # each issues from.
        self._after_launch: dict[RequestId, int] = {}

    def get(self, request_id: RequestId) -> Restore | None:
        return self._by_request.get(request_id)

    def start(self, request_id: RequestId, restore: Restore) -> None:
        assert request_id not in self._by_request, "one restore per request"
        self._by_request[request_id] = restore

    @property
    def has_ending(self) -> bool:
        """Whether restores given up still have loads in flight (they hold blocks)."""
        return bool(self._ending)

    @property
    def num_loading(self) -> int:
        """Loads not completed yet (of running restores, or of restores given up)."""
        return sum(r.num_in_flight for r in [*self._ending, *self._by_request.values()])

    def fronts(self, requests: Iterable[Request]) -> dict[RequestId, RestoreFronts]:
        """Where the restore of each of `requests` that has one stands."""
        return {r.request_id: self._by_request[r.request_id].fronts(
                    r.num_computed_tokens // r.block_size)
                for r in requests if r.request_id in self._by_request}

    def collect(self) -> None:
        """Land the groups that arrived (call after `TierManager.poll`); complete the loads
        given up whose I/O has ended, learning from their restores."""
        for restore in list(self._ending):
            restore.collect()
            if not restore.num_in_flight:
                self._ending.remove(restore)
                self.gate.learn(restore)
        for restore in self._by_request.values():
            restore.collect()

    def after_launch(self, request_id: RequestId, floor: int) -> None:
        """Issue `request_id`'s next groups from block `floor` once the step is queued."""
        self._after_launch[request_id] = floor

    def issue_after_launch(self, prefill: PrefillRate,
                           num_others: Callable[[RequestId], int]) -> None:
        """Issue the groups `after_launch` set aside (with `num_others(request_id)` requests
        running beside each)."""
        pending, self._after_launch = self._after_launch, {}
        for request_id, floor in pending.items():
            restore = self._by_request.get(request_id)
            if restore is not None:
                restore.issue(floor, prefill, others=num_others(request_id))

    def end(self, request_id: RequestId) -> Restore | None:
        """The restore of `request_id`, given up and forgotten (see the module docstring);
        None when it has none."""
        restore = self._by_request.pop(request_id, None)
        if restore is None:
            return None
        restore.abandon()
        if restore.num_in_flight:
            self._ending.append(restore)
        else:
            self.gate.learn(restore)
        return restore
