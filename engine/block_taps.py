"""Block taps: a request's prompt blocks handed, as they become ready, to whoever asked for
them. A prefill instance hands them over to a decode instance this way while its later
chunks compute (`kvtier.handoff`).

A tap is called on the engine thread, in the scheduler's `update`, with the blocks that
became ready since its last call: full, computed (or restored) and cached. Each block
carries one more reference, taken for the tap, so the pool cannot reuse it while the bytes
are read; whoever receives the blocks gives it back with `TierManager.free` on the engine
thread once done with them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.engine.request import Request, RequestId

from kvtier.free_queue import KVCacheBlock
from kvtier.tiers.record import BlockMeta

if TYPE_CHECKING:
    from kvtier.manager import TierManager

#: tap(first_index, metas, blocks): a request's prompt blocks from block `first_index` on,
#: newly full and computed (or restored), each given once, in order (see the module
#: docstring for the reference each block carries).
BlockTap = Callable[[int, list[BlockMeta], list[KVCacheBlock]], None]


@dataclass(slots=True)
class _Tap:
    fn: BlockTap
    num_given: int = 0


class BlockTaps:
    """The taps on one scheduler's requests; `manager` holds the pool whose references the
    given blocks carry."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self._taps: dict[RequestId, _Tap] = {}

    def add(self, request_id: RequestId, tap: BlockTap) -> None:
        """Give `tap` the prompt blocks of request `request_id` as they become ready."""
        self._taps[request_id] = _Tap(tap)

    def give(self, request: Request) -> None:
        """Call `request`'s tap, if it has one, with its prompt blocks that became ready
        since the last call."""
        tap = self._taps.get(request.request_id)
        if tap is None:
            return
        num_ready = min(min(request.num_computed_tokens, request.num_prompt_tokens)
                        // request.block_size, len(request.block_hashes))
        if num_ready <= tap.num_given:
            return
        first = tap.num_given
        blocks = request.block_table[first:num_ready]
        self.manager.touch(blocks)  # the tap's reference, given back by whoever gets them
        tap.num_given = num_ready
        tap.fn(first, [request.block_meta(i) for i in range(first, num_ready)], blocks)

    def drop(self, request_id: RequestId) -> None:
        """`request_id` finished: its tap is called no more."""
        self._taps.pop(request_id, None)
