"""Model loading: errors, random weights, Hugging Face directories, GGUF, the conversion
cache of GGUF files, hub ids from the local Hugging Face cache, one fingerprint for the same
weights however they are named, and the user cache directory."""

from __future__ import annotations

import json
import shutil
import stat

import pytest
import torch
import transformers
from kvtier.engine import paths
from kvtier.engine.config import named_config
from kvtier.engine.loader import (
    SMOLLM2_ALIAS,
    converted_model_dir,
    gguf_conversion_dir,
    load_model,
    resolve_device_dtype,
    smollm2_gguf_path,
)
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert torch.equal(tensor, state_b[name]), name


def save_hf_twin(loaded, directory) -> torch.nn.Module:
    """Save transformers' model holding `loaded`'s weights as an HF directory."""
    hf_model = AutoModelForCausalLM.from_config(loaded.config.to_hf(), dtype=torch.float32)
    hf_model.load_state_dict(loaded.model.state_dict(), strict=False)
    hf_model.save_pretrained(str(directory))
    return hf_model


# ---- errors ---------------------------------------------------------------------------------

def test_missing_paths_and_unknown_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        load_model("gpt-17")
    with pytest.raises(ValueError, match="unknown model config"):
        load_model("random:llama9-1t")
    with pytest.raises(ValueError, match="seed"):
        load_model("random:tiny-llama", seed=-1)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("random:tiny-llama", dtype="float8")


def test_bad_directories_and_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(empty))
    no_weights = tmp_path / "no-weights"
    named_config("tiny-llama").to_hf().save_pretrained(str(no_weights))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(no_weights))
    text_file = tmp_path / "weights.bin"
    text_file.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(text_file))


def test_unsupported_architecture_is_named(tmp_path):
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                   n_positions=32, architectures=["GPT2LMHeadModel"])
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_checkpoint_missing_a_tensor_is_rejected(tmp_path):
    loaded = load_model("random:tiny-llama", seed=0)
    loaded.config.to_hf().save_pretrained(str(tmp_path))
    state = {k: v.contiguous() for k, v in loaded.model.state_dict().items()
             if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(str(tmp_path))
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        load_model(str(tmp_path))


def test_device_and_dtype_resolution():
    assert resolve_device_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cpu", "bf16")[1] == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device_dtype("cuda", "auto")


# ---- random weights and HF directories ------------------------------------------------------

def test_random_models_are_seeded():
    first = load_model("random:tiny-qwen3", seed=7)
    again = load_model("random:tiny-qwen3", seed=7)
    other = load_model("random:tiny-qwen3", seed=8)
    assert first.tokenizer is None and first.config == named_config("tiny-qwen3")
    assert_same_weights(first.model, again.model)
    assert first.model_id == again.model_id
    assert other.model_id != first.model_id
    assert not torch.equal(first.model.model.embed_tokens.weight,
                           other.model.model.embed_tokens.weight)
    half = load_model("random:tiny-qwen3", dtype="bfloat16", seed=7)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert half.model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    assert half.model_id != first.model_id


def test_hf_directory_round_trip(tmp_path):
    source = load_model("random:tiny-qwen2", seed=1)  # tied embeddings, qkv bias
    save_hf_twin(source, tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config == source.config
    assert loaded.tokenizer is None  # no tokenizer files in the directory
    assert_same_weights(loaded.model, source.model)
    assert load_model(str(tmp_path)).model_id == loaded.model_id
    half = load_model(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    # Other weights in the same directory, same file name and size: another identity.
    changed = load_model("random:tiny-qwen2", seed=2)
    save_hf_twin(changed, tmp_path)
    assert load_model(str(tmp_path)).model_id != loaded.model_id


# ---- the smollm2 alias and GGUF files -------------------------------------------------------

def test_smollm2_conversion_is_cached_and_reused(smollm2, kvtier_cache_dir):
    target = converted_model_dir()
    assert target.parent == kvtier_cache_dir / "models"
    weights = target / "model.safetensors"
    before = weights.stat()
    marker = target / "marker"
    marker.write_text("survives a reuse, not a re-conversion")
    stray = target.parent / f".{SMOLLM2_ALIAS}.tmp-crashed"
    stray.mkdir()  # what a crash mid-conversion leaves behind
    again = load_model(SMOLLM2_ALIAS, "cpu", "float32")
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert marker.exists()
    assert again.model_id == smollm2.model_id
    assert again.model_id.startswith("SmolLM2-135M-Instruct.Q4_1@")
    assert_same_weights(again.model, smollm2.model)
    stamp = json.loads((target / "kvtier-source.json").read_text())
    assert stamp["gguf"] == smollm2_gguf_path().name
    for directory in (kvtier_cache_dir, kvtier_cache_dir / "models"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    config = smollm2.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == \
        (30, 576, 9, 3)
    assert config.tie_word_embeddings and 2 in config.eos_token_ids
    text = "Hello, world!"
    assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(text)) == text


def test_gguf_file_loads_the_same_weights(smollm2):
    loaded = load_model(str(smollm2_gguf_path()), "cpu", "float32")
    assert loaded.config == smollm2.config
    assert loaded.model_id.startswith("SmolLM2-135M-Instruct.Q4_1@")
    assert_same_weights(loaded.model, smollm2.model)
    prompt = "The capital of France is"
    assert loaded.tokenizer.encode(prompt) == smollm2.tokenizer.encode(prompt)


def test_any_gguf_conversion_is_cached_by_content(smollm2, kvtier_cache_dir, tmp_path):
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(smollm2_gguf_path(), copy)
    models = kvtier_cache_dir / "models"
    target = converted_model_dir()  # the alias's conversion, made by the smollm2 fixture
    assert gguf_conversion_dir(copy) == target and target.parent == models
    before = sorted(p.name for p in models.iterdir())
    weights = (target / "model.safetensors").stat()
    loaded = load_model(str(copy), "cpu", "float32")
    # The same bytes under another name and path: the conversion is reused, not redone
    # (same inode, same mtime, no new directory).
    assert (target / "model.safetensors").stat().st_ino == weights.st_ino
    assert (target / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns
    assert sorted(p.name for p in models.iterdir()) == before
    assert loaded.fingerprint == smollm2.fingerprint
    assert_same_weights(loaded.model, smollm2.model)
    # Edit the file: its content hash, and so its conversion directory, change.
    with open(copy, "ab") as handle:
        handle.write(b"\0" * 32)
    assert gguf_conversion_dir(copy) != target


def test_alias_gguf_path_and_converted_directory_share_cached_blocks(smollm2, tmp_path):
    from kvtier.engine import LLM, SamplingParams

    from kvtier.stats import Tier

    names = [SMOLLM2_ALIAS, str(smollm2_gguf_path()), str(converted_model_dir())]
    fingerprints = {load_model(name, "cpu", "float32").fingerprint for name in names}
    assert fingerprints == {smollm2.fingerprint}
    assert smollm2.fingerprint.startswith("gguf:")
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full blocks
    params = SamplingParams(max_tokens=2)
    found, answers = [], []
    for name in names:
        with LLM(name, device="cpu", gpu_blocks=32, host_cache=False,
                 disk_cache_dir=tmp_path / "kv", disk_cache_gb=0.5) as llm:
            (output,) = llm.generate(prompt, params)
            # Blocks the lookup found on disk: one namespace for all three names.
            found.append(llm.stats().tiers[Tier.DISK].hits)
            answers.append(output.outputs[0].token_ids)
    assert found[0] == 0 and found[1] > 0 and found[2] == found[1]
    assert answers[1] == answers[2] == answers[0]


def make_hub_cache(root, repo: str, source) -> str:
    """A local Hugging Face cache holding `repo` as a copy of directory `source`, laid out
    as huggingface_hub lays it out (refs/main -> snapshots/<commit>)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / ("models--" + repo.replace("/", "--"))
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    shutil.copytree(source, snapshot, ignore=shutil.ignore_patterns("kvtier-source.json"))
    return commit


def test_hub_ids_come_from_the_local_cache_only(smollm2, tmp_path, monkeypatch):
    hub = tmp_path / "hf" / "hub"
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    commit = make_hub_cache(hub, repo, converted_model_dir())
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(repo, "cpu", "float32")
    assert loaded.model_id.startswith("SmolLM2-135M-Instruct@")
    assert_same_weights(loaded.model, smollm2.model)
    assert loaded.tokenizer.encode("Hello") == smollm2.tokenizer.encode("Hello")
    assert load_model(f"{repo}@{commit}", "cpu", "float32").fingerprint == loaded.fingerprint
    # A directory is fingerprinted by its contents: a copy elsewhere is the same model.
    copy = tmp_path / "copy"
    shutil.copytree(hub / f"models--{repo.replace('/', '--')}" / "snapshots" / commit, copy)
    assert load_model(str(copy), "cpu", "float32").fingerprint == loaded.fingerprint
    # Absent from the cache: one clear error, and nothing is fetched.
    with pytest.raises(FileNotFoundError) as info:
        load_model("HuggingFaceTB/SmolLM2-360M-Instruct", "cpu", "float32")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and str(hub) in message
    assert "hf download HuggingFaceTB/SmolLM2-360M-Instruct" in message
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model(repo, "cpu", "float32")


# ---- the user cache directory ---------------------------------------------------------------

def test_cache_dir_precedence_and_permissions(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "explicit"
    assert stat.S_IMODE((tmp_path / "explicit").stat().st_mode) == 0o700
    monkeypatch.delenv("KVTIER_CACHE_DIR")
    assert paths.cache_dir() == tmp_path / "xdg" / "kvtier"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir(create=False) == tmp_path / "home" / ".cache" / "kvtier"
    assert not (tmp_path / "home").exists()
    assert paths.models_dir() == tmp_path / "home" / ".cache" / "kvtier" / "models"
    assert stat.S_IMODE(paths.models_dir().stat().st_mode) == 0o700
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocker))
    with pytest.raises(OSError, match="not a directory"):
        paths.cache_dir()
