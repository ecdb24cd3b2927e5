"""Bad input: every option of the `kvtier` commands and every argument of the library API
that can be wrong gets a clear message and a non-zero exit (or a ValueError / OSError),
never a traceback.

CLI cases run through CliRunner on a tiny random Llama saved with a byte-level tokenizer
and a chat template (so text prompts work and a prompt can outgrow its 1024-token
context); one case runs `python -m kvtier.cli.main` in a real subprocess.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvtier.cli.main import app
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model
from typer.testing import CliRunner

from kvtier.config import TierConfig
from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta
from tests.cli.chat_model import save_chat_model
from tests.model_cache import seed_model_cache

REPO_ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module", autouse=True)
def private_cache_dir(tmp_path_factory, smollm2_conversion) -> Iterator[Path]:
    path = seed_model_cache(tmp_path_factory.mktemp("kvtier-cache"), smollm2_conversion)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIER_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """tiny-llama (1024-token context) with random weights and a byte-level tokenizer."""
    return save_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """Files and directories that are wrong in every way a path can be."""
    root = tmp_path_factory.mktemp("bad")
    made = {"file": root / "a-file", "empty prompts": root / "empty.txt",
            "binary prompts": root / "binary.txt", "bad json": root / "bad.json",
            "text model": root / "model.txt", "bad gguf": root / "model.gguf",
            "world-writable": root / "shared", "damaged cache": root / "damaged",
            "config-less": root / "config-less"}
    made["file"].write_text("not a directory")
    made["empty prompts"].write_text("\n\n")
    made["binary prompts"].write_bytes(b"\xff\xfe\x00 not text")
    made["bad json"].write_text("[1, 2")
    made["text model"].write_text("hello")
    made["bad gguf"].write_bytes(os.urandom(4096))
    made["world-writable"].mkdir()
    os.chmod(made["world-writable"], 0o777)
    made["damaged cache"].mkdir(mode=0o700)
    (made["damaged cache"] / "data.mdb").write_bytes(os.urandom(64 << 10))
    made["config-less"].mkdir()
    return made


def assert_clean_error(result, message: str) -> None:
    """Non-zero exit, no traceback; our errors are one `error:` line on stderr naming the
    problem, the framework's usage errors a framed message."""
    output = result.output + (result.stderr or "")
    assert result.exit_code != 0, output
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    if result.exit_code == 1:
        lines = [line for line in result.stderr.strip().splitlines()
                 if line.startswith("error:")]
        assert len(lines) == 1, result.stderr
        assert message in lines[0], lines[0]
    else:
        assert result.exit_code == 2 and message in output, output


# ---- kvtier generate ---------------------------------------------------------------------

LONG_PROMPT = "x" * 1100  # one token per byte: past the 1024-token context

GENERATE_CASES: dict[str, tuple[Callable[[dict], list[str]], str]] = {
    "model path missing": (lambda p: ["hi", "--model", "/nonexistent/model.gguf"],
                           "does not exist"),
    "model name unknown": (lambda p: ["hi", "--model", "no-such-model"], "unknown model"),
    "model is a text file": (lambda p: ["hi", "--model", str(p["text model"])], "not a .gguf"),
    "model dir without config": (lambda p: ["hi", "--model", str(p["config-less"])],
                                 "no config.json"),
    "model gguf damaged": (lambda p: ["hi", "--model", str(p["bad gguf"])],
                           "cannot load this GGUF"),
    "gpu blocks zero": (lambda p: ["hi", "--gpu-blocks", "0"], "gpu_blocks: must be > 0"),
    "gpu blocks negative": (lambda p: ["hi", "--gpu-blocks", "-3"], "gpu_blocks"),
    "gpu blocks beyond memory": (lambda p: ["hi", "--gpu-blocks", str(1 << 40)],
                                 "GiB of memory are available"),
    "block size zero": (lambda p: ["hi", "--block-size", "0"], "block_size: must be > 0"),
    "block size not a number": (lambda p: ["hi", "--block-size", "abc"], "Invalid value"),
    "disk budget negative": (lambda p: ["hi", "--disk-cache-gb", "-1"], "disk_cache_gb"),
    "disk budget nan": (lambda p: ["hi", "--disk-cache-gb", "nan"], "disk_cache_gb"),
    "host budget infinite": (lambda p: ["hi", "--host-cache-gb", "inf"], "host_cache_gb"),
    "host budget beyond memory": (lambda p: ["hi", "--host-cache-gb", "1000000"],
                                  "are available"),
    "cache path is a file": (lambda p: ["hi", "--disk-cache", str(p["file"])],
                             "is a file, not a directory"),
    "cache path under a file": (lambda p: ["hi", "--disk-cache", str(p["file"] / "kv")],
                                "is a file"),
    "cache dir world-writable": (lambda p: ["hi", "--disk-cache", str(p["world-writable"])],
                                 "writable by group or others"),
    "prompt file missing": (lambda p: ["--prompt-file", "/nonexistent/prompts.txt"],
                            "cannot read prompt file"),
    "prompt file is a directory": (lambda p: ["--prompt-file", str(p["config-less"])],
                                   "cannot read prompt file"),
    "prompt file not utf-8": (lambda p: ["--prompt-file", str(p["binary prompts"])],
                              "not UTF-8"),
    "prompt file empty": (lambda p: ["--prompt-file", str(p["empty prompts"])],
                          "holds no prompt"),
    "prompt file bad json": (lambda p: ["--prompt-file", str(p["bad json"])],
                             "not valid JSON"),
    "no prompt": (lambda p: [], "no prompt given"),
    "max tokens negative": (lambda p: ["hi", "--max-tokens", "-4"], "--max-tokens must be"),
    "temperature negative": (lambda p: ["hi", "--temperature", "-1"], "temperature"),
    "top-p zero": (lambda p: ["hi", "--top-p", "0"], "top_p"),
    "top-k negative": (lambda p: ["hi", "--top-k", "-2"], "top_k"),
    "seed negative": (lambda p: ["hi", "--temperature", "1", "--seed", "-1"], "seed"),
    "device unknown": (lambda p: ["hi", "--device", "tpu"], "unknown device"),
    "dtype unknown": (lambda p: ["hi", "--dtype", "int8"], "'int8' is not one of"),
    "hash algorithm unknown": (lambda p: ["hi", "--hash-algorithm", "md5"], "'md5' is not"),
    "prompt longer than the model": (lambda p: [LONG_PROMPT], "context is 1024"),
    "prompt longer than the gpu budget": (lambda p: ["y" * 100, "--gpu-blocks", "2"],
                                          "GPU block budget is 2"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_rejects(case, model_dir, paths, tmp_path):
    make_args, message = GENERATE_CASES[case]
    args = make_args(paths)
    if "--model" not in args:
        args += ["--model", str(model_dir)]
    if "--device" not in args:
        args += ["--device", "cpu"]
    if "--disk-cache" not in args:
        args += ["--disk-cache", str(tmp_path / "kv")]
    result = CliRunner().invoke(app, ["generate", "--max-tokens", "2", *args])
    assert_clean_error(result, message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda(model_dir):
    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(model_dir),
                                      "--device", "cuda", "--no-disk-cache"])
    assert_clean_error(result, "CUDA is not available")


def test_a_good_generate_still_runs(model_dir, tmp_path):
    """The baseline of the cases above: the same command line, nothing wrong."""
    result = CliRunner().invoke(app, ["generate", "hi", "--max-tokens", "2", "--model",
                                      str(model_dir), "--device", "cpu", "--disk-cache",
                                      str(tmp_path / "kv")])
    assert result.exit_code == 0, result.output


# ---- the other commands --------------------------------------------------------------------

OTHER_CASES: dict[str, tuple[Callable[[dict], list[str]], str]] = {
    "cache stats on a file": (lambda p: ["cache", "stats", "--dir", str(p["file"])],
                              "is a file"),
    "cache stats on nothing": (lambda p: ["cache", "stats", "--dir", "/nonexistent/kv"],
                               "does not exist"),
    "cache stats damaged": (lambda p: ["cache", "stats", "--dir", str(p["damaged cache"])],
                            "damaged"),
    "cache prune negative": (lambda p: ["cache", "prune", "--max-gb", "-1", "--dir",
                                        str(p["config-less"])], "Invalid value"),
    "cache import missing": (lambda p: ["cache", "import", "/nonexistent/x.kvtx", "--dir",
                                        str(p["config-less"])], "does not exist"),
    "cache dir world-writable": (lambda p: ["cache", "stats", "--dir",
                                            str(p["world-writable"])], "writable by group"),
    "soak no requests": (lambda p: ["bench", "soak", "--num-requests", "0"],
                         "--num-requests must be a positive"),
    "soak gpu blocks zero": (lambda p: ["bench", "soak", "--gpu-blocks", "0"],
                             "--gpu-blocks must be positive"),
    "soak gpu budget too small": (lambda p: ["bench", "soak", "--gpu-blocks", "2"],
                                  "cannot hold a prompt"),
    "soak model missing": (lambda p: ["bench", "soak", "--num-requests", "1", "--model",
                                      "/nonexistent/m"], "does not exist"),
    "damage no runs": (lambda p: ["bench", "damage", "--num-runs", "0"],
                       "--num-runs must be positive"),
    "pool no requests": (lambda p: ["bench", "pool", "--num-requests", "0"],
                         "--num-requests must be positive"),
    "serve no rounds": (lambda p: ["bench", "serve", "--model", "random:tiny-llama",
                                   "--device", "cpu", "--num-rounds", "0"],
                        "--num-rounds must be positive"),
    "longctx no tokens": (lambda p: ["bench", "longctx", "--model", "random:tiny-llama",
                                     "--device", "cpu", "--doc-tokens", "0"],
                          "--doc-tokens takes comma-separated positive integers"),
    "demo without a tokenizer": (lambda p: ["demo", "--model", "random:tiny-llama",
                                            "--device", "cpu"], "no tokenizer"),
    "demo device unknown": (lambda p: ["demo", "--device", "tpu"], "unknown device"),
    "unknown option": (lambda p: ["generate", "--frobnicate"], "No such option"),
}


@pytest.mark.parametrize("case", list(OTHER_CASES))
def test_commands_reject(case, paths):
    make_args, message = OTHER_CASES[case]
    assert_clean_error(CliRunner().invoke(app, make_args(paths)), message)


def test_a_real_process_prints_one_line_and_exits_non_zero(tmp_path, private_cache_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "generate", "hi", "--model", "random:tiny-llama",
         "--device", "cpu", "--block-size", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
        env=dict(os.environ, KVTIER_CACHE_DIR=str(private_cache_dir)))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: EngineConfig.block_size: must be > 0, got 0 (tokens per KV block)"]
    assert result.stdout == ""


# ---- the library API -----------------------------------------------------------------------

LAYOUT = KVLayout(2, 2, 8, 4, torch.float16)


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny-llama", "cpu", "float32")


LLM_CASES = {
    "max_num_seqs": dict(max_num_seqs=0),
    "max_num_batched_tokens": dict(max_num_batched_tokens=-1),
    "gpu_memory_utilization": dict(gpu_memory_utilization=1.5),
    "hash_algorithm": dict(hash_algorithm="md5"),
    "attn_backend": dict(attn_backend="cuda-magic"),
    "seed": dict(seed=-1),
    "block_size": dict(block_size=True),
    "host_cache_gb": dict(host_cache_gb=0.0),
    "disk_cache_gb": dict(disk_cache_gb=math.nan),
    "unknown dtype": dict(dtype="int8"),
    "device": dict(device="tpu"),
    "smaller than one block": dict(host_cache_gb=1e-9),
}


@pytest.mark.parametrize("case", list(LLM_CASES))
def test_llm_arguments_are_checked(case, tiny, tmp_path):
    options = dict(gpu_blocks=8, disk_cache_dir=tmp_path / "kv")
    options.update(LLM_CASES[case])
    with pytest.raises(ValueError) as info:
        LLM(tiny, **options)
    field = case.split()[-1] if case in ("unknown dtype",) else case
    assert field in str(info.value) or case == "smaller than one block", str(info.value)
    assert not (tmp_path / "kv").exists(), "a bad option must fail before touching the disk"


def test_request_arguments_are_checked(tiny):
    with LLM(tiny, gpu_blocks=8, host_cache=False, disk_cache=False) as llm:
        for bad, message in (([], "empty"), ([5, 1 << 20], r"\[0, 256\)"), ([-1], r"\[0, 256\)"),
                             ([5] * 200, "GPU block budget"), ([5] * 2000, "context")):
            with pytest.raises(ValueError, match=message):
                llm.add_request(bad, SamplingParams(max_tokens=2))
        with pytest.raises(TypeError, match="SamplingParams"):
            llm.add_request([5, 6], {"max_tokens": 2})
        llm.add_request([5, 6], SamplingParams(max_tokens=1), request_id="x")
        with pytest.raises(ValueError, match="already in use"):
            llm.add_request([5, 6], SamplingParams(max_tokens=1), request_id="x")
    for kwargs, message in ((dict(max_tokens=-1), "max_tokens"),
                            (dict(temperature=math.inf), "temperature"),
                            (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def test_library_arguments_are_checked(tmp_path):
    parent = namespace_hash("m", LAYOUT)
    cases = [
        (lambda: KVLayout(0, 2, 8, 4, torch.float16), "num_layers"),
        (lambda: KVLayout(2, 2, 8, 4, torch.int8), "dtype"),
        (lambda: namespace_hash("", LAYOUT), "model_id"),
        (lambda: namespace_hash("m", LAYOUT, "md5"), "hash algorithm"),
        (lambda: hash_blocks(parent, [1, 2], 0), "block_size"),
        (lambda: hash_blocks(parent, [1, -2, 3, 4], 4), "token ids"),
        (lambda: BlockMeta(b"", parent, (1,)), "block_hash"),
        (lambda: TierConfig(num_gpu_blocks=0), "num_gpu_blocks"),
        (lambda: TierConfig(num_gpu_blocks=4, disk_path=tmp_path), "disk_budget_bytes"),
        (lambda: TierConfig(num_gpu_blocks=4, swap_method="fast"), "swap_method"),
        (lambda: DiskTier(tmp_path / "kv", LAYOUT, 0), "budget_bytes"),
        (lambda: DiskTier(tmp_path / "nowhere", LAYOUT, 1 << 20, readonly=True),
         "does not exist"),
    ]
    for make, message in cases:
        with pytest.raises((ValueError, OSError), match=message):
            make()
