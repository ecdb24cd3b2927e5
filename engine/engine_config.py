"""EngineConfig: every setting of one engine instance (model, blocks, budgets, tiers, hashing).

This is the one configuration model. The CLI's options, `LLM(...)`'s keywords, a YAML file
(`--config kvtier.yaml`, `LLM(config=...)`, or `$KVTIER_CONFIG`) and `KVTIER_<FIELD>`
environment variables all feed it, in that order of precedence
(`kvtier.engine.config_sources.load_engine_config`). Sizes are given the way people think
about them (GiB for memory, tokens for budgets) and checked once here, so the scheduler and
the tier manager can trust them. This module does not import torch.

Knobs named after vLLM's, and where kvtier's meaning differs:
  * `gpu_memory_utilization`: vLLM's is the share of the *whole* GPU the instance may use
    (weights, activations and KV). kvtier's is the share of the device memory still free
    after the model is loaded that the KV block pool takes. On the CPU it is not used: the
    pool is sized from `max_model_len` and `max_num_seqs` instead (RAM is shared with
    everything else on the machine).
  * `max_model_len`: as vLLM's (prompt plus generated tokens of one request), default the
    model's own context; it may only lower it.
  * `max_num_batched_tokens`, `max_num_seqs`: as vLLM's (tokens and sequences per step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

from kvtier.engine import paths
from kvtier.engine.restore_rates import MIN_SAVING_S
from pydantic import Field, field_validator

from kvtier.config import DEFAULT_READ_RESERVE_SHARE
from kvtier.tiers.disk.shard_layout import (
    LARGE_BUDGET_SHARDS,
    MAX_SHARDS,
    SHARDING_BUDGET_BYTES,
)
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.validation import CheckedModel

AttnBackend = Literal["auto", "torch", "triton", "cudnn", "flash"]
ATTN_BACKENDS: tuple[str, ...] = get_args(AttnBackend)
DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)
#: Block hash functions (`kvtier.hashing.HASH_ALGORITHMS`, repeated here so that reading
#: the settings does not import the hashing code).
HashAlgorithm = Literal["xxh3_128", "sha256"]

GIB = 1 << 30

_PositiveInt = Annotated[int, Field(gt=0)]
_PositiveGiB = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class EngineConfig(CheckedModel):
    """How the engine loads its model, schedules, and where it keeps KV blocks.

    model: alias ("smollm2-135m"), Hugging Face hub id (from the local cache), model
        directory, .gguf file, or "random:<name>".
    device: "auto", "cpu", "cuda" or "cuda:N". dtype: "auto" (float32 on CPU, bfloat16 on
        CUDA), "float32", "bfloat16" or "float16".
    block_size: tokens per KV block.
    gpu_blocks: exact number of GPU (device) blocks; None sizes the pool (see the module
        docstring for `gpu_memory_utilization` and the CPU).
    gpu_memory_utilization: share of the free device memory the KV pool takes (CUDA).
    max_model_len: cap on one request's prompt plus generated tokens; None: the model's.
    max_num_seqs: cap on requests running in one step.
    max_num_batched_tokens: token budget of one step (prefill chunks plus decodes).
    long_prefill_token_threshold: while other prompts wait to start (a seat free) or are
        part-way through, a prompt computes at most this many tokens a step, and the rest of
        the budget goes to them (a short prompt is not held behind every chunk of a long one);
        0: no cap, first come first served.
    host_cache / host_cache_gb: the pinned host tier and its size in GiB.
    disk_cache / disk_cache_dir / disk_cache_gb: the LMDB tier, its directory (None: the
        user cache directory) and its budget in GiB.
    disk_durable: fsync every write transaction of the disk tier. Off (the default): the OS
        writes blocks back (the tier syncs every GiB and when the engine closes), so writes
        run at the disk's speed; an OS crash or power loss may lose recent blocks, which
        then miss (a process crash loses none).
    disk_shards: LMDB environments a new disk tier directory is split over, each written by
        a thread of its own (an existing directory keeps its count; 1: one environment;
        None: four from a 4 GiB budget, else one).
    disk_worker: run the disk tier in a worker process of its own (`TierConfig.disk_worker`;
        None: on a CUDA device, not on the CPU).
    read_reserve_share: share of the host slots that write-throughs leave to reads from the
        disk while it is on; the rest is the disk's write buffer (`TierConfig`).
    hash_algorithm: "xxh3_128" or "sha256" (block hashes; part of every cache key).
    cache_salt: default salt of every request's cache namespace (a request's own salt wins);
        None: no salt.
    attn_backend: "auto", "torch", "triton", "cudnn" or "flash".
    seed: default seed for sampling (per-request seeds override it); None: nondeterministic.
    cuda_graphs: replay recorded CUDA graphs for small steps: decodes, and short prefill
        chunks as decode rows (used only on CUDA with the triton or cudnn attention backend;
        ignored elsewhere).
    warmup: at start, compile every kernel and time one prefill (CUDA); on the CPU, with a
        disk or remote tier, time one short prefill (what the first restore is weighed with).
    deterministic: every token's logits the same bits whatever its batch, its prompt's
        chunking and the tier its prefix came from (batch-invariant matrix products and
        attention; see docs/DETERMINISM.md for what it costs); off: the fastest kernels,
        token-identical across tiers in float32 only.
    restore_min_saving_s: seconds reading a prefix from the disk or remote tier must be
        expected to save over computing it (at the measured rates) before those tiers are
        asked at all; 0 asks them for every prefix. With other requests running or
        waiting and the tiers' rates measured, a millisecond is enough.
    remote_cache: the shared remote tier below the disk: a Redis / Redis Cluster URL
        (`redis://`, `rediss://`, `redis+cluster://`) or a `RemoteConfig`; None: off.
    flush_timeout_s: seconds closing the engine (`LLM.close`, the end of `kvtier generate`,
        `kvtier serve`'s shutdown) may spend writing what is still pending to the disk
        tier, GPU-resident blocks of finished requests included; what is left then is
        reported and counted skipped.

    Raises `kvtier.validation.ConfigError` (a ValueError) naming the field and what it
    accepts when a value is out of range.
    """

    model: str = Field("smollm2-135m", min_length=1,
                       description="alias, hub id, model directory, .gguf file or random:<name>")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: DType = Field("auto", description="auto is float32 on CPU, bfloat16 on CUDA")
    block_size: _PositiveInt = Field(16, description="tokens per KV block")
    gpu_blocks: _PositiveInt | None = Field(
        None, description="exact number of device KV blocks; None sizes the pool")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="share of the free device memory for KV blocks, in (0, 1]")
    max_model_len: _PositiveInt | None = Field(
        None, description="tokens of prompt plus output per request; None: the model's context")
    max_num_seqs: _PositiveInt = Field(64, description="requests running in one step")
    max_num_batched_tokens: _PositiveInt = Field(2048, description="tokens run in one step")
    long_prefill_token_threshold: Annotated[int, Field(ge=0)] = Field(
        0, description="while other prompts wait, a prompt's tokens per step at most; "
        "0: no cap")
    host_cache: bool = Field(True, description="the pinned host tier on or off")
    host_cache_gb: _PositiveGiB = Field(
        1.0, description="host tier size in GiB; turn the tier off instead of giving it 0")
    disk_cache: bool = Field(True, description="the LMDB disk tier on or off")
    disk_cache_dir: str | Path | None = Field(
        None, description="disk tier directory; None: <user cache dir>/kv")
    disk_cache_gb: _PositiveGiB = Field(
        10.0, description="disk tier budget in GiB; turn the tier off instead of giving it 0")
    disk_durable: bool = Field(
        False, description="fsync every disk tier write transaction; off: the OS writes "
        "back, an OS crash or power loss may lose recent blocks (they then miss)")
    disk_shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)] | None = Field(
        None, description="LMDB environments a new disk tier directory is split over, "
        f"written side by side (None: {LARGE_BUDGET_SHARDS} from a "
        f"{SHARDING_BUDGET_BYTES >> 30} GiB budget, else 1); an existing directory keeps its "
        "own count")
    disk_worker: bool | None = Field(
        None, description="run the disk tier in a worker process of its own (None: on a "
        "CUDA device)")
    read_reserve_share: Annotated[float, Field(ge=0, lt=1)] = Field(
        DEFAULT_READ_RESERVE_SHARE, description="share of the host slots write-throughs "
        "leave to reads from the disk; the rest is its write buffer")
    hash_algorithm: HashAlgorithm = Field(
        "xxh3_128", description="block hash; sha256 where tenants do not trust each other")
    cache_salt: str | None = Field(
        None, min_length=1, description="default per-tenant salt of the cache namespace")
    attn_backend: AttnBackend = Field("auto", description="attention implementation")
    seed: Annotated[int, Field(ge=0)] | None = Field(
        0, description="default sampling seed, >= 0; None: nondeterministic")
    cuda_graphs: bool = Field(True, description="replay CUDA graphs for small steps")
    warmup: bool = Field(True, description="compile and capture every kernel at start (CUDA); "
                         "time one prefill at start (CUDA, and the CPU with a slow tier)")
    deterministic: bool = Field(
        False, description="batch- and chunk-invariant kernels: bit-identical logits across "
        "batches, chunk sizes and tiers, in bf16 too")
    restore_min_saving_s: float = Field(
        MIN_SAVING_S, ge=0, description="seconds reading a prefix from the disk or remote "
        "tier must be expected to save over computing it before they are asked; 0: always")
    remote_cache: str | RemoteConfig | None = Field(
        None, description="Redis / Redis Cluster URL of the shared remote tier; None: off")
    flush_timeout_s: float = Field(
        120.0, ge=0, description="seconds closing may spend writing pending blocks to disk")

    @field_validator("remote_cache")
    @classmethod
    def _check_remote_url(cls, value: str | RemoteConfig | None) -> str | RemoteConfig | None:
        if isinstance(value, str):
            RemoteConfig(value)  # raises ValueError naming what is wrong with the URL
        return value

    @property
    def host_cache_bytes(self) -> int:
        """Size of the host tier in bytes (0 when it is off)."""
        return int(self.host_cache_gb * GIB) if self.host_cache else 0

    @property
    def remote_config(self) -> RemoteConfig | None:
        """The remote tier's config (defaults around a bare URL), None when it is off."""
        if self.remote_cache is None or isinstance(self.remote_cache, RemoteConfig):
            return self.remote_cache
        return RemoteConfig(self.remote_cache)

    @property
    def disk_cache_bytes(self) -> int:
        """Budget of the disk tier in bytes (0 when it is off)."""
        return int(self.disk_cache_gb * GIB) if self.disk_cache else 0


def default_disk_cache_dir() -> Path:
    """`<user cache dir>/kv`: the disk tier's directory when none is given (not created)."""
    return paths.cache_dir(create=False) / "kv"
