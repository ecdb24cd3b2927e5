"""Shared fixtures for the engine tests.

- `kvtier_cache_dir`: a private KVTIER_CACHE_DIR for the whole session (nothing is written
  to the real user cache), holding the run's one conversion of SmolLM2 (tests/model_cache.py).
- `smollm2`: SmolLM2-135M loaded once through the "smollm2-135m" alias (float32, CPU), from
  the conversion in `kvtier_cache_dir`.
- `paged_batch`: a factory for `PagedBatch`, which drives a model over a paged KV cache the
  way a model runner does (scrambled block tables, chunked prefill, decodes, several
  requests per step) with plain lists, so model tests do not depend on the engine core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from kvtier.engine.attention import AttentionMetadata
from kvtier.engine.config import ModelConfig
from kvtier.engine.loader import LoadedModel, load_model

from kvtier.device_cache import allocate_kv_cache
from tests.model_cache import seed_model_cache


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module (`pytestmark = usefixtures(...)`): small models
    are all overhead, and on a small shared machine two spinning threads per process make
    every step many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def kvtier_cache_dir(tmp_path_factory: pytest.TempPathFactory,
                     smollm2_conversion: Path) -> Iterator[Path]:
    path = seed_model_cache(tmp_path_factory.mktemp("kvtier-cache") / "cache", smollm2_conversion)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIER_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def smollm2(kvtier_cache_dir: Path) -> LoadedModel:
    return load_model("smollm2-135m", "cpu", "float32")


class PagedBatch:
    """Requests sharing one paged KV cache, stepped with explicit chunks.

    Each request owns a block table drawn from a seeded permutation of the cache's blocks,
    so consecutive tokens land in scattered, non-monotonic blocks. The cache starts as
    `poison` (NaN): reading a slot that was never written poisons the logits.
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_reqs: int,
                 max_len: int, block_size: int = 16, seed: int = 0,
                 device: torch.device | str = "cpu", poison: float = float("nan")) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        blocks_per_req = -(-max_len // block_size)
        num_blocks = num_reqs * blocks_per_req + 3  # a few never-used blocks
        dtype = next(model.parameters()).dtype
        self.kv_cache = allocate_kv_cache(config.kv_layout(block_size, dtype), num_blocks,
                                          self.device)
        self.kv_cache.fill_(poison)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = order[:num_reqs * blocks_per_req].view(num_reqs, blocks_per_req)
        self.num_computed = [0] * num_reqs

    def step(self, chunks: Sequence[Sequence[int] | None]) -> list[torch.Tensor | None]:
        """Feed `chunks[r]` (token ids, or None to sit out) as request r's next tokens.

        Returns per request the float32 logits [len(chunk), vocab] of its new tokens.
        """
        active = [r for r, chunk in enumerate(chunks) if chunk]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for r in active:
            start = self.num_computed[r]
            for offset, token_id in enumerate(chunks[r]):
                pos = start + offset
                block_id = int(self.block_tables[r, pos // self.block_size])
                input_ids.append(token_id)
                positions.append(pos)
                slots.append(block_id * self.block_size + pos % self.block_size)
            self.num_computed[r] = start + len(chunks[r])
            query_start_loc.append(len(input_ids))
            seq_lens.append(self.num_computed[r])

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        metadata = AttentionMetadata(
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=self.block_tables[active].to(device=self.device, dtype=torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            max_query_len=max(len(chunks[r]) for r in active),
            max_seq_len=max(seq_lens))
        hidden = self.model(tensor(input_ids, torch.int64), tensor(positions, torch.int64),
                            self.kv_cache, metadata)  # [num_tokens, hidden_size]
        logits = self.model.compute_logits(hidden)  # [num_tokens, vocab]
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for i, r in enumerate(active):
            out[r] = logits[query_start_loc[i]:query_start_loc[i + 1]]
        return out


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return PagedBatch


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A disk tier's directory, not created yet."""
    return tmp_path / "kv"
