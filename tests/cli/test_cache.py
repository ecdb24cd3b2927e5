"""`kvtier cache ...` on real disk tier directories written with `DiskTier`."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from kvtier.cli.main import app
from typer.testing import CliRunner

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shard_layout import shard_of
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, metas_for

# 1 layer x K/V x 4 tokens x 1 head x 4 dims x float32 = 128 bytes per block.
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
NUM_BLOCKS = 8


def _blocks(seed: int) -> tuple[list[BlockMeta], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, 1000, NUM_BLOCKS * LAYOUT.block_size).tolist()
    parent = namespace_hash("test/cache-cli", LAYOUT)
    hashes = hash_blocks(parent, token_ids, LAYOUT.block_size)
    metas = metas_for(parent, hashes, token_ids, LAYOUT.block_size)
    payloads = [rng.standard_normal(LAYOUT.elements_per_block).astype(np.float32)
                for _ in metas]
    return metas, payloads


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, list[BlockMeta], list[np.ndarray]]:
    """A disk tier with NUM_BLOCKS blocks, put one by one (block 0 least recently used)."""
    path = tmp_path / "kv"
    metas, payloads = _blocks(seed=0)
    with DiskTier(path, LAYOUT, budget_bytes=1 << 20) as tier:
        for meta, payload in zip(metas, payloads):
            assert sum(tier.put([meta], [payload])) == 1
    return path, metas, payloads


def _invoke_json(runner: CliRunner, *args: str):
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_stats_counts_blocks_bytes_and_layout(runner, written):
    path, _, _ = written
    stats = _invoke_json(runner, "cache", "stats", "--dir", str(path))
    assert stats["num_blocks"] == NUM_BLOCKS
    assert stats["bytes_used"] > NUM_BLOCKS * LAYOUT.bytes_per_block  # headers on top
    assert stats["path"] == str(path)
    [layout] = stats["layouts"]
    assert layout["layout"] == LAYOUT.describe()
    assert layout["num_blocks"] == NUM_BLOCKS

    table = runner.invoke(app, ["cache", "stats", "--dir", str(path)])
    assert table.exit_code == 0, table.output
    assert "blocks" in table.stdout and str(NUM_BLOCKS) in table.stdout


def test_stats_defaults_to_the_engine_disk_cache_dir(runner, written, monkeypatch):
    path, _, _ = written
    # The engine keeps its disk tier in <KVTIER_CACHE_DIR>/kv; `written` made exactly that.
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(path.parent))
    stats = _invoke_json(runner, "cache", "stats")
    assert stats["num_blocks"] == NUM_BLOCKS
    assert stats["path"] == str(path)


def test_inspect_lists_most_recent_first(runner, written):
    path, metas, _ = written
    rows = _invoke_json(runner, "cache", "inspect", "--dir", str(path), "--limit", "3")
    assert [row["hash"] for row in rows] == [m.block_hash.hex() for m in metas[::-1][:3]]
    assert all(row["num_tokens"] == LAYOUT.block_size and row["status"] == "ok"
               for row in rows)
    table = runner.invoke(app, ["cache", "inspect", "--dir", str(path), "--limit", "2"])
    assert table.exit_code == 0, table.output
    assert metas[-1].block_hash.hex()[:16] in table.stdout
    assert metas[0].block_hash.hex()[:16] not in table.stdout


def test_verify_finds_damage_and_repair_removes_it(runner, written):
    path, metas, payloads = written
    clean = _invoke_json(runner, "cache", "verify", "--dir", str(path))
    assert clean["ok"] and clean["num_checked"] == NUM_BLOCKS

    # Flip one payload byte of block 5 behind the tier's back.
    victim = metas[5].block_hash
    env = lmdb.open(str(path), max_dbs=8)
    try:
        blocks_db = env.open_db(b"blocks")
        with env.begin(write=True, db=blocks_db) as txn:
            value = bytearray(txn.get(victim))
            value[-1] ^= 0xFF
            txn.put(victim, bytes(value))
    finally:
        env.close()

    damaged = runner.invoke(app, ["cache", "verify", "--dir", str(path)])
    assert damaged.exit_code == 1, damaged.output
    assert "--repair" in damaged.stdout
    report = json.loads(runner.invoke(app, ["cache", "verify", "--dir", str(path),
                                            "--json"]).stdout)
    assert report["bad"] == [{"hash": victim.hex(), "reason": "bad checksum"}]

    repaired = _invoke_json(runner, "cache", "verify", "--dir", str(path), "--repair")
    assert repaired["num_removed"] == 1 and repaired["repaired"]
    after = _invoke_json(runner, "cache", "verify", "--dir", str(path))
    assert after["ok"] and after["num_checked"] == NUM_BLOCKS - 1
    # The other blocks still read back bit for bit.
    with DiskTier(path, LAYOUT, budget_bytes=1 << 20) as tier:
        assert tier.contains([m.block_hash for m in metas]) == [i != 5 for i in range(8)]
        dest = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype)
        assert tier.get_into(metas[2], dest)
        assert np.array_equal(dest.numpy().reshape(-1), payloads[2])


def test_prune_keeps_the_most_recently_used(runner, written):
    path, metas, _ = written
    record_bytes = _invoke_json(runner, "cache", "stats", "--dir", str(path))["bytes_used"]
    keep = 3
    max_gb = keep * (record_bytes // NUM_BLOCKS) / 2**30
    result = _invoke_json(runner, "cache", "prune", "--dir", str(path), "--max-gb", repr(max_gb))
    assert result["num_removed"] == NUM_BLOCKS - keep
    rows = _invoke_json(runner, "cache", "inspect", "--dir", str(path), "--limit", "100")
    assert [row["hash"] for row in rows] == [m.block_hash.hex() for m in metas[::-1][:keep]]


def test_clear_asks_first_then_deletes_everything(runner, written):
    path, _, _ = written
    declined = runner.invoke(app, ["cache", "clear", "--dir", str(path)], input="n\n")
    assert declined.exit_code == 1
    assert _invoke_json(runner, "cache", "stats", "--dir", str(path))["num_blocks"] == NUM_BLOCKS

    cleared = runner.invoke(app, ["cache", "clear", "--dir", str(path), "--yes"])
    assert cleared.exit_code == 0, cleared.output
    assert f"removed {NUM_BLOCKS} blocks" in cleared.stdout
    assert _invoke_json(runner, "cache", "stats", "--dir", str(path))["num_blocks"] == 0


def test_export_then_import_into_another_directory(runner, written, tmp_path):
    path, metas, payloads = written
    export_file = tmp_path / "blocks.kvtx"
    exported = _invoke_json(runner, "cache", "export", str(export_file), "--dir", str(path))
    assert exported["num_blocks"] == NUM_BLOCKS

    other = tmp_path / "other-kv"
    imported = _invoke_json(runner, "cache", "import", str(export_file), "--dir", str(other),
                            "--shards", "4")
    assert imported["num_new"] == NUM_BLOCKS
    again = runner.invoke(app, ["cache", "import", str(export_file), "--dir", str(other)])
    assert again.exit_code == 0, again.output
    assert "imported 0 new blocks" in again.stdout

    assert _invoke_json(runner, "cache", "stats", "--dir", str(other))["shards"] == 4
    tier, recovery = open_disk_tier(other, LAYOUT, 1 << 20)
    assert recovery is None
    with tier:
        dest = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype)
        for meta, payload in zip(metas, payloads):
            assert tier.get_into(meta, dest)
            assert np.array_equal(dest.numpy().reshape(-1), payload)
    # Into one environment by default: data.mdb at the directory's root.
    single = tmp_path / "single-kv"
    assert _invoke_json(runner, "cache", "import", str(export_file), "--dir",
                        str(single))["num_new"] == NUM_BLOCKS
    assert (single / "data.mdb").is_file()


def test_import_of_a_damaged_file_is_one_line_and_imports_nothing(runner, written, tmp_path):
    path, _, _ = written
    export_file = tmp_path / "blocks.kvtx"
    _invoke_json(runner, "cache", "export", str(export_file), "--dir", str(path))
    data = bytearray(export_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    export_file.write_bytes(bytes(data))
    other = tmp_path / "other-kv"
    result = runner.invoke(app, ["cache", "import", str(export_file), "--dir", str(other)])
    _assert_one_line_error(result, "nothing was imported")
    assert not (other / "data.mdb").exists() or \
        _invoke_json(runner, "cache", "stats", "--dir", str(other))["num_blocks"] == 0


def test_missing_directory_is_one_line_error(runner, tmp_path):
    missing = tmp_path / "nowhere"
    for command in (["stats"], ["inspect"], ["verify"], ["prune", "--max-gb", "1"],
                    ["clear", "--yes"], ["export", str(tmp_path / "x.kvtx")]):
        result = runner.invoke(app, ["cache", *command, "--dir", str(missing)])
        _assert_one_line_error(result, str(missing))
    result = runner.invoke(app, ["cache", "import", str(tmp_path / "absent.kvtx"),
                                 "--dir", str(missing)])
    _assert_one_line_error(result, "absent.kvtx")


def test_every_command_works_on_a_sharded_directory(runner, tmp_path):
    """stats, inspect, verify (and --repair), prune and clear over four shards, each shard's
    answer added up; the damaged value is found in whichever shard holds it."""
    path = tmp_path / "kv"
    metas, payloads = _blocks(seed=3)
    tier, _ = open_disk_tier(path, LAYOUT, 1 << 22, shards=4)
    with tier:
        for meta, payload in zip(metas, payloads):  # one by one: block 0 is the oldest
            assert tier.put([meta], [payload]) == [True]
    stats = _invoke_json(runner, "cache", "stats", "--dir", str(path))
    assert stats["shards"] == 4 and stats["num_blocks"] == NUM_BLOCKS
    assert stats["budget_bytes"] == 1 << 22
    rows = _invoke_json(runner, "cache", "inspect", "--dir", str(path), "--limit", "3")
    assert [row["hash"] for row in rows] == [m.block_hash.hex() for m in metas[::-1][:3]]

    victim = metas[5].block_hash
    env = lmdb.open(str(path / f"shard-{shard_of(victim, 4)}-of-4"), max_dbs=8)
    try:
        with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
            value = bytearray(txn.get(victim))
            value[-1] ^= 0xFF
            txn.put(victim, bytes(value))
    finally:
        env.close()
    report = json.loads(runner.invoke(app, ["cache", "verify", "--dir", str(path),
                                            "--json"]).stdout)
    assert report["num_checked"] == NUM_BLOCKS and not report["ok"]
    assert report["bad"] == [{"hash": victim.hex(), "reason": "bad checksum"}]
    assert _invoke_json(runner, "cache", "verify", "--dir", str(path),
                        "--repair")["num_removed"] == 1
    assert _invoke_json(runner, "cache", "verify", "--dir", str(path))["ok"]

    # A shard whose files are damaged: reported by name, moved aside by --repair; the
    # others keep their blocks and every command goes on over the emptied shard.
    shard = path / "shard-0-of-4"
    held = [m for m in metas if shard_of(m.block_hash, 4) == 0 and m.block_hash != victim]
    assert held
    (shard / "data.mdb").write_bytes(b"\x00" * 8192 + (shard / "data.mdb").read_bytes()[8192:])
    report = json.loads(runner.invoke(app, ["cache", "verify", "--dir", str(path),
                                            "--json"]).stdout)
    assert report["files_problem"].startswith("shard-0-of-4: ")
    repaired = _invoke_json(runner, "cache", "verify", "--dir", str(path), "--repair")
    assert repaired["moved_to"] and not (shard / "data.mdb").exists()
    assert _invoke_json(runner, "cache", "verify", "--dir", str(path))["ok"]
    stats = _invoke_json(runner, "cache", "stats", "--dir", str(path))
    assert stats["shards"] == 4 and stats["num_blocks"] == NUM_BLOCKS - 1 - len(held)

    removed = _invoke_json(runner, "cache", "prune", "--dir", str(path), "--max-gb", "0")
    assert removed["num_removed"] == NUM_BLOCKS - 1 - len(held)
    assert _invoke_json(runner, "cache", "clear", "--dir", str(path), "--yes")["num_removed"] == 0
    assert _invoke_json(runner, "cache", "stats", "--dir", str(path))["num_blocks"] == 0
