"""`kvtier cache stats|inspect|verify|clear --remote URL` on a real Redis server and cluster,
and the remote options' bad input."""

from __future__ import annotations

import json
import time

import pytest
import redis
from kvtier.cli.main import app
from typer.testing import CliRunner

from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.tier import RemoteTier
from tests.kvtier.disk_cases import LARGE, SMALL, make_blocks


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(params=["redis_server", "redis_cluster"])
def filled(request: pytest.FixtureRequest):
    """(url, prefix, tier) with 6 SMALL and 2 LARGE blocks under a prefix of this test."""
    url = request.getfixturevalue(request.param).url
    prefix = f"c{time.time_ns()}"
    tier = RemoteTier(RemoteConfig(url, key_prefix=prefix), SMALL)
    other = RemoteTier(RemoteConfig(url, key_prefix=prefix), LARGE)
    assert all(tier.put(*make_blocks(SMALL, seed=1, num_blocks=6)))
    assert all(other.put(*make_blocks(LARGE, seed=2, num_blocks=2)))
    other.close()
    yield url, prefix, tier
    tier.close()


def _invoke(runner: CliRunner, *args: str):
    return runner.invoke(app, ["cache", *args])


def test_stats_inspect_verify_clear(runner, filled) -> None:
    url, prefix, tier = filled
    result = _invoke(runner, "stats", "--remote", url, "--key-prefix", prefix, "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["num_blocks"] == 8 and len(stats["layouts"]) == 2
    assert {e["num_blocks"] for e in stats["layouts"]} == {6, 2}
    result = _invoke(runner, "inspect", "--remote", url, "--key-prefix", prefix, "--limit", "5",
                     "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 5 and all(r["status"] == "ok" and r["num_tokens"] for r in rows)
    assert _invoke(runner, "verify", "--remote", url, "--key-prefix", prefix).exit_code == 0

    # Damage one value: verify finds it (exit 1), --repair removes it.
    key = next(tier.iter_keys())
    client = tier.nodes.route([key])[0][0].client
    client.setrange(key, 200, b"\xff\xfe")
    result = _invoke(runner, "verify", "--remote", url, "--key-prefix", prefix, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [b["key"] for b in report["bad"]] == [key.decode()]
    result = _invoke(runner, "verify", "--remote", url, "--key-prefix", prefix, "--repair")
    assert result.exit_code == 0 and "repaired" in result.stdout
    assert client.exists(key) == 0

    result = _invoke(runner, "clear", "--remote", url, "--key-prefix", prefix, "-y", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == {"num_removed": 7}
    assert list(tier.iter_keys(all_layouts=True)) == []


def test_clear_leaves_other_prefixes_alone(runner, redis_server) -> None:
    client = redis.Redis(port=redis_server.port)
    client.set("someone-else:key", b"x")
    result = _invoke(runner, "clear", "--remote", redis_server.url, "--key-prefix", "nothing",
                     "-y")
    assert result.exit_code == 0 and "removed 0 blocks" in result.stdout
    assert client.get("someone-else:key") == b"x"


@pytest.mark.parametrize("args, message", [
    (["cache", "stats", "--remote", "ftp://host:1"], "scheme must be one of"),
    (["cache", "stats", "--remote", "redis://127.0.0.1:1/0"], "cannot reach the remote cache"),
    (["cache", "stats", "--remote", "redis://127.0.0.1:1/0", "--key-prefix", "a b"],
     "key_prefix"),
    (["generate", "--model", "random:tiny-llama", "--device", "cpu", "--remote-cache",
      "http://x:1", "hi"], "scheme must be one of"),
])
def test_bad_remote_options_are_one_line_errors(runner, args, message) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
