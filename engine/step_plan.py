"""One step's plan, as the scheduler makes it and the model runner reads it: the requests
that run, which of their tokens, and where those go in the paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from kvtier.engine.request import Request


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

    def placement(self, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the chunk's tokens go in the paged cache: block_ids [blocks up to its end],
        positions [num_new_tokens] and slot_mapping [num_new_tokens], all int64."""
        request = self.request
        end = self.start + self.num_new_tokens
        num_blocks = -(-end // block_size)
        assert len(request.block_table) >= num_blocks, \
            f"{request.request_id}: {len(request.block_table)} blocks for {end} tokens"
        block_ids = np.fromiter((b.block_id for b in request.block_table[:num_blocks]),
                                dtype=np.int64, count=num_blocks)
        positions = np.arange(self.start, end, dtype=np.int64)
        slots = block_ids[positions // block_size] * block_size + positions % block_size
        return block_ids, positions, slots


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the batch, and requests that changed state while planning."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
