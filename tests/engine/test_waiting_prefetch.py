"""Reading ahead for requests that wait for GPU room (`engine.prefetch`), through the engine:
behind a GPU pool that holds one request, the prefixes of those waiting are read from disk
into the host tier while the first one runs, and every request's greedy tokens equal those
of an engine with every tier off (float32). (That a load then takes such blocks from the
host: tests/kvtier/test_prefetch.py.) A random tiny Llama on the CPU, real LMDB files
in a temp dir."""

from __future__ import annotations

from pathlib import Path

from kvtier.engine import LLM, SamplingParams

from kvtier.stats import Tier

MODEL = "random:tiny-llama"
BS = 16


def engine(disk_dir: Path | None, **options: object) -> LLM:
    base: dict[str, object] = dict(model=MODEL, device="cpu", dtype="float32", block_size=BS,
                                   max_num_batched_tokens=128, restore_min_saving_s=0.0)
    if disk_dir is None:
        base.update(host_cache=False, disk_cache=False)
    else:
        base.update(disk_cache_dir=disk_dir, disk_cache_gb=0.25)
    base.update(options)
    return LLM(**base)


def prompt(seed: int, num_tokens: int) -> list[int]:
    # Token ids 3..255 (0..2 are special in the tiny config), a fixed pattern per seed.
    return [3 + (seed * 7919 + i * 104729) % 253 for i in range(num_tokens)]


def test_waiting_requests_prefixes_are_read_ahead_and_tokens_match(tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    documents = [prompt(seed, 320) for seed in range(5)]
    second = [d + prompt(100 + i, 24) for i, d in enumerate(documents)]
    with engine(None) as off:
        expected = [list(o.outputs[0].token_ids) for o in off.generate(second, params)]
    disk_dir = tmp_path / "kv"
    with engine(disk_dir) as first:  # every document's blocks reach the disk at close
        first.generate(documents, params)
    # A fresh engine: 40 GPU blocks hold one 344-token request (22 blocks) at a time, and
    # the 64-slot host tier starts empty, so the documents' blocks are on disk only.
    with engine(disk_dir, gpu_blocks=40, host_cache_gb=64 * 8192 / 2**30) as llm:
        # One restore first: it measures the disk's rate, which reading ahead needs.
        outputs = llm.generate(second[:1], params)
        assert outputs[0].metrics.cached_tokens_disk > 0
        assert llm.restore_counts().prefetched == 0  # nobody waited
        outputs += llm.generate(second[1:], params)
        # The four others waited behind the first: their prefixes were read ahead (at
        # most every block of theirs the GPU did not cache).
        assert 0 < llm.restore_counts().prefetched <= 4 * 320 // BS
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_requests_that_waited_before_the_disk_was_measured_are_read_ahead(tmp_path: Path
                                                                           ) -> None:
    """All five come at once to a fresh engine that runs one request at a time: nothing is
    read ahead while no restore has measured the disk, and the requests still waiting once
    the first one did are (their plans are not made, empty, before)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    documents = [prompt(seed, 320) for seed in range(5)]
    second = [d + prompt(100 + i, 24) for i, d in enumerate(documents)]
    with engine(None) as off:
        expected = [list(o.outputs[0].token_ids) for o in off.generate(second, params)]
    disk_dir = tmp_path / "kv"
    with engine(disk_dir) as first:
        first.generate(documents, params)
    with engine(disk_dir, gpu_blocks=40, host_cache_gb=64 * 8192 / 2**30,
                max_num_seqs=1) as llm:
        outputs = llm.generate(second, params)
        assert llm.scheduler.tier_rates.expected([Tier.DISK]) is not None
        assert llm.restore_counts().prefetched > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
