"""Reading ahead for requests that wait for GPU room (`engine.prefetch`), through the engine:
behind a GPU pool that holds one request, the prefixes of those waiting are read from disk
into the host tier while the first one runs, and every request's greedy tokens equal those
of an engine with every tier off (float32). (That a load then takes such blocks from the
host: tests/kvtier/test_prefetch.py.) A random tiny Llama on the CPU, real LMDB files
in a temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.engine import SamplingParams
from tiny_engine_cases import engine, prompt

from kvtier.stats import Tier

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A disk tier holding five 320-token documents; each one's second prompt (the
    document and a question), and the greedy tokens of an engine with every tier off."""
    documents = [prompt(seed, 320) for seed in range(5)]
    second = [d + prompt(100 + i, 24) for i, d in enumerate(documents)]
    with engine(None) as off:
        expected = [list(o.outputs[0].token_ids) for o in off.generate(second, PARAMS)]
    disk_dir = tmp_path / "kv"
    with engine(disk_dir) as first:  # every document's blocks reach the disk at close
        first.generate(documents, PARAMS)
    return disk_dir, second, expected


def test_waiting_requests_prefixes_are_read_ahead_and_tokens_match(written) -> None:
    disk_dir, second, expected = written
    # A fresh engine: 40 GPU blocks hold one 344-token request (22 blocks) at a time, and
    # the 64-slot host tier starts empty, so the documents' blocks are on disk only.
    with engine(disk_dir, gpu_blocks=40, host_cache_gb=64 * 8192 / 2**30) as llm:
        # One restore first: it measures the disk's rate, which reading ahead needs.
        outputs = llm.generate(second[:1], PARAMS)
        assert outputs[0].metrics.cached_tokens_disk > 0
        assert llm.restore_counts().prefetched == 0  # nobody waited
        outputs += llm.generate(second[1:], PARAMS)
        # The four others waited behind the first: their prefixes were read ahead (a
        # request preempted back to waiting is planned again, so no bound per request).
        assert llm.restore_counts().prefetched > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_requests_that_waited_before_the_disk_was_measured_are_read_ahead(written) -> None:
    """All five come at once to a fresh engine that runs one request at a time: nothing is
    read ahead while no restore has measured the disk, and the requests still waiting once
    the first one did are (their plans are not made, empty, before)."""
    disk_dir, second, expected = written
    with engine(disk_dir, gpu_blocks=40, host_cache_gb=64 * 8192 / 2**30,
                max_num_seqs=1) as llm:
        outputs = llm.generate(second, PARAMS)
        assert llm.scheduler.tier_rates.expected([Tier.DISK]) is not None
        assert llm.restore_counts().prefetched > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
