"""One settings model, four sources: explicit values > YAML file > KVTIER_* > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.engine import LLM, EngineConfig, SamplingParams, load_engine_config

from kvtier.config import TierConfig
from kvtier.validation import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_explicit_then_file_then_environment(tmp_path) -> None:
    config_file = write(tmp_path / "kvtier.yaml",
                        "hash_algorithm: sha256\nblock_size: 32\ncache_salt: from-file\n")
    environ = {"KVTIER_BLOCK_SIZE": "64", "KVTIER_MAX_NUM_SEQS": "3",
               "KVTIER_CACHE_SALT": "from-env", "KVTIER_HOST_CACHE": "false",
               "KVTIER_GPU_BLOCKS": "none", "KVTIER_DEBUG": "1"}
    config = load_engine_config({"cache_salt": "explicit", "seed": None}, config_file,
                                environ)
    assert config.cache_salt == "explicit"  # explicit beats file and environment
    assert config.block_size == 32 and config.hash_algorithm == "sha256"  # file beats env
    assert config.max_num_seqs == 3 and config.host_cache is False  # environment only
    assert config.gpu_blocks is None
    assert config.seed == 0  # an explicit None counts as not given: the default
    assert load_engine_config({}, None, {}) == EngineConfig()


def test_config_file_named_by_the_environment(tmp_path) -> None:
    config_file = write(tmp_path / "c.yaml", "max_model_len: 512\n")
    config = load_engine_config(None, None, {"KVTIER_CONFIG": str(config_file)})
    assert config.max_model_len == 512


@pytest.mark.parametrize("text, message", [
    ("block_sise: 32\n", "unknown setting(s) block_sise"),
    ("- a\n- b\n", "must hold a mapping"),
    ("block_size: [\n", "not valid YAML"),
    ("block_size: 0\n", "EngineConfig.block_size: must be > 0, got 0"),
    ("hash_algorithm: md5\n", "EngineConfig.hash_algorithm: must be one of 'xxh3_128' or "
                              "'sha256'"),
])
def test_bad_files_say_what_and_where(tmp_path, text, message) -> None:
    config_file = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_engine_config({}, config_file, {})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_environment_values_name_the_variable() -> None:
    with pytest.raises(ValueError) as info:
        load_engine_config({}, None, {"KVTIER_GPU_MEMORY_UTILIZATION": "1.5"})
    assert "gpu_memory_utilization: must be <= 1" in str(info.value)
    assert "KVTIER_GPU_MEMORY_UTILIZATION" in str(info.value)


def test_unknown_keywords_and_missing_files() -> None:
    with pytest.raises(ConfigError, match="unknown setting.*tensor_parallel_size"):
        load_engine_config({"tensor_parallel_size": 2}, None, {})
    with pytest.raises(OSError, match="cannot read config file"):
        load_engine_config({}, "/nonexistent/kvtier.yaml", {})


def test_validation_replaces_the_hand_written_checks() -> None:
    with pytest.raises(ValueError, match="EngineConfig.block_size must not be a boolean"):
        EngineConfig(block_size=True)
    with pytest.raises(ValueError, match="EngineConfig.disk_cache_gb: must be a finite"):
        EngineConfig(disk_cache_gb=float("nan"))
    with pytest.raises(ValueError, match="TierConfig.io_threads: must be > 0, got 0"):
        TierConfig(num_gpu_blocks=4, io_threads=0)
    with pytest.raises(ValueError, match="TierConfig.read_reserve_share: must be < 1"):
        TierConfig(num_gpu_blocks=4, read_reserve_share=1.0)
    with pytest.raises(ValueError, match="TierConfig.swap_method: must be one of"):
        TierConfig(num_gpu_blocks=4, swap_method="fast")
    config = TierConfig(num_gpu_blocks=4)
    with pytest.raises(ValueError):  # frozen, like the dataclass it replaces
        config.num_gpu_blocks = 5  # type: ignore[misc]
    assert config.replace(io_threads=3).io_threads == 3


def test_llm_reads_the_file_and_the_environment(tmp_path, monkeypatch) -> None:
    config_file = write(tmp_path / "kvtier.yaml",
                        "model: random:tiny-llama\ndevice: cpu\nblock_size: 8\n"
                        "gpu_blocks: 24\nhost_cache: false\ndisk_cache: false\n"
                        "cache_salt: tenant-a\n")
    monkeypatch.setenv("KVTIER_HASH_ALGORITHM", "sha256")
    monkeypatch.setenv("KVTIER_MAX_MODEL_LEN", "200")
    with LLM(config=config_file, gpu_blocks=16) as llm:
        assert llm.config.block_size == 8 and llm.num_gpu_blocks == 16  # keyword wins
        assert llm.config.hash_algorithm == "sha256" and llm.max_model_len == 200
        assert llm.model_id.startswith("random:tiny-llama@")
        # The engine-wide salt applies to requests that bring none.
        salted = llm.add_request([5, 6, 7] * 6)
        unsalted = llm.add_request([5, 6, 7] * 6, cache_salt="other")
        namespaces = {rid: llm._requests[rid].hasher.namespace for rid in (salted, unsalted)}
        assert namespaces[salted] != namespaces[unsalted]
        while llm.has_unfinished():
            llm.step()
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM("random:tiny-llama", device="cpu", max_model_len=10**6, host_cache=False,
            disk_cache=False)


def test_disk_durability_from_every_source_reaches_the_opened_tier(tmp_path,
                                                                   monkeypatch) -> None:
    assert EngineConfig().disk_durable is False  # the engine's tier leaves write-back to the OS
    assert load_engine_config({}, None, {"KVTIER_DISK_DURABLE": "true"}).disk_durable is True
    config_file = write(tmp_path / "kvtier.yaml", "disk_durable: true\n")
    assert load_engine_config({"disk_durable": False}, config_file, {}).disk_durable is False

    def opened_durable(**options) -> bool:
        with LLM("random:tiny-llama", device="cpu", gpu_blocks=16, host_cache_gb=0.001,
                 disk_cache_dir=tmp_path / "kv", disk_cache_gb=0.01, **options) as llm:
            disk = llm.manager.lower_tiers.named("disk")
            assert disk is not None and llm.stats().disk.durable is disk.durable
            return disk.durable

    assert opened_durable() is False
    assert opened_durable(disk_durable=True) is True
    assert opened_durable(config=config_file) is True
    monkeypatch.setenv("KVTIER_DISK_DURABLE", "1")
    assert opened_durable() is True
    assert opened_durable(disk_durable=False) is False  # a keyword beats the environment


def test_disk_shards_and_read_reserve_from_the_environment_reach_the_tiers(
        tmp_path, monkeypatch) -> None:
    assert EngineConfig().disk_shards is None and EngineConfig().read_reserve_share == 0.5
    monkeypatch.setenv("KVTIER_DISK_SHARDS", "3")
    monkeypatch.setenv("KVTIER_READ_RESERVE_SHARE", "0.25")
    with LLM("random:tiny-llama", device="cpu", gpu_blocks=16, host_cache_gb=0.001,
             disk_cache_dir=tmp_path / "kv", disk_cache_gb=0.01) as llm:
        assert llm.manager.config.disk_shards == 3
        assert llm.manager.config.read_reserve_share == 0.25
        assert len(llm.manager.disk.shards) == 3
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == \
        ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    for bad in ("0", "65"):
        monkeypatch.setenv("KVTIER_DISK_SHARDS", bad)
        with pytest.raises(ValueError, match="disk_shards"):
            load_engine_config({}, None)


def test_the_disk_worker_is_off_on_the_cpu_unless_asked_for(tmp_path, monkeypatch) -> None:
    """None (the default) is a worker on CUDA only; `disk_worker` or KVTIER_DISK_WORKER
    turn it on here, and an engine with it answers as one without."""
    assert EngineConfig().disk_worker is None
    prompt, params = list(range(3, 80)), SamplingParams(max_tokens=4, ignore_eos=True)
    answers = []
    for worker, env in ((None, None), (True, None), (None, "true"), (False, "true")):
        if env is None:
            monkeypatch.delenv("KVTIER_DISK_WORKER", raising=False)
        else:
            monkeypatch.setenv("KVTIER_DISK_WORKER", env)
        with LLM("random:tiny-llama", device="cpu", gpu_blocks=16, host_cache_gb=0.001,
                 disk_cache_dir=tmp_path / f"kv-{worker}-{env}", disk_cache_gb=0.01,
                 disk_worker=worker, dtype="float32") as llm:
            expected = worker if worker is not None else env == "true"
            assert llm.manager.uses_disk_worker is expected
            answers.append(list(llm.generate([prompt], params)[0].outputs[0].token_ids))
    assert all(answer == answers[0] for answer in answers)
    monkeypatch.setenv("KVTIER_DISK_WORKER", "sometimes")
    with pytest.raises(ValueError, match="disk_worker"):
        load_engine_config({}, None)


@pytest.mark.parametrize(("disk_cache_gb", "expected"), [
    (0.01, ["data.mdb", "lock.mdb"]),
    (4.0, [f"shard-{i}-of-4" for i in range(4)]),
])
def test_a_new_disk_tier_is_split_by_its_budget_unless_told(tmp_path, disk_cache_gb,
                                                            expected) -> None:
    with LLM("random:tiny-llama", device="cpu", gpu_blocks=16, host_cache_gb=0.001,
             disk_cache_dir=tmp_path / "kv", disk_cache_gb=disk_cache_gb) as llm:
        assert llm.manager.config.disk_shards is None
        llm.generate([list(range(1, 40))],
                     SamplingParams(max_tokens=2))
    names = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert [n for n in names if n.startswith(("shard-", "data.", "lock."))] == expected
    # Reopened with a budget on the other side of the line, the directory keeps its count.
    other = 4.0 if disk_cache_gb < 4 else 0.01
    with LLM("random:tiny-llama", device="cpu", gpu_blocks=16, host_cache_gb=0.001,
             disk_cache_dir=tmp_path / "kv", disk_cache_gb=other) as llm:
        assert len(getattr(llm.manager.disk, "shards", [None])) == (4 if len(expected) == 4
                                                                    else 1)
