"""The disk tier behind a host tier smaller than the work: what the GPU computed reaches the
disk or is counted skipped with its reason, closing writes what is pending so that a fresh
engine finds every finished request's blocks, and a stored tail is used behind a head that
was never written (gaps computed), with float32 tokens equal to tiers off; a prompt
computed though the disk holds its blocks is not copied down again. The disk tier runs in
the engine's process and, where marked, in a worker process of its own.

A random tiny Llama in float32 on the CPU, real LMDB files in tmp dirs.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.flush_progress import FlushProgressLine
from tiny_engine_cases import BS, engine, prompt

from kvtier.hashing import BlockHash, hash_blocks, namespace_hash
from kvtier.manager import FlushReport
from kvtier.stats import Direction, Tier

MAX_TOKENS = 6


def block_hashes(llm: LLM, token_ids: list[int]) -> list[BlockHash]:
    namespace = namespace_hash(llm.model_fingerprint, llm.layout, llm.config.hash_algorithm,
                               None)
    return hash_blocks(namespace, token_ids, BS, llm.config.hash_algorithm)


def greedy(num_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def references() -> dict[int, list[int]]:
    """Greedy tokens with every tier off, per prompt seed (320-token prompts)."""
    with engine(None) as llm:
        outputs = llm.generate([prompt(seed, 320) for seed in range(4)], greedy())
    return {seed: list(o.outputs[0].token_ids) for seed, o in enumerate(outputs)}


#: The disk tier in the engine's process, and in a worker process of its own.
DISK_WORKER = pytest.mark.parametrize("disk_worker", [False, True],
                                      ids=["in_process", "worker"])


@DISK_WORKER
def test_close_writes_every_finished_block_and_a_fresh_engine_finds_them(
        tmp_path: Path, disk_worker: bool) -> None:
    disk_dir = tmp_path / "kv"
    prompts = [prompt(seed, 200 + 16 * seed) for seed in range(8)]
    # 4 host slots and a GPU pool that holds about two requests: most blocks find no host
    # slot when computed and wait, deferred, on the GPU (or are reused by it, counted).
    llm = engine(disk_dir, gpu_blocks=40, host_cache_gb=4 * 8192 / 2**30, max_num_seqs=2,
                 disk_worker=disk_worker)
    assert llm.manager.uses_disk_worker is disk_worker
    assert llm.layout.bytes_per_block == 8192
    outputs = llm.generate(prompts, greedy())
    before = llm.stats().stores
    assert before.offered > 0 and before.lost == 0
    report = llm.close()
    assert isinstance(report, FlushReport) and report.num_unwritten == 0
    after = llm.manager.stats(lower_tiers=False).stores
    # Every offered block is accounted for, and none is pending any more.
    assert after.pending == 0 and after.lost == 0
    assert after.written + after.duplicate + after.num_skipped == after.offered
    assert after.skipped["flush_timeout"] == 0 and after.skipped["failed"] == 0

    # A fresh engine finds every finished block on disk but those counted skipped.
    num_full_blocks = num_on_disk = 0
    with engine(disk_dir, host_cache_gb=4 * 8192 / 2**30, disk_worker=disk_worker) as fresh:
        for output in outputs:
            tokens = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
            num_full = (len(tokens) - 1) // BS  # the last sampled token has no KV
            hit = fresh.manager.lookup(block_hashes(fresh, tokens[:num_full * BS]), gaps=True)
            num_full_blocks += num_full
            num_on_disk += hit.locations.count(Tier.DISK)
    assert after.offered == num_full_blocks  # distinct prompts: no duplicates
    assert num_on_disk == after.written == num_full_blocks - after.skipped["gpu_reused"]


def test_no_block_is_skipped_when_the_gpu_waits_for_the_disk(tmp_path: Path) -> None:
    """A GPU pool larger than the work: nothing is reused before its write, so every
    finished block reaches the disk even through a 2-slot host tier."""
    disk_dir = tmp_path / "kv"
    prompts = [prompt(seed, 160 + 16 * seed) for seed in range(6)]
    llm = engine(disk_dir, gpu_blocks=256, host_cache_gb=2 * 8192 / 2**30)
    outputs = llm.generate(prompts, greedy())
    out = io.StringIO()
    progress = FlushProgressLine(60.0, out)
    report = llm.manager.close(60.0, progress)
    progress.done(report)
    stores = llm.manager.stats(lower_tiers=False).stores
    assert report.num_unwritten == 0 and stores.num_skipped == 0 and stores.lost == 0
    assert stores.written + stores.duplicate == stores.offered > 0
    with engine(disk_dir) as fresh:
        for output in outputs:
            tokens = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
            num_full = (len(tokens) - 1) // BS
            hit = fresh.manager.lookup(block_hashes(fresh, tokens[:num_full * BS]))
            assert hit.locations == [Tier.DISK] * num_full


def test_a_prompt_computed_over_stored_blocks_is_not_copied_down_again(
        tmp_path: Path, references: dict[int, list[int]]) -> None:
    """A fresh engine computes a prompt the disk holds (reading it would not be faster):
    its blocks are not copied to the host, made dirty and written back as duplicates; the
    ledger counts them written, and new blocks after them are stored as before."""
    disk_dir = tmp_path / "kv"
    with engine(disk_dir) as llm:
        llm.generate([prompt(0, 320)], greedy())
    # The model is fast beyond any disk: every prefix is computed, none read.
    with engine(disk_dir, restore_min_saving_s=1e3) as fresh:
        fresh.scheduler.prefill_rate.observe(10_000, 1e-3)
        longer = prompt(0, 320) + prompt(9, 48)  # 3 full blocks past the stored ones
        outputs = fresh.generate([prompt(0, 320), longer], greedy())
        fresh.manager.drain()
        assert list(outputs[0].outputs[0].token_ids) == references[0]
        assert outputs[0].metrics.cached_tokens_disk == 0  # computed, not read
        stores = fresh.manager.stats(lower_tiers=False).stores
        copied = fresh.manager.stats(lower_tiers=False).transfers[Direction.GPU_TO_HOST]
    # The first engine wrote every full block of its request (its answer's last token has
    # no KV); the longer prompt shares them and fills 3 more, with its answer.
    stored = (320 + MAX_TOKENS - 1) // BS
    new = (len(longer) + MAX_TOKENS - 1) // BS - stored
    assert stores.lost == 0 and stores.num_skipped == 0
    assert stores.offered == stored + new and stores.written == stores.offered
    assert copied.num_bytes == new * 8192  # only the blocks the disk lacked went down


# Which of a 320-token prompt's 19 lookup blocks (the last token is always computed) the
# disk holds for the fresh engine: the rest are deleted before it runs.
PLACEMENTS = {
    "tail_only": lambda n: range(n // 2, n),
    "gaps_in_head": lambda n: [i for i in range(n) if i >= n // 2 or i % 3 == 1],
    "partial_tail": lambda n: [i for i in range(n // 2, n) if i % 4 != 0],
    "last_block_only": lambda n: [n - 1],
}


@pytest.mark.parametrize(("placement", "disk_worker"),
                         [(placement, False) for placement in PLACEMENTS]
                         + [("gaps_in_head", True)])
def test_a_stored_tail_is_restored_behind_a_computed_head(placement: str, disk_worker: bool,
                                                          tmp_path: Path,
                                                          references: dict[int, list[int]]
                                                          ) -> None:
    disk_dir = tmp_path / "kv"
    seed = 1
    tokens = prompt(seed, 320)
    with engine(disk_dir, host_cache=False, disk_worker=disk_worker) as writer:
        first = writer.generate([tokens], greedy())[0]
    assert list(first.outputs[0].token_ids) == references[seed]

    with engine(disk_dir, host_cache=False, disk_worker=disk_worker) as fresh:
        hashes = block_hashes(fresh, tokens)[:(len(tokens) - 1) // BS]
        kept = set(PLACEMENTS[placement](len(hashes)))
        assert fresh.manager.disk.contains(hashes) == [True] * len(hashes)
        fresh.manager.disk.delete([h for i, h in enumerate(hashes) if i not in kept])
        output = fresh.generate([tokens], greedy())[0]
    assert list(output.outputs[0].token_ids) == references[seed]
    # The tail came from disk although blocks before it were missing.
    assert output.metrics.cached_tokens_disk > 0
    assert output.metrics.cached_tokens_disk <= len(kept) * BS


def test_flush_progress_speaks_only_for_a_long_flush_and_reports_what_is_left() -> None:
    out = io.StringIO()
    progress = FlushProgressLine(60.0, out)
    progress(0, 12)  # at once: nothing said
    progress.done(FlushReport(12, 0, 0.01))
    assert out.getvalue() == ""
    progress = FlushProgressLine(60.0, out, every_s=0.0)  # a flush that takes its time
    progress(3, 9)
    progress.done(FlushReport(3, 9, 60.0))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "9 KV blocks" in lines[0] and "3 written" in lines[0]
    assert "9 KV blocks not written" in lines[1] and "flush_timeout_s" in lines[1]


@DISK_WORKER
def test_a_sharded_disk_serves_a_restart_with_the_tokens_of_tiers_off(
        tmp_path: Path, references: dict[int, list[int]], disk_worker: bool) -> None:
    """Blocks written over four LMDB environments by one engine restore in a fresh engine
    that asks for one (a directory keeps the count it was written with), with float32
    tokens equal to tiers off."""
    disk_dir = tmp_path / "kv"
    prompts = [prompt(seed, 320) for seed in range(4)]
    with engine(disk_dir, disk_shards=4, disk_worker=disk_worker) as llm:
        assert llm.config.disk_shards == 4
        llm.generate(prompts, greedy())
    assert sorted(p.name for p in disk_dir.iterdir()) == [f"shard-{i}-of-4" for i in range(4)]
    with engine(disk_dir, disk_shards=1, host_cache=False, disk_worker=disk_worker) as fresh:
        outputs = fresh.generate(prompts, greedy())
        stats = fresh.stats()
        assert [list(o.outputs[0].token_ids) for o in outputs] == \
            [references[seed] for seed in range(4)]
        assert stats.disk is not None and stats.disk.hits >= 4 * (320 // BS) - 4
        assert stats.disk.num_blocks >= 4 * (320 // BS)
