"""`kvtier generate`: run prompts through the embedded engine with the KV tiers on.

    kvtier generate "What is LMDB?" --max-tokens 64
    kvtier generate "The capital of France is" --raw
    kvtier generate --prompt-file prompts.json --json --no-disk-cache --config kvtier.yaml

Prompts go through the model's chat template as one user turn each (after `--system`, when
given), as `vllm chat` does; `--raw` sends them as they are (`LLM.generate`). A prompt file
holds a JSON list of strings, or one prompt per line. Engine settings come from the options,
then the `--config` YAML file, then `KVTIER_*` variables (see `EngineConfig`). Answers go to
stdout and the statistics table to stderr; with --json exactly one JSON object is printed
on stdout: the model, one entry per prompt (token ids, text, finish reason, time to first
token, cached tokens per tier, computed tokens) and the tier counters.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import typer
from kvtier.cli.common import print_json, print_table
from kvtier.engine.config_sources import load_engine_config
from kvtier.engine.engine_config import AttnBackend, DType, HashAlgorithm
from kvtier.engine.llm import LLM
from kvtier.engine.loader import resolve_device
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampler import SamplingParams

from kvtier.stats import ManagerStats


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
                             budget_bytes=stats.disk.budget_bytes,
                             durable=stats.disk.durable, syncs=stats.disk.syncs)
    transfers = {
        direction.value: {"jobs": t.num_jobs, "bytes": t.num_bytes, "seconds": t.seconds,
                          "failures": t.failures}
        for direction, t in stats.transfers.items()
    }
    if stats.remote is not None:
        tiers["remote"].update(dataclasses.asdict(stats.remote))
    return {**tiers, "transfers": transfers}


def output_dict(output: RequestOutput) -> dict[str, Any]:
    """One `outputs` entry of the --json object."""
    entry = output.to_dict()
    entry.pop("request_id")
    return entry


def engine_options(config: Path | None, model: str | None, device: str | None,
                   dtype: str | None, block_size: int | None, gpu_blocks: int | None,
                   gpu_memory_utilization: float | None, max_model_len: int | None,
                   max_num_seqs: int | None, max_num_batched_tokens: int | None,
                   host_cache_gb: float | None, no_host_cache: bool,
                   disk_cache: Path | None, no_disk_cache: bool, disk_cache_gb: float | None,
                   disk_durable: bool | None, hash_algorithm: str | None, cache_salt: str | None,
                   attn_backend: str | None, remote_cache: str | None,
                   deterministic: bool = False,
                   long_prefill_token_threshold: int | None = None) -> dict[str, Any]:
    """`LLM` keyword arguments from the model and cache options of `generate` (which
    `kvtier serve` shares under the same names); options left None come from the config
    file, the environment or the defaults. Raises ValueError for a bad or contradictory
    option, before any model is loaded."""
    if disk_cache is not None and no_disk_cache:
        raise ValueError("--disk-cache and --no-disk-cache contradict each other; pick one")
    options: dict[str, Any] = {
        "model": model, "device": device, "dtype": dtype, "block_size": block_size,
        "gpu_blocks": gpu_blocks, "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "host_cache": False if no_host_cache else None, "host_cache_gb": host_cache_gb,
        "disk_cache": False if no_disk_cache else None, "disk_cache_dir": disk_cache,
        "disk_cache_gb": disk_cache_gb, "disk_durable": disk_durable,
        "hash_algorithm": hash_algorithm,
        "cache_salt": cache_salt, "attn_backend": attn_backend,
        "remote_cache": remote_cache, "deterministic": True if deterministic else None}
    settings = load_engine_config(options, config)  # reject bad settings before loading
    resolve_device(settings.device)
    return {"config": config, **options}


def generate(
    prompts: list[str] | None = typer.Argument(None, help="Prompts (each one request)."),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="A JSON list of strings, or one prompt per line."),
    config: Path | None = typer.Option(
        None, "--config", help="A YAML file of engine settings (EngineConfig's field names)."),
    model: str | None = typer.Option(
        None, "--model", help="Alias, Hugging Face hub id (local cache), model directory, "
        ".gguf file or random:<name>. (default: smollm2-135m)"),
    raw: bool = typer.Option(False, "--raw", help="Send prompts as they are, without the "
                             "chat template."),
    system: str | None = typer.Option(None, "--system",
                                      help="A system prompt before each prompt (chat only)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p times the "
                                "most likely one's probability (0 = off)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty",
                                             help="> 1 discourages repeats (1 = off)."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past EOS."),
    device: str | None = typer.Option(None, "--device",
                                      help="auto, cpu, cuda or cuda:N. (default: auto)"),
    dtype: DType | None = typer.Option(None, "--dtype", help="(default: auto)"),
    block_size: int | None = typer.Option(None, "--block-size",
                                          help="Tokens per KV block. (default: 16)"),
    gpu_blocks: int | None = typer.Option(
        None, "--gpu-blocks", help="KV blocks of the device pool (default: sized from "
        "--gpu-memory-utilization on CUDA, from the context and batch on the CPU)."),
    gpu_memory_utilization: float | None = typer.Option(
        None, "--gpu-memory-utilization", help="Share of the device memory free after "
        "loading the model that the KV pool takes (vLLM's counts the whole GPU). "
        "(default: 0.5)"),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Tokens of prompt plus output per request. "
        "(default: the model's context)"),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs",
                                            help="Requests running in one step. (default: 64)"),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", help="Tokens run in one step. (default: 2048)"),
    long_prefill_token_threshold: int | None = typer.Option(
        None, "--long-prefill-token-threshold", help="While other prompts wait to start or "
        "are part-way through, a prompt computes at most this many tokens a step, so short "
        "prompts are not held behind every chunk of a long one; 0: no cap. (default: 0)"),
    host_cache_gb: float | None = typer.Option(None, "--host-cache-gb",
                                               help="Host tier size, GiB. (default: 1.0)"),
    no_host_cache: bool = typer.Option(False, "--no-host-cache", help="Turn the host tier off."),
    disk_cache: Path | None = typer.Option(
        None, "--disk-cache", help="Disk tier directory (default: <user cache dir>/kv)."),
    no_disk_cache: bool = typer.Option(False, "--no-disk-cache", help="Turn the disk tier off."),
    disk_cache_gb: float | None = typer.Option(None, "--disk-cache-gb",
                                               help="Disk tier budget, GiB. (default: 10.0)"),
    disk_durable: bool | None = typer.Option(
        None, "--disk-durable/--no-disk-durable", show_default=False,
        help="fsync every disk tier write transaction. Off: the OS writes blocks back (synced "
        "every GiB and at exit), an OS crash or power loss may lose recent blocks, which "
        "then miss. (default: off)"),
    hash_algorithm: HashAlgorithm | None = typer.Option(
        None, "--hash-algorithm", help="Block hash; sha256 where tenants do not trust each "
        "other. (default: xxh3_128)"),
    cache_salt: str | None = typer.Option(
        None, "--cache-salt", help="Salt of the cache namespace: requests with another salt "
        "never share cached blocks with these."),
    attn_backend: AttnBackend | None = typer.Option(None, "--attn-backend",
                                                    help="(default: auto)"),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
    deterministic: bool = typer.Option(
        False, "--deterministic", help="Batch-invariant kernels: the same logits, bit for "
        "bit, whatever the batch, chunking or cache tier (also KVTIER_DETERMINISTIC=1)."),
    remote_cache: str | None = typer.Option(
        None, "--remote-cache", help="Shared remote tier below the disk: a Redis URL "
        "(redis://host:port/0, rediss://..., redis+cluster://host:port)."),
) -> None:
    """Generate text for PROMPTs with the tiered KV cache."""
    texts = list(prompts or [])
    if prompt_file is not None:
        texts += read_prompt_file(prompt_file)
    if not texts:
        raise ValueError("no prompt given; pass PROMPT arguments or --prompt-file FILE")
    if raw and system is not None:
        raise ValueError("--system needs the chat template; drop --raw or --system")
    options = engine_options(
        config=config, model=model, device=device, dtype=dtype, block_size=block_size,
        gpu_blocks=gpu_blocks, gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, host_cache_gb=host_cache_gb,
        no_host_cache=no_host_cache, disk_cache=disk_cache, no_disk_cache=no_disk_cache,
        disk_cache_gb=disk_cache_gb, disk_durable=disk_durable, hash_algorithm=hash_algorithm,
        cache_salt=cache_salt, attn_backend=attn_backend, remote_cache=remote_cache,
        deterministic=deterministic, long_prefill_token_threshold=long_prefill_token_threshold)
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                            seed=seed, ignore_eos=ignore_eos)
    if sys.stderr.isatty():  # a person waiting at a terminal; scripts keep one error line
        typer.echo("kvtier generate: loading the model and warming up ...", err=True)
    with LLM(**options) as llm:
        if raw:
            outputs = llm.generate(texts, params)
        else:
            head = [] if system is None else [{"role": "system", "content": system}]
            outputs = llm.chat([[*head, {"role": "user", "content": text}] for text in texts],
                               params)
        stats = stats_dict(llm.stats())
        model_id = llm.model_id
    if json_output:
        print_json({"model": model_id, "outputs": [output_dict(o) for o in outputs],
                    "stats": stats})
        return
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        typer.echo(f"--- [{index}] {completion.finish_reason}, "
                   f"{len(completion.token_ids)} tokens")
        typer.echo(completion.text)
    rows = []
    for index, output in enumerate(outputs):
        m = output.metrics
        ttft = "-" if m.ttft_s is None else f"{m.ttft_s * 1000:.0f}"
        rows.append((index, len(output.prompt_token_ids), len(output.outputs[0].token_ids),
                     ttft, m.cached_tokens_gpu, m.cached_tokens_host, m.cached_tokens_disk,
                     m.computed_tokens) + ((m.cached_tokens_remote,) if remote_cache else ()))
    print_table(f"kvtier generate ({model_id})",
                ("#", "prompt", "generated", "ttft ms", "gpu", "host", "disk", "computed")
                + (("remote",) if remote_cache else ()), rows, err=True)
