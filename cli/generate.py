"""`kvtier generate`: run prompts through the embedded engine with the KV tiers on.

    kvtier generate "What is LMDB?" --max-tokens 64
    kvtier generate --prompt-file prompts.json --json --no-disk-cache

A prompt file holds a JSON list of strings, or one prompt per line. With --json exactly one
JSON object is printed: the model, one entry per prompt (token ids, text, finish reason,
time to first token, cached tokens per tier, computed tokens) and the tier counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from kvtier.cli.common import print_json, print_table
from kvtier.engine.engine_config import EngineConfig
from kvtier.engine.llm import LLM, resolve_device
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampler import SamplingParams

from kvtier.layout import parse_dtype
from kvtier.stats import ManagerStats

DTYPES = ("auto", "float32", "bfloat16", "float16")


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from a JSON list of strings, or one prompt per non-empty line.

    Raises OSError when the file cannot be read and ValueError when it is not UTF-8 text,
    holds no prompt, or a JSON value that is not a list of strings.
    """
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {exc.start}: "
                         f"{exc.reason}); save it as UTF-8") from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompt file {path} starts with '[' but is not valid JSON "
                             f"({exc.msg} at line {exc.lineno}); give a JSON list of strings "
                             "or one prompt per line") from None
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"prompt file {path}: the JSON value must be a list of strings")
        prompts = value
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompt")
    return prompts


def stats_dict(stats: ManagerStats) -> dict[str, Any]:
    """The tier manager's counters as plain JSON-ready values."""
    tiers: dict[str, Any] = {
        tier.value: {"hits": s.hits, "misses": s.misses, "failures": s.failures,
                     "rejected": s.rejected}
        for tier, s in stats.tiers.items()
    }
    pool = stats.pool
    tiers["gpu"].update(num_blocks=pool.num_blocks, num_free=pool.num_free,
                        num_cached=pool.num_cached, evictions=pool.evictions)
    tiers["host"].update(num_slots=stats.host_slots, num_free=stats.host_free_slots,
                         num_cached=stats.host_cached)
    if stats.disk is not None:
        tiers["disk"].update(num_blocks=stats.disk.num_blocks,
                             bytes_used=stats.disk.bytes_used,
                             budget_bytes=stats.disk.budget_bytes)
    transfers = {
        direction.value: {"jobs": t.num_jobs, "bytes": t.num_bytes, "seconds": t.seconds,
                          "failures": t.failures}
        for direction, t in stats.transfers.items()
    }
    return {**tiers, "transfers": transfers}


def output_dict(output: RequestOutput) -> dict[str, Any]:
    """One `outputs` entry of the --json object."""
    entry = output.to_dict()
    entry.pop("request_id")
    return entry


def engine_options(model: str, device: str, dtype: str, block_size: int,
                   gpu_blocks: int | None, host_cache_gb: float, no_host_cache: bool,
                   disk_cache: Path | None, no_disk_cache: bool,
                   disk_cache_gb: float) -> dict[str, Any]:
    """`LLM` keyword arguments from the model and cache options of `generate` (which
    `kvtier serve` shares under the same names). Raises ValueError for a bad or
    contradictory option, before any model is loaded."""
    if disk_cache is not None and no_disk_cache:
        raise ValueError("--disk-cache and --no-disk-cache contradict each other; pick one")
    if dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if dtype != "auto":
        parse_dtype(dtype)
    resolve_device(device)
    options: dict[str, Any] = {
        "block_size": block_size, "gpu_blocks": gpu_blocks, "host_cache": not no_host_cache,
        "host_cache_gb": host_cache_gb, "disk_cache": not no_disk_cache,
        "disk_cache_dir": disk_cache, "disk_cache_gb": disk_cache_gb}
    EngineConfig(**options)  # reject bad sizes before the model is loaded
    return {"model": model, "device": device, "dtype": dtype, **options}


def generate(
    prompts: list[str] | None = typer.Argument(None, help="Prompts (each one request)."),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="A JSON list of strings, or one prompt per line."),
    model: str = typer.Option("smollm2-135m", "--model",
                              help="Alias, Hugging Face directory, .gguf file or random:<name>."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past EOS."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    gpu_blocks: int | None = typer.Option(
        None, "--gpu-blocks", help="GPU KV blocks (default: half the free device memory)."),
    host_cache_gb: float = typer.Option(1.0, "--host-cache-gb", help="Host tier size, GiB."),
    no_host_cache: bool = typer.Option(False, "--no-host-cache", help="Turn the host tier off."),
    disk_cache: Path | None = typer.Option(
        None, "--disk-cache", help="Disk tier directory (default: <user cache dir>/kv)."),
    no_disk_cache: bool = typer.Option(False, "--no-disk-cache", help="Turn the disk tier off."),
    disk_cache_gb: float = typer.Option(10.0, "--disk-cache-gb", help="Disk tier budget, GiB."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Generate text for PROMPTs with the tiered KV cache."""
    texts = list(prompts or [])
    if prompt_file is not None:
        texts += read_prompt_file(prompt_file)
    if not texts:
        raise ValueError("no prompt given; pass PROMPT arguments or --prompt-file FILE")
    options = engine_options(model=model, device=device, dtype=dtype, block_size=block_size,
                             gpu_blocks=gpu_blocks, host_cache_gb=host_cache_gb,
                             no_host_cache=no_host_cache, disk_cache=disk_cache,
                             no_disk_cache=no_disk_cache, disk_cache_gb=disk_cache_gb)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, ignore_eos=ignore_eos)
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    with LLM(**options) as llm:
        outputs = llm.generate(texts, params, raw=raw)
        stats = stats_dict(llm.stats())
        model_id = llm.model_id
    if json_output:
        print_json({"model": model_id, "outputs": [output_dict(o) for o in outputs],
                    "stats": stats})
        return
    for index, output in enumerate(outputs):
        typer.echo(f"--- [{index}] {output.finish_reason}, {len(output.token_ids)} tokens")
        typer.echo(output.text)
    rows = []
    for index, output in enumerate(outputs):
        m = output.metrics
        ttft = "-" if m.ttft_s is None else f"{m.ttft_s * 1000:.0f}"
        rows.append((index, len(output.prompt_token_ids), len(output.token_ids), ttft,
                     m.cached_tokens_gpu, m.cached_tokens_host, m.cached_tokens_disk,
                     m.computed_tokens))
    print_table(f"kvtier generate ({model_id})",
                ("#", "prompt", "generated", "ttft ms", "gpu", "host", "disk", "computed"),
                rows)
