"""Isolation: cached KV blocks are only ever served to the model, layout and tenant that
computed them, and the cache directory is private.

  * Two models of the same shape and the same directory name, but different weights,
    sharing one disk directory, never hit each other's blocks (keys are namespaced by a
    digest of the weights and the layout); neither do two block sizes of one model.
  * A request's `cache_salt` keeps its prefix apart from other tenants' (another salt, or
    none, misses; the same salt hits, on the GPU and from disk after a restart).
  * sha256 block hashes work end to end and live in their own namespace.
  * Cache directories and files are created owner-only, whatever the umask; a directory
    owned by another user, or writable by others, is refused at start-up.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch
import transformers
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.config import named_config
from kvtier.engine.loader import LoadedModel, load_model

from kvtier.stats import Tier

MAX_TOKENS = 5
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_directory(parent: Path, seed: int) -> Path:
    """A Hugging Face directory named "tiny" with seeded random weights of tiny-llama's
    shape; two seeds give two directories that differ only in their weights."""
    config = named_config("tiny-llama")
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config.to_hf(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    directory = parent / "tiny"
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[LoadedModel, LoadedModel]:
    a = load_model(str(hf_directory(tmp_path_factory.mktemp("a"), seed=1)), "cpu", "float32")
    b = load_model(str(hf_directory(tmp_path_factory.mktemp("b"), seed=2)), "cpu", "float32")
    assert a.config == b.config and a.model_id != b.model_id
    assert a.model_id.split("@")[0] == b.model_id.split("@")[0] == "tiny"
    return a, b


@pytest.fixture(scope="module")
def tiny(models) -> LoadedModel:
    return models[0]


def make_prompts(seed: int, num_prompts: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(40, 100))]
            for _ in range(num_prompts)]


def tiers_off(model: LoadedModel, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    with LLM(model, gpu_blocks=128, host_cache=False, disk_cache=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def disk_llm(model: LoadedModel, disk_dir: Path | None, **kwargs) -> LLM:
    """An engine with a disk tier. Fresh, its GPU pool and host tier are empty, so what it
    finds cached comes from disk; the host tier holds every block of a prompt, so all of
    them are written through to disk."""
    bytes_per_block = model.config.kv_layout(kwargs.get("block_size", 16),
                                             torch.float32).bytes_per_block
    # restore_min_saving_s 0: these short prompts compute sooner than a read must save by
    # default, and what is tested is what the reads find.
    options = dict(gpu_blocks=16, host_cache_gb=16 * bytes_per_block / 2**30,
                   disk_cache_dir=disk_dir, disk_cache_gb=0.01, restore_min_saving_s=0.0)
    options.update(kwargs)
    return LLM(model, **options)


def serve(llm: LLM, prompt: list[int], cache_salt: str | None = None):
    """One request through the step interface (the one that takes a salt)."""
    request_id = llm.add_request(prompt, PARAMS, cache_salt=cache_salt)
    while True:
        for output in llm.step():
            if output.request_id == request_id:
                return output


def cached(outputs) -> int:
    return sum(o.metrics.cached_tokens for o in outputs)


# ---- models and layouts --------------------------------------------------------------------

def test_two_models_sharing_a_directory_never_hit_each_others_blocks(models, tmp_path):
    a, b = models
    prompts = make_prompts(1)
    expected_a, expected_b = tiers_off(a, prompts), tiers_off(b, prompts)
    assert expected_a != expected_b, "test setup: the models must answer differently"
    disk_dir = tmp_path / "kv"
    with disk_llm(a, disk_dir) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected_a
    with disk_llm(b, disk_dir) as llm:  # same tokens, same shapes, other weights
        outputs = [serve(llm, p) for p in prompts]
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected_b
    assert cached(outputs) == 0
    assert stats.tiers[Tier.DISK].hits == 0 and stats.disk.rejected == 0
    assert stats.disk.num_blocks > 0
    with disk_llm(a, disk_dir) as llm:  # A's blocks are still there, and B's beside them
        outputs = [serve(llm, p) for p in prompts]
        assert llm.stats().disk.rejected == 0
    assert [o.outputs[0].token_ids for o in outputs] == expected_a
    assert sum(o.metrics.cached_tokens_disk for o in outputs) > 0


def test_two_block_sizes_of_one_model_never_hit_each_others_blocks(tiny, tmp_path):
    prompts = make_prompts(2)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    with disk_llm(tiny, disk_dir, block_size=16) as llm:
        llm.generate(prompts, PARAMS)
    with disk_llm(tiny, disk_dir, block_size=8) as llm:
        outputs = [serve(llm, p) for p in prompts]
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert cached(outputs) == 0 and stats.disk.rejected == 0


# ---- tenants -------------------------------------------------------------------------------

def test_cache_salt_keeps_tenants_prefixes_apart(tiny, tmp_path):
    prompt = make_prompts(3, num_prompts=1)[0]
    (expected,) = tiers_off(tiny, [prompt])
    num_full = (len(prompt) - 1) // 16 * 16  # prompt tokens in full, cacheable blocks
    disk_dir = tmp_path / "kv"
    with disk_llm(tiny, disk_dir, gpu_blocks=64) as llm:
        first = serve(llm, prompt, cache_salt="tenant-a")
        other = serve(llm, prompt, cache_salt="tenant-b")
        unsalted = serve(llm, prompt)
        same = serve(llm, prompt, cache_salt="tenant-a")
    assert [o.outputs[0].token_ids for o in (first, other, unsalted, same)] == [expected] * 4
    assert first.metrics.cached_tokens == 0
    assert other.metrics.cached_tokens == 0 and unsalted.metrics.cached_tokens == 0
    assert same.metrics.cached_tokens_gpu == num_full
    # After a restart, from disk: only tenant A's salt finds tenant A's prefix.
    with disk_llm(tiny, disk_dir) as llm:
        stranger = serve(llm, prompt, cache_salt="tenant-c")
        assert llm.stats().tiers[Tier.DISK].hits == 0  # looked up: no block found
        owner = serve(llm, prompt, cache_salt="tenant-a")
        # Every full block found on disk (how many were loaded rather than computed is the
        # meeting point of the restore: tests/engine/test_bidirectional_restore.py).
        assert llm.stats().tiers[Tier.DISK].hits == num_full // 16
        assert llm.stats().disk.rejected == 0
    assert stranger.outputs[0].token_ids == owner.outputs[0].token_ids == expected
    assert stranger.metrics.cached_tokens == 0
    assert owner.metrics.cached_tokens_gpu == owner.metrics.cached_tokens_host == 0


def test_sha256_block_hashes_end_to_end(tiny, tmp_path):
    prompts = make_prompts(4)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    with disk_llm(tiny, disk_dir, hash_algorithm="sha256") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    env = lmdb.open(str(disk_dir), max_dbs=8, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        key_lengths = {len(key) for key, _ in txn.cursor()}
    env.close()
    assert key_lengths == {32}
    with disk_llm(tiny, disk_dir, hash_algorithm="sha256") as llm:
        restored = [serve(llm, p) for p in prompts]
    assert [o.outputs[0].token_ids for o in restored] == expected
    assert sum(o.metrics.cached_tokens_disk for o in restored) > 0
    with disk_llm(tiny, disk_dir) as llm:  # xxh3_128: another namespace
        other = [serve(llm, p) for p in prompts]
        assert llm.stats().disk.rejected == 0
    assert [o.outputs[0].token_ids for o in other] == expected and cached(other) == 0


# ---- the cache directory -------------------------------------------------------------------

@pytest.fixture
def umask_zero() -> Iterator[None]:
    """The most permissive umask: whatever kvtier creates gets only the bits it asks for."""
    before = os.umask(0)
    yield
    os.umask(before)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cache_directories_and_files_are_owner_only(tiny, tmp_path, monkeypatch, umask_zero):
    monkeypatch.delenv("KVTIER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with disk_llm(tiny, None) as llm:  # the default directory: <cache dir>/kv
        llm.generate(make_prompts(5, num_prompts=1), PARAMS)
        disk_dir = llm.manager.disk.path
    assert disk_dir == tmp_path / "xdg" / "kvtier" / "kv"
    for directory in (tmp_path / "xdg", tmp_path / "xdg" / "kvtier", disk_dir):
        assert mode_of(directory) == 0o700, directory
    files = sorted(p.name for p in disk_dir.iterdir())
    assert files == ["data.mdb", "lock.mdb"]
    for name in files:
        assert mode_of(disk_dir / name) == 0o600, name


def foreign_directory(tmp_path: Path) -> Path:
    """A directory owned by another user: made and given away when running as root, else
    one the system owns."""
    if os.geteuid() == 0:
        directory = tmp_path / "foreign"
        directory.mkdir(mode=0o700)
        os.chown(directory, 4242, 4242)
        return directory
    for candidate in (Path("/"), Path("/usr")):
        if candidate.stat().st_uid != os.geteuid():
            return candidate
    pytest.skip("no directory owned by another user to test with")


@pytest.mark.parametrize("case", ["world-writable", "group-writable", "foreign owner",
                                  "link to a foreign directory"])
def test_an_unsafe_cache_directory_is_refused_at_start_up(tiny, tmp_path, case):
    if case.endswith("writable"):
        disk_dir = tmp_path / "shared"
        disk_dir.mkdir()
        os.chmod(disk_dir, 0o777 if case.startswith("world") else 0o770)
        message = "writable by group or others"
    elif case == "foreign owner":
        disk_dir = foreign_directory(tmp_path)
        message = "owned by uid"
    else:
        disk_dir = tmp_path / "link"
        disk_dir.symlink_to(foreign_directory(tmp_path), target_is_directory=True)
        message = "owned by uid"
    before = sorted(disk_dir.iterdir()) if os.access(disk_dir, os.R_OK) else None
    with pytest.raises(PermissionError, match=message):
        disk_llm(tiny, disk_dir)
    if before is not None:
        assert sorted(disk_dir.iterdir()) == before, "files were created in a refused directory"
