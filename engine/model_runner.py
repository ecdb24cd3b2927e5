"""The model runner: turns one step's plan into tensors, runs the model, samples.

Input preparation builds plain numpy arrays on the CPU (token ids, positions, slot_mapping,
block_tables, query_start_loc, seq_lens), then makes one tensor per field and copies it to
the device once (from pinned memory, non-blocking, on CUDA). The attention metadata is
passed to the model's forward as an argument. Logits are computed only for the last token
of each request that samples in this step (a prefill chunk that stops short of the end of
the prompt does not sample).

With `enable_cuda_graphs`, small steps (decodes, and short chunks whose rows read few keys)
replay a recorded graph instead (`engine.cuda_graphs`); longer prefill steps stay eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvtier.engine.attention import GRAPH_BACKENDS, AttentionMetadata, steps_through_cudnn
from kvtier.engine.cuda_graphs import DecodeGraphs
from kvtier.engine.restore_rates import prefill_keys
from kvtier.engine.step_plan import ScheduledRequest
from kvtier.engine.step_timer import StepTimer
from kvtier.kernels import store_to_host


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """Device tensors of one step."""

    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor   # [num_sampling_reqs] int64, rows of the hidden states
    sampling_rows: tuple[int, ...]  # index into the scheduled list of each logits row


class ModelRunner:
    """Runs `model` over the paged `kv_cache` for the requests a scheduler planned.

    `model` has `forward(input_ids, positions, kv_cache, attn_metadata) -> hidden
    [num_tokens, hidden_size]` and `compute_logits(hidden [n, hidden_size]) -> [n, vocab]`.
    `sample_fn(logits [n, vocab] float32, requests) -> [n]` token ids picks the next tokens.
    zero_started_blocks: zero each block before a step first writes it (see
    `_zero_started_blocks`); None: when the model's prefill steps run cuDNN
    (`steps_through_cudnn`: its backend is "cudnn" and this runner's mode is not the
    deterministic one).
    deterministic: run the model's batch-invariant kernels (`set_deterministic`); the mode
    is set again before every step, so engines of either mode can share one model.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 sample_fn, zero_started_blocks: bool | None = None,
                 deterministic: bool = False) -> None:
        self.model = model
        self.deterministic = deterministic
        self._apply_mode()
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.device = kv_cache.device
        self.sample_fn = sample_fn
        self._pin = self.device.type == "cuda"
        #: Times the prefill steps (what `Scheduler.prefill_rate` learns from).
        self.step_timer = StepTimer(self.device)
        self.graphs: DecodeGraphs | None = None
        if zero_started_blocks is None:
            zero_started_blocks = steps_through_cudnn(model)
        self._zero_started = zero_started_blocks
        #: Pinned buffer the sampled ids are stored into, and the event that says they are.
        self._host_ids: torch.Tensor | None = None
        self._ids_stored = torch.cuda.Event() if self.device.type == "cuda" else None

    def _apply_mode(self) -> None:
        if getattr(self.model, "deterministic", False) != self.deterministic:
            self.model.set_deterministic(self.deterministic)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> DecodeGraphs:
        """Record decode graphs for up to `max_num_seqs` rows and sequences up to
        `max_model_len` tokens; later small steps replay them. Needs the cache on
        CUDA and a capture-safe attention backend (triton, or cudnn whose decodes run the
        Triton kernel). Raises ValueError otherwise."""
        backend = getattr(self.model, "attn_backend", None)
        if backend not in GRAPH_BACKENDS:
            raise ValueError(f"CUDA graphs need the triton or cudnn attention backend, got "
                             f"{backend!r}")
        graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, max_num_seqs,
                              max_model_len)
        graphs.capture_all()
        self.graphs = graphs
        return graphs

    def _zero_started_blocks(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Zero the blocks this step starts writing (those whose first position it
        computes), before any layer stores into them. The cudnn backend reads a request's
        last block whole and masks the slots past its length, which must therefore hold
        finite values; a block's slots otherwise keep what an earlier owner left."""
        bs = self.block_size
        started = []
        for s in scheduled:
            table = s.request.block_table
            first, end = -(-s.start // bs), -(-(s.start + s.num_new_tokens) // bs)
            started.extend(table[k].block_id for k in range(first, end))
        if started:
            ids = self._to_device(np.asarray(started, dtype=np.int64))  # [num_started]
            self.kv_cache.index_fill_(0, ids, 0)

    def prepare_inputs(self, scheduled: Sequence[ScheduledRequest]) -> ModelInputs:
        """The step's tensors, built on the CPU and copied once per field."""
        assert scheduled, "nothing scheduled"
        bs = self.block_size
        num_reqs = len(scheduled)
        query_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int32)
        seq_lens = np.array([s.start + s.num_new_tokens for s in scheduled], dtype=np.int32)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        max_blocks = max(-(-int(n) // bs) for n in seq_lens)

        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        logits_indices: list[int] = []
        sampling_rows: list[int] = []
        for row, planned in enumerate(scheduled):
            lo, hi = int(query_start_loc[row]), int(query_start_loc[row + 1])
            block_ids, chunk_positions, slots = planned.placement(bs)
            block_tables[row, :len(block_ids)] = block_ids
            input_ids[lo:hi] = planned.request.token_ids[planned.start:planned.start + hi - lo]
            positions[lo:hi] = chunk_positions
            slot_mapping[lo:hi] = slots
            if planned.samples:
                logits_indices.append(hi - 1)
                sampling_rows.append(row)

        metadata = AttentionMetadata(
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens),
            block_tables=self._to_device(block_tables),
            slot_mapping=self._to_device(slot_mapping),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return ModelInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            attn_metadata=metadata,
            logits_indices=self._to_device(np.asarray(logits_indices, dtype=np.int64)),
            sampling_rows=tuple(sampling_rows),
        )

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest],
                while_waiting: Callable[[], None] | None = None,
                while_blocked: Callable[[], None] | None = None) -> list[int | None]:
        """Run one step; return the sampled token per scheduled request (None: no sample).

        while_waiting: host work to do once the step is queued on the GPU, before waiting
        for its sampled ids; it runs once per call, also when the step samples nothing.
        while_blocked: host work done in turns, again and again, while the GPU computes
        the sampled ids (on CUDA; each turn should be short: the ids are read once one
        ends after they are ready)."""
        self._apply_mode()
        if self._zero_started:
            self._zero_started_blocks(scheduled)
        if self.graphs is not None and self.graphs.can_run(scheduled):
            last = self.graphs.run(scheduled)  # [num_reqs, hidden_size]
            sampling_rows = tuple(row for row, s in enumerate(scheduled) if s.samples)
            if len(sampling_rows) < len(scheduled):
                last = last[list(sampling_rows)]
            return self._sample(scheduled, last, sampling_rows, while_waiting, while_blocked)
        inputs = self.prepare_inputs(scheduled)
        prefill = [s for s in scheduled if s.num_new_tokens > 1]
        self.step_timer.begin(sum(s.num_new_tokens for s in prefill),
                              sum(prefill_keys(s.num_new_tokens, s.start) for s in prefill))
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache,
                                    inputs.attn_metadata)  # [num_tokens, hidden_size]
        self.step_timer.end()
        if not inputs.sampling_rows:
            if while_waiting is not None:
                while_waiting()
            return [None] * len(scheduled)
        return self._sample(scheduled, hidden[inputs.logits_indices], inputs.sampling_rows,
                            while_waiting, while_blocked)

    def _sample(self, scheduled: Sequence[ScheduledRequest], hidden: torch.Tensor,
                sampling_rows: Sequence[int],
                while_waiting: Callable[[], None] | None = None,
                while_blocked: Callable[[], None] | None = None) -> list[int | None]:
        """Sample one token per row of hidden [len(sampling_rows), hidden_size], the state
        at the last token of each scheduled request in `sampling_rows`."""
        sampled: list[int | None] = [None] * len(scheduled)
        if not sampling_rows:
            if while_waiting is not None:
                while_waiting()
            return sampled
        logits = self.model.compute_logits(hidden)  # [n, vocab]
        requests = [scheduled[row].request for row in sampling_rows]
        token_ids = self.sample_fn(logits, requests)  # [n]
        for row, token_id in zip(sampling_rows,
                                 self._read_back(token_ids, while_waiting, while_blocked)):
            sampled[row] = int(token_id)
        return sampled

    def _read_back(self, token_ids: torch.Tensor,
                   while_waiting: Callable[[], None] | None = None,
                   while_blocked: Callable[[], None] | None = None) -> list[int]:
        """The sampled ids [n] as Python ints, `while_waiting` run first (on CUDA, while the
        GPU computes them), then `while_blocked` until they are ready. On CUDA the SMs store
        them into pinned memory
        (`kernels.store_to_host`): a copy-engine read-back queues behind the write-through
        of the blocks the previous step filled (docs/KERNELS.md, "store_to_host")."""
        if token_ids.device.type != "cuda":
            if while_waiting is not None:
                while_waiting()
            return token_ids.tolist()
        num = token_ids.shape[0]
        if self._host_ids is None or self._host_ids.shape[0] < num \
                or self._host_ids.dtype != token_ids.dtype:
            self._host_ids = torch.empty(max(num, 256), dtype=token_ids.dtype,
                                         pin_memory=True)
        store_to_host(token_ids.contiguous(), self._host_ids)
        self._ids_stored.record()
        if while_waiting is not None:
            while_waiting()
        if while_blocked is not None:
            while not self._ids_stored.query():
                while_blocked()
        self._ids_stored.synchronize()
        return self._host_ids[:num].tolist()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        if self._pin:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)
