"""Builders shared by the TierManager tests: tiny layouts, chained block metas, blocks of
random bit patterns, tier configs (a real LMDB disk tier in a temp directory), and helpers
that write, evict and load blocks through a manager.
"""

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.config import TierConfig
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.tiers.record import BlockMeta, metas_for

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def held_before(call: Callable, release: threading.Event) -> tuple[Callable, threading.Event]:
    """`call` wrapped to set the returned event, then wait for `release`, before it runs (a
    disk call held open while the test looks at the manager)."""
    entered = threading.Event()

    def held(*args):
        entered.set()
        release.wait()
        return call(*args)

    return held, entered


def small_layout(dtype: torch.dtype = torch.float16) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


def chain(layout: KVLayout, name: str, num_blocks: int) -> list[BlockMeta]:
    """Metas of `num_blocks` chained blocks of a sequence named `name`."""
    root = namespace_hash(name, layout)
    offset = sum(map(ord, name))  # stable across processes, unlike hash()
    token_ids = [offset + i for i in range(num_blocks * layout.block_size)]
    return metas_for(root, hash_blocks(root, token_ids, layout.block_size), token_ids,
                     layout.block_size)


def random_blocks(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """[num_blocks, *block_shape] of random bit patterns."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * layout.bytes_per_block,), dtype=torch.uint8,
                        generator=generator)
    return raw.view(layout.dtype).view(num_blocks, *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def write(m: TierManager, metas: list[BlockMeta], data: torch.Tensor) -> list[KVCacheBlock]:
    """Compute blocks (copy `data` into fresh GPU blocks), cache them and free them."""
    blocks = m.allocate(len(metas))
    assert blocks is not None, "test setup: not enough free GPU blocks"
    for block, block_data in zip(blocks, data):
        m.kv_cache[block.block_id] = block_data
    m.cache_full_blocks(blocks, metas)
    m.submit_stores()  # as the engine does while the next step runs
    m.free(blocks)
    m.poll()
    return blocks


def evict_gpu(m: TierManager) -> None:
    """Reuse every GPU block once, so nothing stays cached on the GPU."""
    m.flush()
    blocks = m.allocate(m.pool.num_blocks)
    assert blocks is not None, "test setup: a GPU block is still held"
    m.free(blocks)
    assert m.stats().pool.num_cached == 0


def load(m: TierManager, metas: list[BlockMeta]) -> tuple[int, list[KVCacheBlock]]:
    blocks = m.allocate(len(metas))
    assert blocks is not None
    return m.complete_load(m.prepare_load(metas, blocks)), blocks


def check_idle(m: TierManager) -> None:
    """Pool and host invariants; nothing in flight, so no slot may be pinned or reserved."""
    m.pool.check_invariants()
    stats = m.stats()
    assert stats.num_jobs_in_flight == 0 and stats.num_loads_in_flight == 0
    if m.host is not None:
        m.host.check_invariants(idle=True)


def config(layout: KVLayout, tmp_path: Path | None, gpu: int, host: int, **kwargs) -> TierConfig:
    disk = {} if tmp_path is None else {"disk_path": tmp_path / "disk", "num_disk_blocks": 64}
    return TierConfig.from_slots(layout, gpu, host, **disk, **kwargs)


def small_manager(managers: list, tmp_path: Path | None, gpu: int, host: int,
                  **kwargs) -> TierManager:
    """A manager over `small_layout()` (`tmp_path` None: no disk tier), closed with
    `managers` at the test's end."""
    layout = small_layout()
    m = TierManager(layout, config(layout, tmp_path, gpu, host, **kwargs))
    managers.append(m)
    return m


def disk_only(tmp_path: Path, managers: list, layout: KVLayout, names: dict[str, int],
              **kwargs) -> tuple[TierManager, dict[str, tuple[list[BlockMeta], torch.Tensor]]]:
    """A manager with the host tier off (staging only) whose blocks are on disk only."""
    m = TierManager(layout, config(layout, tmp_path, gpu=8, host=0, **kwargs))
    managers.append(m)
    blocks = {}
    for seed, (name, num_blocks) in enumerate(names.items()):
        blocks[name] = (chain(layout, name, num_blocks), random_blocks(layout, num_blocks, seed))
        write(m, *blocks[name])
        m.flush()
    evict_gpu(m)
    return m, blocks
