"""CUDA graphs for small steps: decodes, and short prefill chunks run as decode rows.

A step of few tokens on a large model is bound by the host: each layer launches several
Triton and torch kernels from Python, and those launches take longer than the kernels
(docs/KERNELS.md, "CUDA graphs for small steps"). `DecodeGraphs` records the model's forward
once per row bucket (1, 2, 4, ... 256, up to the engine's max_num_seqs) as a decode batch
(one query per row) and replays it, so a step costs a few small host-to-device copies and
one graph launch.

A prefill chunk fits the same graphs: its token at position p is a row whose sequence ends
at p + 1 over the request's block table. Each layer stores every row's K/V before it
attends, so row p sees keys 0..p, the causal mask of the chunk. Each row reads its own
context, where an eager step reads it once per chunk, so a step with prefill chunks runs as
rows only while those rows read at most `MAX_ROW_KEY_READS` keys in all; the hidden state a
request samples from is its last row's (`run`). This is what makes a restore that leaves a
few tokens to compute (a prompt restored from the host tier, the tail of a block) cost about
as much as a decode step.

The graphs read static device buffers. A step's batch is padded to its bucket; a padding
row has token 0 at position 0, slot_mapping -1 (its K/V are not stored), seq_len 1 and a
block table row of zeros, so it attends to slot 0 of block 0: finite garbage, discarded.
The attention metadata of a graph never depends on the step's host values: max_query_len is
1 and max_seq_len is the engine's longest sequence rounded up to whole blocks, so the
split-KV count depends only on the bucket (each request's splits are cut from its own
device-side seq_len; splits past it stay empty and weigh nothing in the merge).

Steps of more rows than the largest bucket, chunks whose rows would read more keys, and
sequences longer than the buffers were sized for are left to the eager path (`can_run`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from kvtier.engine.attention import AttentionMetadata
from kvtier.engine.step_plan import ScheduledRequest

#: Row counts a graph is recorded for; a step's rows are padded to the next one.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: The most keys the rows of a step's prefill chunks may read in all for the step to run as
#: graph rows: 16 new tokens after a 16K context. Each row reads the whole context where an
#: eager chunk reads it once, so the rows' saving on launches shrinks as the context grows;
#: past this many key reads an eager step is the cheaper (docs/KERNELS.md, "CUDA graphs for
#: small steps").
MAX_ROW_KEY_READS = 1 << 18


def chunk_key_reads(start: int, num_new_tokens: int) -> int:
    """Keys read by a chunk's rows in a graph step: row p attends to p + 1 keys."""
    return num_new_tokens * (2 * start + num_new_tokens + 1) // 2


def stage_rows(scheduled: Sequence[ScheduledRequest], block_size: int, tokens: np.ndarray,
               seq_lens: np.ndarray, block_tables: np.ndarray, size: int) -> int:
    """Write one row per new token of `scheduled`, then padding rows up to `size`.

    tokens: [4, rows] int64: input_ids, positions, slot_mapping, and in its first
        len(scheduled) entries of the last row the row of each request's last new token.
    seq_lens: [rows] int32 (position + 1 per row); block_tables: [rows, max_blocks] int32
        (a request's rows all get its block table; each row reads only up to its seq_len).
    Returns the number of real rows. The caller has checked that they fit (`can_run`).
    """
    row = 0
    for index, planned in enumerate(scheduled):
        block_ids, positions, slots = planned.placement(block_size)
        rows = slice(row, row + planned.num_new_tokens)
        tokens[0, rows] = planned.request.token_ids[planned.start:planned.start
                                                    + planned.num_new_tokens]
        tokens[1, rows] = positions
        tokens[2, rows] = slots
        seq_lens[rows] = positions + 1
        block_tables[rows, :len(block_ids)] = block_ids
        row = rows.stop
        tokens[3, index] = row - 1
    tokens[:2, row:size] = 0
    tokens[2, row:size] = -1
    seq_lens[row:size] = 1
    block_tables[row:size, 0] = 0
    return row


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
    """Recorded decode forwards of `model` over `kv_cache`, one per row bucket.

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
        # Rows 0/1/2/3: input_ids, positions, slot_mapping, each request's last row.
        self._tokens = torch.zeros((4, rows), dtype=torch.int64, device=device)  # [4, rows]
        self._seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [rows]
        self._query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._block_tables = torch.zeros((rows, self.max_blocks_per_req), dtype=torch.int32,
                                         device=device)  # [rows, max_blocks_per_req]
        # Pinned staging of the same fields; a step writes them, then copies them over.
        self._host_tokens = torch.zeros((4, rows), dtype=torch.int64).pin_memory()
        self._host_seq_lens = torch.ones(rows, dtype=torch.int32).pin_memory()
        self._host_block_tables = torch.zeros((rows, self.max_blocks_per_req),
                                              dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()  # the last step's copies have read the staging
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> hidden [bucket, hidden]
        self._pool = None
        # torch.cuda.graph's default capture stream is made once per process, on the device
        # current at the first capture: an engine on another GPU would capture there.
        self._capture_stream = torch.cuda.Stream(device)

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest bucket holding `num_rows` rows; None when none does."""
        for size in self.buckets:
            if size >= num_rows:
                return size
        return None

    def can_run(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether this step's tokens fit a bucket as rows, its sequences fit the block
        tables, and its prefill chunks' rows read at most `MAX_ROW_KEY_READS` keys."""
        if not scheduled:
            return False
        num_rows = key_reads = 0
        for planned in scheduled:
            if planned.start + planned.num_new_tokens > self.max_seq_len:
                return False
            num_rows += planned.num_new_tokens
            if planned.num_new_tokens > 1:
                key_reads += chunk_key_reads(planned.start, planned.num_new_tokens)
        return self.bucket_for(num_rows) is not None and key_reads <= MAX_ROW_KEY_READS

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
        with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
            hidden = self.model.forward(ids, positions, self.kv_cache, metadata)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = graph
        self._outputs[size] = hidden  # [size, hidden_size]
        torch.cuda.synchronize(self.kv_cache.device)
        self.capture_seconds += time.perf_counter() - start

    def _reset_inputs(self) -> None:
        """Padding values in every row of the device buffers (capture-time inputs)."""
        self._tokens.zero_()
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
        """Replay the bucket's graph for this step's rows (recording it first if needed).

        Returns hidden [len(scheduled), hidden_size]: each request's hidden state at its
        last new token. For a pure decode it is a view of the graph's output that the next
        replay overwrites. The caller has checked `can_run`.
        """
        num_reqs = len(scheduled)
        num_rows = sum(s.num_new_tokens for s in scheduled)
        size = self.bucket_for(num_rows)
        assert size is not None and self.can_run(scheduled), "not a graph-sized step"
        if size not in self._graphs:
            self._capture(size)
        self._copied.synchronize()  # the previous step's copies are done with the staging
        stage_rows(scheduled, self.block_size, self._host_tokens.numpy(),
                   self._host_seq_lens.numpy(), self._host_block_tables.numpy(), size)
        self._tokens.copy_(self._host_tokens, non_blocking=True)
        self._seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self._block_tables[:size].copy_(self._host_block_tables[:size], non_blocking=True)
        self._copied.record()
        self._graphs[size].replay()
        self.num_replays += 1
        if num_rows == num_reqs:
            return self._outputs[size][:num_reqs]
        return self._outputs[size].index_select(0, self._tokens[3, :num_reqs])
