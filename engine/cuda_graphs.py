"""CUDA graphs for pure-decode steps (every request adds one token and samples).

A decode step of a large model is bound by the host: each layer launches several Triton
and torch kernels from Python. `DecodeGraphs` records the model's forward once per batch
bucket (1, 2, 4, ... 256, up to the engine's max_num_seqs) and replays it, so a step costs
a few small host-to-device copies and one graph launch.

The graphs read static device buffers. A step's batch is padded to its bucket; a padding
row has token 0 at position 0, slot_mapping -1 (its K/V are not stored), seq_len 1 and a
block table row of zeros, so it attends to slot 0 of block 0: finite garbage, discarded.
The attention metadata of a graph never depends on the step's host values: max_query_len is
1 and max_seq_len is the engine's longest sequence rounded up to whole blocks, so the
split-KV count depends only on the bucket (each request's splits are cut from its own
device-side seq_len; splits past it stay empty and weigh nothing in the merge).

Prefill and mixed steps, batches above the largest bucket and sequences longer than the
buffers were sized for are left to the eager path (`can_run` says which).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from kvtier.engine.attention import AttentionMetadata
from kvtier.engine.scheduler import ScheduledRequest

#: Batch sizes a graph is recorded for; a decode batch is padded to the next one.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets an engine running at most `max_num_seqs` requests per step needs: every
    bucket up to the first one that holds `max_num_seqs` (all of them above 256)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    buckets = []
    for size in BATCH_BUCKETS:
        buckets.append(size)
        if size >= max_num_seqs:
            break
    return tuple(buckets)


class DecodeGraphs:
    """Recorded decode forwards of `model` over `kv_cache`, one per batch bucket.

    model: `forward(input_ids, positions, kv_cache, attn_metadata) -> hidden [n, hidden]`,
        with capture-safe kernels (the triton attention backend).
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] on CUDA.
    max_model_len: the longest sequence (tokens) any request may reach; the block tables
        hold ceil(max_model_len / block_size) blocks per request.
    Raises ValueError when the cache is not on CUDA or a size is not positive.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 max_num_seqs: int, max_model_len: int) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV cache on CUDA, got {kv_cache.device}")
        if block_size < 1 or max_model_len < 1:
            raise ValueError(f"block_size ({block_size}) and max_model_len ({max_model_len}) "
                             "must be positive")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.max_seq_len = self.max_blocks_per_req * block_size
        self.num_replays = 0
        self.capture_seconds = 0.0
        device = kv_cache.device
        rows = self.buckets[-1]
        # Rows 0/1/2: input_ids, positions, slot_mapping.
        self._tokens = torch.zeros((3, rows), dtype=torch.int64, device=device)  # [3, rows]
        self._seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [rows]
        self._query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._block_tables = torch.zeros((rows, self.max_blocks_per_req), dtype=torch.int32,
                                         device=device)  # [rows, max_blocks_per_req]
        # Pinned staging of the same fields; a step writes them, then copies them over.
        self._host_tokens = torch.zeros((3, rows), dtype=torch.int64).pin_memory()
        self._host_seq_lens = torch.ones(rows, dtype=torch.int32).pin_memory()
        self._host_block_tables = torch.zeros((rows, self.max_blocks_per_req),
                                              dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()  # the last step's copies have read the staging
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> hidden [bucket, hidden]
        self._pool = None

    def bucket_for(self, num_reqs: int) -> int | None:
        """The smallest bucket holding `num_reqs` requests; None when none does."""
        for size in self.buckets:
            if size >= num_reqs:
                return size
        return None

    def can_run(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether this step is a pure decode that fits a bucket and the block tables."""
        if not scheduled or self.bucket_for(len(scheduled)) is None:
            return False
        return all(s.num_new_tokens == 1 and s.samples and s.start < self.max_seq_len
                   for s in scheduled)

    def capture_all(self) -> None:
        """Record every bucket not recorded yet, largest first (smaller graphs then reuse
        the largest one's memory pool). Adds the time spent to `capture_seconds`."""
        for size in reversed(self.buckets):
            if size not in self._graphs:
                self._capture(size)

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        start = time.perf_counter()
        self._copied.synchronize()
        self._reset_inputs()
        ids, positions, metadata = self._inputs(size)
        # One eager run compiles the kernels for these shapes; padding rows store nothing.
        self.model.forward(ids, positions, self.kv_cache, metadata)
        torch.cuda.synchronize(self.kv_cache.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.model.forward(ids, positions, self.kv_cache, metadata)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = graph
        self._outputs[size] = hidden  # [size, hidden_size]
        torch.cuda.synchronize(self.kv_cache.device)
        self.capture_seconds += time.perf_counter() - start

    def _reset_inputs(self) -> None:
        """Padding values in every row of the device buffers (capture-time inputs)."""
        self._tokens[:2].zero_()
        self._tokens[2].fill_(-1)
        self._seq_lens.fill_(1)
        self._block_tables.zero_()

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        metadata = AttentionMetadata(
            query_start_loc=self._query_start_loc[:size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            slot_mapping=self._tokens[2, :size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        return self._tokens[0, :size], self._tokens[1, :size], metadata

    @torch.inference_mode()
    def run(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Replay the bucket's graph for this decode step (recording it first if needed).

        Returns hidden [len(scheduled), hidden_size], a view of the graph's output that the
        next replay overwrites. The caller has checked `can_run`.
        """
        num_reqs = len(scheduled)
        size = self.bucket_for(num_reqs)
        assert size is not None and self.can_run(scheduled), "not a graph-sized decode step"
        if size not in self._graphs:
            self._capture(size)
        self._copied.synchronize()  # the previous step's copies are done with the staging
        self._stage(scheduled, size)
        self._tokens.copy_(self._host_tokens, non_blocking=True)
        self._seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self._block_tables[:size].copy_(self._host_block_tables[:size], non_blocking=True)
        self._copied.record()
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size][:num_reqs]

    def _stage(self, scheduled: Sequence[ScheduledRequest], size: int) -> None:
        """Write the step's values, then padding rows up to `size`, into the staging."""
        bs = self.block_size
        tokens = self._host_tokens.numpy()  # [3, rows]
        seq_lens = self._host_seq_lens.numpy()
        block_tables = self._host_block_tables.numpy()  # [rows, max_blocks_per_req]
        for row, planned in enumerate(scheduled):
            request = planned.request
            pos = planned.start
            num_blocks = pos // bs + 1
            assert len(request.block_table) >= num_blocks, \
                f"{request.request_id}: {len(request.block_table)} blocks for {pos + 1} tokens"
            block_tables[row, :num_blocks] = np.fromiter(
                (b.block_id for b in request.block_table[:num_blocks]), dtype=np.int32,
                count=num_blocks)
            tokens[0, row] = request.token_ids[pos]
            tokens[1, row] = pos
            tokens[2, row] = int(block_tables[row, num_blocks - 1]) * bs + pos % bs
            seq_lens[row] = pos + 1
        num_reqs = len(scheduled)
        tokens[:2, num_reqs:size] = 0
        tokens[2, num_reqs:size] = -1
        seq_lens[num_reqs:size] = 1
        block_tables[num_reqs:size, 0] = 0
