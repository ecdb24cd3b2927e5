"""A generation request: its tokens, its state, its block table and its block hashes.

State machine (the scheduler moves a request along it):

    WAITING | PREEMPTED --admitted------------------> RUNNING --stop / length--> FINISHED
    RUNNING --out of blocks--> PREEMPTED (back at the front of the waiting queue)

  A prefix hit below the GPU is restored while the request runs (`engine.restore`): there is
  no state of waiting for a load.

Invariants:
  * `num_computed_tokens <= num_tokens`; the KV of tokens `[0, num_computed_tokens)` sits in
    the blocks of `block_table` (block `i` holds tokens `[i * block_size, (i+1) * block_size)`);
  * blocks `[0, num_cached_blocks)` are full, hashed and already known to the tier manager;
  * `hasher.block_hashes[i]` is the hash of block `i` for every full block of `token_ids`
    (computed or not), chained from the request's namespace.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from kvtier.engine.outputs import RequestMetrics

from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash, BlockHasher
from kvtier.tiers.record import BlockMeta

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenCounters:
    """Where a request's KV came from, summed over its admissions."""

    cached_gpu: int = 0
    cached_host: int = 0
    cached_disk: int = 0
    cached_remote: int = 0
    computed: int = 0
    num_preemptions: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    `token_ids` is the prompt followed by the generated tokens; `max_num_tokens` caps its
    length (prompt + max_tokens, never past the model's context). `eos_token_ids` end the
    request with "stop" unless `ignore_eos`; `stop_token_ids` always do.
    `params` is the request's `engine.sampler.SamplingParams` (opaque here).
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    params: Any
    hasher: BlockHasher
    max_num_tokens: int
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[KVCacheBlock] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    counters: TokenCounters = field(default_factory=TokenCounters)
    #: `block_meta`'s by block index, built once each (a restore asks for each twice).
    _block_metas: dict[int, BlockMeta] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if self.max_num_tokens <= len(self.prompt_token_ids):
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) leaves no room after the "
                             f"{len(self.prompt_token_ids)}-token prompt")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
            self.hasher.extend(self.prompt_token_ids)
        assert self.hasher.num_tokens == len(self.token_ids), "hasher out of sync with tokens"

    # ---- sizes ---------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block of `token_ids`, in order."""
        return self.hasher.block_hashes

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_token_ids(self, block_index: int) -> tuple[int, ...]:
        """Token ids of full block `block_index`."""
        start = block_index * self.block_size
        assert start + self.block_size <= len(self.token_ids), \
            f"block {block_index} of request {self.request_id} is not full"
        return tuple(self.token_ids[start:start + self.block_size])

    def block_meta(self, block_index: int) -> BlockMeta:
        """What names full block `block_index` in the tiers: its hash, its parent's, its
        token ids (`kvtier.tiers.record.BlockMeta`)."""
        meta = self._block_metas.get(block_index)
        if meta is None:  # full blocks never change: build each once, when first asked
            meta = BlockMeta(self.block_hashes[block_index], self.parent_hash(block_index),
                             self.block_token_ids(block_index))
            self._block_metas[block_index] = meta
        return meta

    def parent_hash(self, block_index: int) -> BlockHash:
        """Hash that block `block_index` chains from (the namespace for block 0)."""
        if block_index == 0:
            return self.hasher.namespace
        return self.hasher.block_hashes[block_index - 1]

    # ---- transitions ---------------------------------------------------------------------

    def append_token(self, token_id: int, now: float) -> str | None:
        """Record one sampled token; return the finish reason if it ends the request."""
        assert self.status is RequestStatus.RUNNING, f"{self.request_id} is {self.status}"
        assert self.num_computed_tokens == self.num_tokens, "sampled before the prompt was done"
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self.hasher.extend((token_id,))
        if self.first_token_time is None:
            self.first_token_time = now
        if token_id in self.stop_token_ids:
            return "stop"
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return "stop"
        if self.num_tokens >= self.max_num_tokens:
            return "length"
        return None

    def reset_blocks(self) -> list[KVCacheBlock]:
        """Forget the block table and the computed prefix; return the blocks to free."""
        blocks, self.block_table = self.block_table, []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        return blocks

    def metrics(self) -> RequestMetrics:
        c = self.counters
        return RequestMetrics(self.arrival_time, self.first_token_time, self.finished_time,
                              c.cached_gpu, c.cached_host, c.cached_disk, c.computed,
                              c.num_preemptions, cached_tokens_remote=c.cached_remote)


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """Validate prompt token ids at the API boundary; raises ValueError on bad ids."""
    out = tuple(int(t) for t in token_ids)
    if not out:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}); got {bad[:5]}")
    return out


class OutputTokenIds(Sequence):
    """Each request's generated token ids, read only for the rows that ask (penalties)."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self._requests = requests

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index):  # type: ignore[override]
        return self._requests[index].output_token_ids
