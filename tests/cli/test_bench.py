"""`kvtier bench longctx` and `kvtier bench serve` on a tiny random model, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvtier.cli.main import app
from kvtier.kernels.cudnn_backend import cudnn_available
from typer.testing import CliRunner

from kvtier.stats import Direction

TINY = ["--model", "random:tiny-llama", "--device", "cpu"]
# 3 documents of 64 tokens: 5 blocks per request, a GPU budget of 7 blocks. The engines
# read every prefix their tiers hold: computing 64 tokens takes less than the saving the
# engine asks of a read by default, and these tests are about the reads.
LONGCTX = ["bench", "longctx", *TINY, "--num-docs", "3", "--doc-tokens", "64",
           "--question-tokens", "8", "--max-tokens", "3", "--seed", "5",
           "--restore-min-saving", "0"]
SERVE = ["bench", "serve", *TINY, "--num-conversations", "4", "--num-rounds", "3",
         "--system-tokens", "48", "--user-tokens", "8", "--max-tokens", "4", "--seed", "2"]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIER_CACHE_DIR", str(tmp_path_factory.mktemp("kvtier-cache")))
        yield


@pytest.fixture(scope="module")
def longctx_run(runner, tmp_path_factory) -> tuple[dict, Path, Path]:
    plot = tmp_path_factory.mktemp("plot") / "longctx.png"
    disk_dir = tmp_path_factory.mktemp("longctx-disk")
    result = runner.invoke(app, [*LONGCTX, "--plot", str(plot), "--disk-dir", str(disk_dir),
                                 "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), plot, disk_dir


def test_longctx_strategies_restore_from_their_tier_and_agree(longctx_run):
    result, _, _ = longctx_run
    assert result["outputs_identical"] is True
    strategies = result["strategies"]
    assert list(strategies) == ["recompute", "host", "disk"]
    prompt_tokens = 64 + 8
    full_blocks = 64 // 16 * 16  # the documents' full blocks are what a tier can restore
    recompute, host, disk = strategies["recompute"], strategies["host"], strategies["disk"]
    # Recompute: nothing comes back; every round-two prompt is prefilled again, on a fresh
    # engine (as the disk strategy's): not even the last document is on its GPU.
    assert recompute["tokens"]["host"] == recompute["tokens"]["disk"] == 0
    assert recompute["tokens"]["gpu"] == 0 and list(recompute["restores"]) == ["round2"]
    assert not any(recompute["bytes_moved"].values())
    # Host: each document's blocks come back from the host tier, none from disk.
    assert host["tokens"]["disk"] == 0
    assert host["tokens"]["gpu"] + host["tokens"]["host"] == 3 * full_blocks
    assert host["tokens"]["host"] > 0
    assert host["bytes_moved"][Direction.HOST_TO_GPU.value] > 0
    # Disk: a fresh engine with an empty host tier, so the blocks come from disk, from the
    # tail, while the head is computed: the meeting point splits every document's blocks.
    assert disk["tokens"]["host"] == 0 and disk["tokens"]["disk"] > 0
    assert disk["tokens"]["gpu"] + disk["tokens"]["disk"] <= 3 * full_blocks
    assert [m["gpu"] + m["disk"] + m["computed"] for m in disk["meeting_blocks"]] == [4] * 3
    assert disk["bytes_moved"][Direction.DISK_TO_HOST.value] > 0
    # The fresh engine's own account: a restore started for each document that read disk.
    assert disk["restores"]["round2"]["started"] >= sum(
        1 for m in disk["meeting_blocks"] if m["disk"])
    for figures in strategies.values():
        ttft = figures["ttft_s"]
        assert ttft["n"] == 3 and 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
        assert figures["speedup_vs_recompute"] == pytest.approx(
            recompute["ttft_s"]["p50"] / ttft["p50"])
        assert len(figures["token_ids"]["round2"]) == 3
        assert all(len(ids) == 3 for ids in figures["token_ids"]["round2"])
    assert recompute["speedup_vs_recompute"] == pytest.approx(1.0)
    headline = result["headline"]
    assert headline["prompt_tokens"] == prompt_tokens
    assert headline["speedup_host_vs_recompute"] == pytest.approx(host["speedup_vs_recompute"])
    assert headline["speedup_disk_vs_recompute"] == pytest.approx(disk["speedup_vs_recompute"])


def test_longctx_disk_read_is_the_median_of_three_rounds(longctx_run):
    result, _, _ = longctx_run
    disk = result["disk_read"]
    document_blocks = 64 // 16
    # Each round read one document's blocks back from the tier, every one verified.
    assert disk["tier"]["blocks"] == disk["tier"]["verified"] == document_blocks
    assert disk["tier_scattered"]["verified"] == disk["tier_scattered"]["blocks"]
    tiers, raws = disk["tier_gb_s_rounds"], disk["raw_best_gb_s_rounds"]
    assert len(tiers) == len(raws) == 3 and all(rate > 0 for rate in tiers + raws)
    assert disk["tier"]["gb_s"] == sorted(tiers)[1]
    assert disk["raw"]["best_gb_s"] == sorted(raws)[1]
    assert disk["tier_vs_best_raw"] == pytest.approx(sorted(tiers)[1] / sorted(raws)[1])


def test_longctx_timeline_samples_every_step(longctx_run):
    result, _, _ = longctx_run
    for name, figures in result["strategies"].items():
        timeline = figures["timeline"]
        assert [s["step"] for s in timeline] == list(range(len(timeline)))
        assert [s["phase"] for s in timeline] == sorted(s["phase"] for s in timeline)
        assert {s["phase"] for s in timeline} == {"round 1", "round 2"}
        # Moves per step add up to the strategy's totals; occupancy never exceeds the budget.
        for direction in Direction:
            assert sum(s["bytes_moved"][direction.value] for s in timeline) == \
                figures["bytes_moved"][direction.value]
        assert all(s["gpu_used_blocks"] <= result["gpu_blocks"] for s in timeline)
        swaps = [s for s in timeline if any(s["bytes_moved"].values())]
        assert figures["num_swap_steps"] == len(swaps)
        if name == "disk":
            # Round two starts on an engine that finds round one's blocks on disk.
            first_round2 = next(s for s in timeline if s["phase"] == "round 2")
            assert first_round2["disk_blocks"] > 0


def test_longctx_plot_is_a_png_and_the_disk_tier_is_removed(longctx_run):
    result, plot, disk_dir = longctx_run
    assert result["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(disk_dir.iterdir()) == []  # the disk strategy's tier lived in a temporary dir


def test_longctx_table_reports_the_ratio(runner):
    result = runner.invoke(app, [*LONGCTX, "--num-docs", "2", "--strategies", "recompute,host"])
    assert result.exit_code == 0, result.output
    assert "host restore vs recompute, 72-token prompt" in result.stdout
    assert "generated tokens across strategies: identical" in result.stdout


def test_longctx_cold_pauses_every_strategy_alike(runner, tmp_path):
    # --cold drops the page cache before every round-two request of every strategy, not
    # only the disk's, so the baseline's requests follow the same pause. Where dropping is
    # not permitted (not root) every strategy says so alike.
    result = runner.invoke(app, [*LONGCTX, "--num-docs", "2", "--cold", "--disk-dir",
                                 str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    colds = {name: figures["cold"] for name, figures in json.loads(result.stdout)
             ["strategies"].items()}
    assert set(colds) == {"recompute", "host", "disk"}
    assert len(set(colds.values())) == 1 and None not in colds.values()
    # After each drop the disk strategy reports how much of its tier's file stayed cached.
    resident = json.loads(result.stdout)["strategies"]["disk"]["resident_after_drop"]
    assert len(resident) == 2 and all(0.0 <= share <= 1.0 for share in resident)


def test_longctx_bad_strategies_is_one_line_error(runner):
    result = runner.invoke(app, [*LONGCTX, "--strategies", "host,disk"])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("error: ") and "recompute" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("bench", "backend", "message"), [
    (LONGCTX, "cudnn", "needs a CUDA device"), (SERVE, "cudnn", "needs a CUDA device"),
    (LONGCTX, "sdpa", "--attn-backend must be"), (SERVE, "flash-2", "--attn-backend must be")])
def test_benches_refuse_an_attention_backend_they_cannot_have(runner, bench, backend,
                                                              message):
    if torch.cuda.is_available() and backend == "cudnn":
        pytest.skip("checks the message shown without CUDA")
    result = runner.invoke(app, [*bench, "--attn-backend", backend])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_serve_modes_agree_and_tiers_serve_history(runner):
    result = runner.invoke(app, [*SERVE, "--compare-hf", "--hf-batch", "2",
                                 "--hf-prompt-tokens", "12", "--hf-new-tokens", "3",
                                 "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True
    assert report["baseline"] == "off"
    modes = report["modes"]
    assert list(modes) == ["off", "host", "host_disk"]
    assert report["gpu_blocks"] < report["working_set_blocks"]  # memory pressure
    for name, figures in modes.items():
        assert figures["num_requests"] == 4 * 3
        assert figures["generated_tokens"] == 4 * 3 * 4
        assert figures["throughput_tok_s"] > 0
        for key in ("ttft_s", "tpot_s"):
            summary = figures[key]
            assert 0 < summary["p50"] <= summary["p90"] <= summary["p99"]
        assert report["ratios_vs_baseline"][name]["throughput"] == pytest.approx(
            figures["throughput_tok_s"] / modes["off"]["throughput_tok_s"])
    assert modes["off"]["tokens"]["host"] == modes["off"]["tokens"]["disk"] == 0
    restored = modes["host"]["tokens"]["host"] + modes["host_disk"]["tokens"]["host"] \
        + modes["host_disk"]["tokens"]["disk"]
    assert restored > 0
    assert modes["host"]["tokens"]["computed"] < modes["off"]["tokens"]["computed"]
    comparison = report["hf_comparison"]
    assert set(comparison) == {"batch_1", "batch_2"}
    for figures in comparison.values():
        assert figures["same_tokens"] is True
        for key in ("engine_prefill_tok_s", "hf_prefill_tok_s", "engine_decode_tok_s",
                    "hf_decode_tok_s"):
            assert figures[key] > 0
        assert figures["decode_ratio"] == pytest.approx(
            figures["engine_decode_tok_s"] / figures["hf_decode_tok_s"])


def test_serve_compares_the_disk_with_the_same_host_tier_alone(runner):
    # Four rounds: the conversations outgrow the third-size host tier by several blocks.
    result = runner.invoke(app, [*SERVE, "--num-rounds", "4", "--modes", "off,host_third,host_disk",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True
    third, disk = report["modes"]["host_third"], report["modes"]["host_disk"]
    assert third["tokens"]["disk"] == 0 and third["bytes_moved"]["host->disk"] == 0
    assert third["tokens"]["host"] > 0
    assert third["tier_blocks"]["host"]["hits"] * 16 >= third["tokens"]["host"]
    assert third["restores"]["started"] > 0  # per lookup: host hits start restores
    assert report["modes"]["off"]["restores"]["started"] == 0
    # The same host tier; what it evicts goes to disk. (Whether it comes back from there
    # or is computed depends on the rates: prompts this short on this model are computed.)
    assert disk["bytes_moved"]["host->disk"] > 0


def test_serve_runs_go_round_the_modes_and_report_the_median_run(runner):
    result = runner.invoke(app, [*SERVE, "--modes", "off,host", "--runs", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True  # every run of every mode
    for mode in report["modes"].values():
        runs = sorted(r["throughput_tok_s"] for r in mode["runs"])
        assert len(runs) == 3 and mode["throughput_tok_s"] == runs[1]
        assert mode["ttft_s"]["p99"] in [r["ttft_p99_s"] for r in mode["runs"]]
    table = runner.invoke(app, [*SERVE, "--modes", "off", "--runs", "2"])
    assert table.exit_code == 0, table.output
    assert "Every run (each mode above is its median run of 2)" in table.stdout
    bad = runner.invoke(app, [*SERVE, "--runs", "0"])
    assert bad.exit_code != 0 and "--runs must be positive" in bad.output


def test_serve_table(runner):
    result = runner.invoke(app, [*SERVE, "--modes", "off,host", "--attn-backend", "torch"])
    assert result.exit_code == 0, result.output
    assert "conversations across modes: identical" in result.stdout
    assert "TTFT" in result.stdout and "TPOT" in result.stdout
    assert "Rounds (lockstep)" not in result.stdout
    lockstep = runner.invoke(app, [*SERVE, "--modes", "off", "--lockstep"])
    assert lockstep.exit_code == 0, lockstep.output
    assert "Rounds (lockstep)" in lockstep.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("command", [["kernels"], ["swap"]])
def test_gpu_benches_without_cuda_fail_in_one_line(runner, command):
    result = runner.invoke(app, ["bench", *command])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: kvtier bench {command[0]} needs a CUDA device"


@pytest.mark.gpu
def test_kernels_bench_tiny_json(runner):
    result = runner.invoke(app, ["bench", "kernels", "--decode-cases", "2x256,1x1024",
                                 "--prefill-cases", "128+0,128+256,2048+512",
                                 "--store-tokens", "256", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["context"] for r in report["decode"]] == [256, 1024]
    assert [r["prefix"] for r in report["prefill"]] == [0, 256, 512]
    # The cudnn backend is timed where it takes the chunk (>= 2048 tokens).
    assert ["cudnn" in r for r in report["prefill"]] == [False, False, cudnn_available()]
    assert all(r["cudnn"]["rel_error"] < 2e-2 for r in report["prefill"] if "cudnn" in r)
    assert report["block_order"] == "random"
    assert all(r["rel_error"] < 2e-2 for r in report["decode"] + report["prefill"])
    assert all(0 < r["copy_share"] for r in report["decode"])
    assert all(r["correct"] for r in report["store_kv"])


def test_kernels_bench_rejects_bad_cases(runner):
    result = runner.invoke(app, ["bench", "kernels", "--decode-cases", "32by8192"])
    assert result.exit_code == 1
    assert "--decode-cases" in result.stderr


@pytest.mark.gpu
def test_swap_bench_tiny_json(runner):
    result = runner.invoke(app, ["bench", "swap", "--block-bytes", "65536,262144",
                                 "--total-mib", "8", "--host-run-blocks", "4", "--repeats", "1",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [s["block_bytes"] for s in report["sizes"]] == [65536, 262144]
    assert report["host_run_blocks"] == 4 and report["all_correct"]
    assert set(report["sizes"][0]["methods"]) == {"auto", "dma", "staged", "triton"}
    assert "matmul_slowdown" in report["sizes"][1]["methods"]["auto"]
    assert [w["block_bytes"] for w in report["write_through"]] == [262144, 2 << 20]


def test_swap_bench_rejects_bad_options(runner):
    result = runner.invoke(app, ["bench", "swap", "--block-bytes", "32K"])
    assert result.exit_code != 0
    assert "--block-bytes takes comma-separated integers" in result.output + result.stderr
    result = runner.invoke(app, ["bench", "swap", "--methods", "fast"])
    assert result.exit_code != 0 and "--methods" in result.output + result.stderr


def test_tiers_bench_is_wired(runner, tmp_path):
    def bench(*options: str) -> dict:
        result = runner.invoke(app, ["bench", "tiers", "--num-layers", "2", "--num-kv-heads",
                                     "1", "--head-dim", "8", "--no-durable", "--tmpdir",
                                     str(tmp_path), "--json", *options])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    report = bench("--num-blocks", "4", "--repeats", "2")
    assert report["num_blocks"] == 4 and report["repeats"] == 2
    assert report["lmdb"]["read"]["mb_per_s"] > 0 and report["write_ratio"] > 0
    report = bench("--num-blocks", "6", "--repeats", "1", "--batch-size", "2", "--writers", "2")
    assert report["writers"] == 2 and report["lmdb"]["write"]["mb_per_s"] > 0
    # Over four shards: the same bytes read back (the bench checks them), one sync each.
    report = bench("--num-blocks", "8", "--repeats", "1", "--batch-size", "4", "--shards", "4")
    assert report["shards"] == 4 and report["lmdb"]["syncs"] == 4


def test_tiers_bench_ends_each_write_with_one_sync_in_either_mode(runner, tmp_path):
    tiny = ["bench", "tiers", "--num-blocks", "4", "--num-layers", "2", "--num-kv-heads", "1",
            "--head-dim", "8", "--repeats", "1", "--batch-size", "2", "--tmpdir",
            str(tmp_path), "--json"]
    for extra, durable in (([], False), (["--durable"], True)):  # the default: the engine's
        result = runner.invoke(app, [*tiny, *extra])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["durable"] is durable
        assert report["mode"].startswith("durable" if durable else "non-durable")
        # The tier synced once (the final sync; 64 KiB is far below its 1 GiB period)...
        assert report["lmdb"]["syncs"] == 1
        for path in ("lmdb", "file"):
            write = report[path]["write"]
            # ... and both final syncs are inside the write's time.
            assert 0 <= write["sync_s"] <= write["median_s"]
            assert "sync_s" not in report[path]["read"]
    table = runner.invoke(app, tiny[:-1])
    assert table.exit_code == 0, table.output
    assert "non-durable: one sync at the end" in " ".join(table.stdout.split())


def test_serve_and_longctx_benches_pass_the_disk_durability_to_their_disk_engines(tmp_path):
    from kvtier.cli.bench.longctx import LongctxConfig, _engine_options
    from kvtier.cli.bench.serve import ServeConfig, _tier_options

    from kvtier.layout import KVLayout

    layout = KVLayout(2, 1, 8, 16, torch.float32)
    for durable in (False, True):
        longctx = LongctxConfig(model="random:tiny-llama", disk_durable=durable)
        assert _engine_options("disk", longctx, layout, tmp_path)["disk_durable"] is durable
        assert "disk_durable" not in _engine_options("host", longctx, layout, tmp_path)
        serve = ServeConfig(model="random:tiny-llama", disk_durable=durable)
        assert _tier_options("host_disk", serve, layout.bytes_per_block)["disk_durable"] \
            is durable
    assert LongctxConfig().disk_durable is False and ServeConfig().disk_durable is False


def test_bench_modes_that_name_where_the_disk_tier_runs_pin_it(tmp_path):
    """disk_inprocess / host_small_disk_inprocess keep the disk tier in the engine's
    process, host_small_disk_worker asks for the worker, the others take the default."""
    from kvtier.cli.bench.longctx import LongctxConfig, _engine_options
    from kvtier.cli.bench.serve import ServeConfig, _tier_options

    from kvtier.layout import KVLayout

    layout = KVLayout(2, 1, 8, 16, torch.float32)
    longctx = LongctxConfig(model="random:tiny-llama")
    assert _engine_options("disk_inprocess", longctx, layout, tmp_path)["disk_worker"] is False
    assert "disk_worker" not in _engine_options("disk", longctx, layout, tmp_path)
    serve = ServeConfig(model="random:tiny-llama")
    worker = {mode: _tier_options(mode, serve, layout.bytes_per_block).get("disk_worker")
              for mode in ("host_small_disk", "host_small_disk_inprocess",
                           "host_small_disk_worker")}
    assert worker == {"host_small_disk": None, "host_small_disk_inprocess": False,
                      "host_small_disk_worker": True}


def test_roundtrip_bench_is_wired(runner, tmp_path):
    result = runner.invoke(app, ["bench", "roundtrip", "--total-mib", "4", "--repeats", "1",
                                 "--device", "cpu", "--disk-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["num_blocks"] == 2
    assert report["manager"]["verified"] and report["disk"]["verified"]


def test_longctx_compare_hf_times_transformers_on_the_same_prompts(runner):
    result = runner.invoke(app, [*LONGCTX, "--strategies", "recompute", "--compare-hf",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    hf = report["transformers"]
    assert hf["ttft_s"]["n"] == 3
    assert hf["ttft_s"]["p50"] > 0
    assert hf["engine_recompute_vs_hf"] == pytest.approx(
        report["strategies"]["recompute"]["ttft_s"]["p50"] / hf["ttft_s"]["p50"])
    # float32 on the CPU: transformers picks the engine's first tokens.
    assert hf["same_first_tokens"] is True


def test_serve_with_a_remote_tier_keeps_the_answers(runner, redis_server):
    result = runner.invoke(app, [*SERVE, "--modes", "off,host_disk", "--remote-cache",
                                 redis_server.url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True
    assert report["config"]["remote_cache"] == redis_server.url
    assert report["modes"]["off"]["tokens"]["remote"] == 0


def test_ratios_read_as_people_say_them():
    from kvtier.cli.bench.tables import ratio_words
    assert ratio_words(3.2) == "3.20x sooner"
    assert ratio_words(1 / 11) == "11x slower"
    assert ratio_words(0.5) == "2.00x slower"


def test_serve_and_longctx_report_both_numerics_with_deterministic(runner):
    serve = runner.invoke(app, [*SERVE, "--modes", "off,host", "--dtype", "bfloat16",
                                "--deterministic", "--json"])
    assert serve.exit_code == 0, serve.output
    report = json.loads(serve.stdout)
    assert report["deterministic_equal_to_baseline"] == {
        mode: {"identical": 4, "of": 4} for mode in ("off", "host")}
    assert set(report["equal_to_baseline"]) == {"off", "host"}
    for mode, cost in report["deterministic_cost"].items():
        assert cost["throughput"] == pytest.approx(
            report["deterministic_modes"][mode]["throughput_tok_s"]
            / report["modes"][mode]["throughput_tok_s"])
    longctx = runner.invoke(app, [*LONGCTX, "--num-docs", "2", "--deterministic"])
    assert longctx.exit_code == 0, longctx.output
    assert "default vs deterministic mode: requests equal to recompute" in longctx.stdout
    assert "2 of 2" in longctx.stdout


# A host tier of 4 blocks of the tiny model (8 KiB each): far smaller than the work.
SMALL_HOST = ["--host-cache-gb", str(4 * 8192 / 2**30)]


def test_longctx_host_small_disk_accounts_for_every_block(runner, tmp_path):
    result = runner.invoke(app, [*LONGCTX, "--strategies", "recompute,disk,host_small_disk",
                                 *SMALL_HOST, "--disk-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True
    assert report["raw_write"]["gb_s"] > 0
    for name in ("disk", "host_small_disk"):
        writes = report["strategies"][name]["disk_writes"]
        # Round one's engine was closed: nothing pending, nothing lost, the rest skipped
        # with a reason.
        assert writes["lost"] == 0 and writes["pending"] == 0
        assert writes["offered"] == (writes["written"] + writes["duplicate"]
                                     + sum(writes["skipped"].values())) > 0
        assert writes["skipped"]["flush_timeout"] == 0
        assert writes["write_gb_s"] > 0 and writes["raw_write_gb_s"] == report["raw_write"]["gb_s"]
        assert len(report["strategies"][name]["meeting_blocks"]) == 3
        # What the disk holds, looked up per document: every block written is one of the
        # documents' (their prompts fill no block past them), so the counts agree.
        stored = report["strategies"][name]["stored_on_disk"]
        assert [span["blocks"] for span in stored] == [64 // 16] * 3
        assert sum(span["stored"] for span in stored) == writes["written"]
        assert all(span["tail"] <= span["stored"] for span in stored)
    # A host tier holding everything flushed every block at close.
    assert report["strategies"]["disk"]["stored_on_disk"] == [
        {"blocks": 4, "stored": 4, "tail": 4, "runs": 1}] * 3
    assert report["strategies"]["recompute"]["stored_on_disk"] is None


def test_longctx_cold_reports_warm_restores_apart(runner, tmp_path):
    result = runner.invoke(app, [*LONGCTX, "--num-docs", "2", "--cold", "--strategies",
                                 "recompute,host_small_disk", *SMALL_HOST, "--disk-dir",
                                 str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True
    small = report["strategies"]["host_small_disk"]
    assert small["ttft_warm_s"]["n"] == 2 and small["ttft_s"]["n"] == 2
    assert report["strategies"]["recompute"]["ttft_warm_s"] is None
    # Where the warm round's fronts met, as the cold round's: every block from somewhere.
    assert [sum(m.values()) for m in small["meeting_blocks_warm"]] == [64 // 16] * 2
    assert report["strategies"]["recompute"]["meeting_blocks_warm"] is None
    # The warm round ran over round one's blocks, its files read into the page cache.
    warmed = small["warm_page_cache"]
    assert warmed["forgotten"] >= 0 and warmed["bytes_read"] > 0
    assert warmed["resident"] is None or 0 < warmed["resident"] <= 1
    assert report["strategies"]["recompute"]["warm_page_cache"] is None
    # The page cache's share of the tier's file after each drop was asked (or not
    # measurable here): never a share of a file that is not the tier's.
    assert all(share is None or 0 <= share <= 1 for share in small["resident_after_drop"])


def test_serve_host_small_disk_with_documents_in_lockstep(runner):
    """Also with the disk tier in a worker process (the default on a GPU)."""
    result = runner.invoke(app, [*SERVE, "--doc-tokens", "64", "--lockstep", "--modes",
                                 "off,host_small_disk,host_small_disk_worker", *SMALL_HOST,
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs_identical"] is True
    assert report["modes"]["off"]["disk_writes"] is None
    for mode in ("host_small_disk", "host_small_disk_worker"):
        writes = report["modes"][mode]["disk_writes"]
        assert writes["lost"] == 0 and writes["offered"] > 0
        assert writes["offered"] == (writes["written"] + writes["duplicate"]
                                     + sum(writes["skipped"].values()) + writes["pending"])
    # What the worker's requests cost the engine's threads; nothing without a worker.
    assert report["modes"]["host_small_disk"]["disk_worker_calls"] is None
    calls = report["modes"]["host_small_disk_worker"]["disk_worker_calls"]
    assert calls["contains"]["calls"] > 0 and calls["put"]["calls"] > 0
    assert all(c["seconds"] > 0 for c in calls.values() if c["calls"])
    # Each conversation's own document is in its history.
    assert report["working_set_blocks"] > 4 * 64 // 16
    # One record per round; together they are the run's prompt tokens.
    for mode in report["modes"].values():
        rounds = mode["rounds"]
        assert len(rounds) == 3
        for source in ("host", "disk", "computed"):
            assert sum(r["tokens"][source] for r in rounds) == mode["tokens"][source]
        assert sum(r["seconds"] for r in rounds) <= mode["elapsed_s"]
        # The engine planned steps in every round, within the round's time.
        assert all(0 < r["planning_s"] <= r["seconds"] for r in rounds)
        assert sum(r["planning_s"] for r in rounds) <= mode["planning_s"] <= mode["elapsed_s"]
        # Where the engine thread's time went: its planning is the one above, and the
        # parts, each taken, add up to no more than the run (on the CPU the compute is in
        # the launch).
        thread = mode["engine_thread_s"]
        assert thread["planning_s"] == pytest.approx(mode["planning_s"])
        assert thread["launching_s"] > 0 and thread["after_launch_s"] > 0
        assert thread["waiting_s"] >= 0
        assert sum(thread.values()) <= mode["elapsed_s"]
    ledgers = [r["disk_ledger"] for r in report["modes"]["host_small_disk"]["rounds"]]
    assert [ledger["written"] for ledger in ledgers] == sorted(ledger["written"]
                                                               for ledger in ledgers)
    assert report["modes"]["off"]["rounds"][0]["disk_ledger"] is None
    # The engine timed its prefill steps (the documents' chunks), and the tiers off read
    # nothing, so no tier's rate is known there.
    off_rates = report["modes"]["off"]["rounds"][-1]["rates"]
    assert off_rates["prefill_tokens_per_s"] > 0 and off_rates["tiers"] == {}


@pytest.mark.parametrize("bench", ["longctx", "serve"])
def test_benches_refuse_a_host_tier_of_nothing(runner, bench):
    base = LONGCTX if bench == "longctx" else SERVE
    result = runner.invoke(app, [*base, "--host-cache-gb", "0"])
    assert result.exit_code != 0
    assert "--host-cache-gb must be positive" in result.output


def test_invariance_bench_deterministic_mode_keeps_every_bit(runner):
    # bf16 on the CPU: the deterministic mode must give every shape the first shape's
    # tokens and log-probability bits; the default mode is only reported.
    result = runner.invoke(app, ["bench", "invariance", "--device", "cpu", "--dtype",
                                 "bfloat16", "--num-prompts", "5", "--min-tokens", "8",
                                 "--max-prompt-tokens", "48", "--max-tokens", "4",
                                 "--shapes", "1x64,5x64,5x16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["modes"]) == {"default", "deterministic"}
    for shape, row in report["modes"]["deterministic"].items():
        assert (row["same_tokens"], row["same_logprob_bits"], row["of"]) == (5, 5, 5), shape
    assert set(report["deterministic_time"]) == {"1x64", "5x64", "5x16"}
    table = runner.invoke(app, ["bench", "invariance", "--device", "cpu", "--num-prompts",
                                "2", "--min-tokens", "8", "--max-prompt-tokens", "16",
                                "--max-tokens", "2", "--shapes", "1x32", "--modes",
                                "deterministic"])
    assert table.exit_code == 0, table.output
    assert "2 of 2" in table.stdout


@pytest.mark.parametrize("options, message", [
    (["--shapes", "8by2048"], "--shapes takes comma-separated SEQSxTOKENS"),
    (["--modes", "fast"], "--modes takes"),
    (["--min-tokens", "64", "--max-prompt-tokens", "8"], "--max-prompt-tokens (8)"),
])
def test_invariance_bench_rejects_bad_options(runner, options, message):
    result = runner.invoke(app, ["bench", "invariance", "--device", "cpu", *options])
    assert result.exit_code != 0
    assert message in result.output
