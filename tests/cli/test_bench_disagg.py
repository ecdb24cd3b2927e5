"""`kvtier bench disagg` run tiny on the CPU (random:tiny-llama, a few requests): the
report's shape, its SLO arithmetic, and its one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from kvtier.cli.bench.disagg import DisaggConfig, make_workload
from kvtier.cli.bench.disagg_report import Record, handoff_report
from kvtier.cli.bench.link import measure_mooncake, measure_peer_copy
from kvtier.cli.main import app
from typer.testing import CliRunner

TINY = ["bench", "disagg", "--model", "random:tiny-llama", "--dtype", "float32",
        "--num-requests", "4", "--long-tokens", "96", "--short-tokens", "20",
        "--long-fraction", "0.5", "--max-tokens", "3", "--link-bytes", "1048576"]


@pytest.mark.slow
def test_report_shape_of_both_modes(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Rate 0: one request at a time (no arrival rate, no goodput), then a Poisson rate.
    logs = tmp_path / "logs"
    result = CliRunner().invoke(app, [*TINY, "--rates", "0,50", "--ttft-slo", "1000",
                                      "--tpot-slo", "1000", "--logs-dir", str(logs),
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["bench"] == "disagg"
    assert report["devices"] == {"prefill": "cpu", "decode": "cpu",
                                 "colocated": ["cpu", "cpu"]}
    assert report["modes"]["colocated"]["instances"] == ["both on cpu", "both on cpu"]
    assert report["modes"]["disaggregated"]["instances"] == ["prefill on cpu",
                                                             "decode on cpu"]
    for mode in report["modes"].values():
        assert [run["rate_rps"] for run in mode["rates"]] == [0.0, 50.0]
        for run in mode["rates"]:
            assert run["num_requests"] == 4 and run["ttft_s"]["n"] == 4
            assert run["tpot_s"]["p99"] >= run["tpot_s"]["p50"] > 0
            assert run["slo_met"] and run["within_slo"] == 4  # SLOs nothing misses
        assert mode["goodput_rps"] == 50.0
    assert report["goodput_ratio"] == 1.0 and len(report["ttft_p50_ratio"]) == 2
    handoff = report["modes"]["disaggregated"]["handoff"]
    assert handoff["num_handoffs"] == 8 and handoff["num_fallbacks"] == 0
    assert handoff["fallback_reasons"] == {}
    # The pair formed once and never again (no break during the run).
    assert handoff["pair_generation"] == {"prefill": [0], "decode": [0]}
    assert handoff["bytes"] > 0 and handoff["gb_s"] > 0 and handoff["of_link"] > 0
    assert handoff["transports"] == ["nccl"]  # the torch.distributed pair (gloo here)
    # Where the transfer's seconds went: each handoff read and committed at least a group.
    assert {"read", "slot", "commit", "receive", "place"} <= set(handoff["phases_s"])
    # gloo cannot time a send's bytes on the link: no such figure rather than a wrong one.
    assert handoff["wire_s"] is None and handoff["wire_gb_s"] is None
    assert handoff["wire_of_link"] is None
    assert handoff["groups"] >= handoff["num_handoffs"]
    link = report["link"]
    assert link["backend"] == "gloo" and link["bytes"] == 1048576 and link["gb_s"] > 0
    # float32 on the CPU: the same tokens whichever instance computed the prompt.
    assert report["outputs_equal"] == {"equal": 8, "total": 8}
    # Every process's log is kept where asked, after the processes stopped.
    assert sorted(p.name for p in logs.iterdir()) == [
        "both0.log", "both1.log", "decode.log", "prefill.log", "router-colocated.log",
        "router-disaggregated.log"]


def test_handoff_report_times_the_bytes_on_the_link_where_they_were_timed() -> None:
    def record(handoff: dict) -> Record:
        return Record(True, 0.1, 0.01, [1], handoff, 0.2)

    records = [record({"bytes": 4 * 10**9, "transfer_s": 0.4, "wire_s": 0.02}),
               record({"bytes": 2 * 10**9, "transfer_s": 0.1, "wire_s": 0.01}),
               record({"bytes": 10**9, "transfer_s": 0.5, "wire_s": None}),  # not timed
               record({"fallback": "no transport"})]
    report = handoff_report(records, {"gb_s": 400.0})
    assert report["num_handoffs"] == 3 and report["num_fallbacks"] == 1
    assert report["gb_s"] == pytest.approx(7.0)  # 7 GB over 1 s of transfer
    # Only the timed handoffs: 6 GB over 0.03 s on the link.
    assert report["wire_s"] == pytest.approx(0.03)
    assert report["wire_gb_s"] == pytest.approx(200.0)
    assert report["wire_of_link"] == pytest.approx(0.5)


def test_poisson_workload_is_seeded_and_mixed() -> None:
    config = DisaggConfig(num_requests=200, long_tokens=40, short_tokens=8,
                          long_fraction=0.25, seed=3)
    requests = make_workload(config, 100, rate=10.0, seed_offset=0)
    assert requests == make_workload(config, 100, rate=10.0, seed_offset=0)
    assert requests != make_workload(config, 100, rate=10.0, seed_offset=1)
    assert requests[0].arrival_s == 0.0
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:])]
    assert min(gaps) >= 0 and 0.07 < sum(gaps) / len(gaps) < 0.13  # mean gap 1/rate
    num_long = sum(r.long for r in requests)
    assert 30 <= num_long <= 70
    assert {len(r.prompt) for r in requests} == {40, 8}


@pytest.mark.parametrize("args, message", [
    (["--rates", "-1"], "--rates takes requests/s (0: one request at a time)"),
    (["--modes", "split"], "--modes takes colocated and/or disaggregated"),
    (["--long-fraction", "2"], "--long-fraction must lie in [0, 1]"),
    (["--prefill-url", "http://127.0.0.1:1"], "--prefill-url and --decode-url go together"),
    (["--prefill-queue-limit", "0"], "--prefill-queue-limit must be at least 1"),
])
def test_bad_options_are_one_line_errors(args, message) -> None:
    result = CliRunner().invoke(app, [*TINY, *args])
    assert result.exit_code == 1 and message in result.output, result.output


def test_mooncake_ceiling_writes_between_two_processes() -> None:
    from kvtier.handoff.mooncake import mooncake_available

    if mooncake_available() is not None:
        pytest.skip(mooncake_available())
    link = measure_mooncake(4 * 2**20, repeats=2)
    assert link["backend"] == "mooncake" and link["bytes"] == 4 * 2**20
    assert link["seconds"] > 0 and link["gb_s"] > 0



def test_the_copy_engine_ceiling_needs_two_gpus() -> None:
    with pytest.raises(ValueError, match="needs two CUDA devices"):
        measure_peer_copy("cpu", "cpu", 2**20)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_copy_engine_ceiling_copies_between_two_gpus() -> None:
    link = measure_peer_copy("cuda:0", "cuda:1", 4 * 2**20, repeats=2)
    assert link["backend"] == "copy engine" and link["bytes"] == 4 * 2**20
    assert link["seconds"] > 0 and link["gb_s"] > 0
