"""Prometheus metrics of `kvtier serve` (GET /metrics, text format).

Two sources: the server counts what it hands to clients (requests by endpoint and finish
reason, prompt / generated / cached tokens, preemptions, TTFT, time per output token, end
to end latency) as requests finish; the engine's own counters (per-tier hits and misses,
bytes moved per direction, pool / host / disk occupancy) are read from a `ManagerStats`
snapshot taken at each scrape: on the engine thread, except the disk and remote tiers'
figures, which read LMDB and are taken on a worker thread. Every metric lives in the
server's own registry, so two servers in one process never share counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.cli.server.engine_output import FinishedRequest
from kvtier.engine.restore_gate import RestoreCounts
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.stats import ManagerStats

#: Histogram buckets (seconds) for time to first token and end-to-end latency.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Histogram buckets (seconds) for the time per output token.
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What a scrape reads: tier counters and queue lengths (all from the engine thread but
    `stats.disk` and `stats.remote`)."""

    stats: ManagerStats
    num_running: int
    num_waiting: int
    #: How prefix lookups below the GPU went (`LLM.restore_counts`); None: not read.
    restores: RestoreCounts | None = None


class _EngineCollector(Collector):
    """Exposes the latest `EngineSnapshot` (set just before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        stats = snap.stats
        families = {
            "hits": CounterMetricFamily("kvtier_cache_hits", "Blocks found in a tier by "
                                        "lookups", labels=["tier"]),
            "misses": CounterMetricFamily("kvtier_cache_misses", "Blocks a lookup did not "
                                          "find in a tier", labels=["tier"]),
            "failures": CounterMetricFamily("kvtier_cache_failures", "Blocks whose transfer "
                                            "out of or into a tier failed", labels=["tier"]),
            "rejected": CounterMetricFamily("kvtier_cache_rejected", "Blocks a tier could "
                                            "not take", labels=["tier"]),
        }
        for tier, tier_stats in stats.tiers.items():
            for name, family in families.items():
                family.add_metric([tier.value], getattr(tier_stats, name))
        yield from families.values()
        moved = CounterMetricFamily("kvtier_transfer_bytes", "Bytes moved between tiers",
                                    labels=["direction"])
        jobs = CounterMetricFamily("kvtier_transfer_jobs", "Transfer jobs finished",
                                   labels=["direction"])
        for direction, transfer in stats.transfers.items():
            moved.add_metric([direction.value], transfer.num_bytes)
            jobs.add_metric([direction.value], transfer.num_jobs)
        yield moved
        yield jobs
        pool = stats.pool
        gpu = GaugeMetricFamily("kvtier_gpu_blocks", "GPU KV blocks by state",
                                labels=["state"])
        gpu.add_metric(["total"], pool.num_blocks)
        gpu.add_metric(["free"], pool.num_free)
        gpu.add_metric(["cached"], pool.num_cached)
        gpu.add_metric(["used"], pool.num_blocks - pool.num_free)
        yield gpu
        yield CounterMetricFamily("kvtier_gpu_evictions", "Cached GPU blocks reused for "
                                  "other data", value=pool.evictions)
        host = GaugeMetricFamily("kvtier_host_slots", "Host tier slots by state",
                                 labels=["state"])
        host.add_metric(["total"], stats.host_slots)
        host.add_metric(["free"], stats.host_free_slots)
        host.add_metric(["cached"], stats.host_cached)
        host.add_metric(["dirty"], stats.host_dirty)
        yield host
        if stats.disk is not None:
            yield GaugeMetricFamily("kvtier_disk_blocks", "Blocks stored in the disk tier",
                                    value=stats.disk.num_blocks)
            disk = GaugeMetricFamily("kvtier_disk_bytes", "Disk tier bytes",
                                     labels=["kind"])
            disk.add_metric(["used"], stats.disk.bytes_used)
            disk.add_metric(["budget"], stats.disk.budget_bytes)
            yield disk
        if stats.stores is not None:  # where the blocks offered to the disk went
            ledger = stats.stores
            yield CounterMetricFamily("kvtier_disk_offered_blocks", "Computed blocks offered "
                                      "to the disk tier", value=ledger.offered)
            yield CounterMetricFamily("kvtier_disk_written_blocks", "Offered blocks the disk "
                                      "tier holds", value=ledger.written)
            skipped = CounterMetricFamily("kvtier_disk_skipped_blocks", "Offered blocks not "
                                          "written, by reason", labels=["reason"])
            for reason, num in ledger.skipped.items():
                skipped.add_metric([reason], num)
            yield skipped
            yield GaugeMetricFamily("kvtier_disk_pending_blocks", "Offered blocks on their "
                                    "way to the disk tier", value=ledger.pending)
            yield GaugeMetricFamily("kvtier_disk_lost_blocks", "Offered blocks not accounted "
                                    "for (must stay 0)", value=ledger.lost)
        if snap.restores is not None:
            lookups = CounterMetricFamily(
                "kvtier_prefix_lookups", "Prefix lookups with blocks below the GPU, by "
                "outcome: a restore started, the hits given up for want of GPU blocks, "
                "waiting for GPU blocks, the disk and remote tiers not asked on the measured "
                "rates, or asked to measure them again", labels=["outcome"])
            for outcome, num in (("restore", snap.restores.started),
                                 ("no_gpu_blocks", snap.restores.no_room),
                                 ("waiting_for_gpu_blocks", snap.restores.room_waits),
                                 ("computed_on_rates", snap.restores.turned_away),
                                 ("probe", snap.restores.probes)):
                lookups.add_metric([outcome], num)
            yield lookups
            yield CounterMetricFamily("kvtier_prefetched_blocks", "Blocks read ahead into "
                                      "the host tier for requests waiting for GPU blocks",
                                      value=snap.restores.prefetched)
        yield GaugeMetricFamily("kvtier_loads_in_flight", "Restores not completed yet",
                                value=stats.num_loads_in_flight)
        yield GaugeMetricFamily("kvtier_requests_running", "Requests in the running batch",
                                value=snap.num_running)
        yield GaugeMetricFamily("kvtier_requests_waiting", "Requests queued or restoring",
                                value=snap.num_waiting)


class ServerMetrics:
    """The server's registry and the counters it updates."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("kvtier_requests", "Finished requests",
                                ["endpoint", "finish_reason"], registry=reg)
        self.errors = Counter("kvtier_request_errors", "Requests answered with an error",
                              ["status"], registry=reg)
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=reg)
        self.generation_tokens = Counter("kvtier_generation_tokens", "Tokens generated and "
                                         "sent to clients", registry=reg)
        self.cached_tokens = Counter("kvtier_prompt_tokens_cached", "Prompt tokens restored "
                                     "from a cache tier instead of computed", ["tier"],
                                     registry=reg)
        self.preemptions = Counter("kvtier_preemptions", "Preemptions of finished requests",
                                   registry=reg)
        self.ttft = Histogram("kvtier_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("kvtier_time_per_output_token_seconds", "Time per output "
                              "token after the first", buckets=_TPOT_BUCKETS, registry=reg)
        self.latency = Histogram("kvtier_e2e_request_latency_seconds", "Arrival to last "
                                 "token", buckets=_LATENCY_BUCKETS, registry=reg)
        self._engine = _EngineCollector()
        reg.register(self._engine)

    def observe_finished(self, endpoint: str, finished: FinishedRequest,
                         num_sent_tokens: int) -> None:
        """Count a finished request: `num_sent_tokens` output tokens reached the client."""
        self.requests.labels(endpoint, finished.finish_reason or "none").inc()
        self.prompt_tokens.inc(len(finished.prompt_token_ids))
        self.generation_tokens.inc(num_sent_tokens)
        for tier, count in (("gpu", finished.cached_tokens_gpu),
                            ("host", finished.cached_tokens_host),
                            ("disk", finished.cached_tokens_disk)):
            self.cached_tokens.labels(tier).inc(count)
        self.preemptions.inc(finished.num_preemptions)
        if finished.ttft_s is not None:
            self.ttft.observe(finished.ttft_s)
        if finished.tpot_s is not None:
            self.tpot.observe(finished.tpot_s)
        if finished.latency_s is not None:
            self.latency.observe(finished.latency_s)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        """The Prometheus text exposition, engine figures from `snapshot`."""
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)
