"""`/metrics` says where the blocks offered to the disk tier went, how prefix lookups went and
how many blocks were read ahead for waiting requests (a real engine's stats rendered by the
server's registry)."""

from __future__ import annotations

from pathlib import Path

from kvtier.cli.server.metrics import EngineSnapshot, ServerMetrics
from kvtier.engine import LLM, SamplingParams


def test_metrics_expose_the_disk_ledger(tmp_path: Path) -> None:
    with LLM(model="random:tiny-llama", device="cpu", dtype="float32", gpu_blocks=40,
             host_cache_gb=4 * 8192 / 2**30, disk_cache_dir=tmp_path / "kv",
             disk_cache_gb=0.05) as llm:
        llm.generate([[3 + i % 200 for i in range(150)]],
                     SamplingParams(max_tokens=4, ignore_eos=True))
        llm.manager.flush()
        stats = llm.stats()
        text = ServerMetrics().render(EngineSnapshot(stats, 0, 0,
                                                     llm.restore_counts())).decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines()
                 if line and not line.startswith("#"))
    offered = stats.stores.offered
    assert offered == (150 + 4 - 1) // 16 > 0
    assert float(lines["kvtier_disk_offered_blocks_total"]) == offered
    assert float(lines["kvtier_disk_written_blocks_total"]) == stats.stores.written == offered
    assert float(lines['kvtier_disk_skipped_blocks_total{reason="gpu_reused"}']) == 0
    assert float(lines["kvtier_disk_lost_blocks"]) == 0
    assert float(lines["kvtier_disk_pending_blocks"]) == 0


def test_metrics_count_prefix_lookups_by_outcome(tmp_path: Path) -> None:
    first = [3 + i % 200 for i in range(150)]
    others = [[3 + (i * 7 + k) % 250 for i in range(300)] for k in (1, 2)]
    with LLM(model="random:tiny-llama", device="cpu", dtype="float32", gpu_blocks=40,
             host_cache_gb=4 * 8192 / 2**30, disk_cache_dir=tmp_path / "kv",
             disk_cache_gb=0.05, restore_min_saving_s=0.0) as llm:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        for prompt in [first, *others, first]:  # the others push `first` off the GPU
            llm.generate([prompt], params)
        counts = llm.restore_counts()
        text = ServerMetrics().render(EngineSnapshot(llm.stats(), 0, 0, counts)).decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines()
                 if line and not line.startswith("#"))
    assert counts.started >= 1  # `first` came back from the host or the disk
    for outcome, num in (("restore", counts.started), ("no_gpu_blocks", counts.no_room),
                         ("computed_on_rates", counts.turned_away), ("probe", counts.probes)):
        assert float(lines[f'kvtier_prefix_lookups_total{{outcome="{outcome}"}}']) == num


def test_metrics_count_the_blocks_read_ahead_for_waiting_requests(tmp_path: Path) -> None:
    documents = [[3 + (seed * 7919 + i * 104729) % 253 for i in range(320)]
                 for seed in range(4)]
    options = dict(model="random:tiny-llama", device="cpu", dtype="float32",
                   disk_cache_dir=tmp_path / "kv", disk_cache_gb=0.05, restore_min_saving_s=0.0)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(**options) as first:  # the documents' blocks reach the disk at close
        first.generate(documents, params)
    # One request at a time: the others wait while the first restores, and are read ahead.
    with LLM(**options, gpu_blocks=40, host_cache_gb=64 * 8192 / 2**30, max_num_seqs=1) as llm:
        llm.generate([d + [7] * 24 for d in documents], params)
        counts = llm.restore_counts()
        text = ServerMetrics().render(EngineSnapshot(llm.stats(), 0, 0, counts)).decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines()
                 if line and not line.startswith("#"))
    assert counts.prefetched > 0
    assert float(lines["kvtier_prefetched_blocks_total"]) == counts.prefetched
