"""ModelConfig: the shape of a Llama-family model, and a table of named configs.

One frozen record describes every model the engine runs (Llama 2/3, Mistral, Qwen2, Qwen3):
they differ only in sizes, rope, qkv bias (Qwen2), q/k RMSNorm (Qwen3) and tied embeddings.
`from_hf` reads a transformers config, `to_hf` builds one back (tests use it to build the
Hugging Face twin of a random model), and `named_config` gives the shapes used by random-weight
models ("llama3-8b" for GPU benchmarks, "tiny-*" for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from kvtier.layout import KVLayout

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SCALING_TYPES = ("llama3", "linear")

# transformers model_type -> our family
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rope frequency scaling. "linear": every frequency divided by `factor`. "llama3":
    low frequencies divided by `factor`, high ones kept, the band between
    `original_max_position_embeddings / high_freq_factor` and `/ low_freq_factor` wavelengths
    interpolated (the Llama 3.1 scheme)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported; "
                             f"use one of {ROPE_SCALING_TYPES} or no scaling")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, "
                             f"got {self.high_freq_factor} and {self.low_freq_factor}")

    def to_hf(self) -> dict[str, Any]:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "llama3", "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of one decoder-only Llama-family model.

    `head_dim` is explicit (Qwen3 decouples it from hidden_size / num_heads). `attention_bias`
    puts biases on q/k/v (always on for Qwen2; Llama and Qwen3 with it on also bias o_proj, as
    transformers does). `qk_norm` applies a per-head RMSNorm to q and k before rope (Qwen3).
    `eos_token_ids` lists every id that ends a generation. Raises ValueError naming the field
    for a size that is not a positive integer or heads that do not divide.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; "
                             f"use one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0, got "
                             f"{self.rms_norm_eps} and {self.rope_theta}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def uses_o_proj_bias(self) -> bool:
        """transformers' Qwen2 biases only q/k/v; Llama, Mistral and Qwen3 bias o_proj too."""
        return self.attention_bias and self.family != "qwen2"

    def kv_layout(self, block_size: int, dtype: torch.dtype) -> KVLayout:
        """The byte layout of this model's KV blocks (raises ValueError like KVLayout)."""
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, block_size=block_size, dtype=dtype)

    def num_parameters(self) -> int:
        """Weights in the model (tied embeddings counted once)."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        if self.attention_bias:
            attn += q_size + 2 * kv_size + (self.hidden_size if self.uses_o_proj_bias else 0)
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config.

        A sliding window (Mistral v0.1, Qwen2 with `use_sliding_window`) caps
        `max_position_embeddings` at the window: up to that length windowed attention equals
        full attention, so outputs stay exact. Raises ValueError naming the architecture for
        other model types, and for rope types or options this engine does not implement.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _HF_MODEL_TYPES:
            archs = getattr(hf_config, "architectures", None) or [model_type]
            raise ValueError(f"unsupported architecture {archs[0]!r} (model_type "
                             f"{model_type!r}); supported model types: {list(_HF_MODEL_TYPES)}")
        family = _HF_MODEL_TYPES[model_type]
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError(f"{model_type} with mlp_bias=True is not supported")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_theta, rope_scaling = _read_rope(hf_config)
        max_pos = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        windowed = window is not None and (family == "mistral"
                                           or getattr(hf_config, "use_sliding_window", False))
        if windowed:
            max_pos = min(max_pos, int(window))
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        attention_bias = True if family == "qwen2" else bool(
            getattr(hf_config, "attention_bias", False))
        return cls(family=family, vocab_size=hf_config.vocab_size,
                   hidden_size=hf_config.hidden_size,
                   intermediate_size=hf_config.intermediate_size,
                   num_layers=hf_config.num_hidden_layers, num_heads=num_heads,
                   num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
                   head_dim=head_dim, rms_norm_eps=float(hf_config.rms_norm_eps),
                   rope_theta=rope_theta, rope_scaling=rope_scaling,
                   max_position_embeddings=int(max_pos),
                   tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                   attention_bias=attention_bias, qk_norm=family == "qwen3",
                   eos_token_ids=eos_ids, bos_token_id=getattr(hf_config, "bos_token_id", None))

    def to_hf(self) -> Any:
        """The matching transformers config (LlamaConfig, MistralConfig, Qwen2Config or
        Qwen3Config), with the same weight names and numerics as this engine's model."""
        import transformers

        common: dict[str, Any] = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None, "hidden_act": "silu"}
        if self.family == "qwen2":
            if not self.attention_bias:
                raise ValueError("transformers' Qwen2 always has qkv biases; "
                                 "set attention_bias=True")
            return transformers.Qwen2Config(use_sliding_window=False, **common)
        if self.family == "qwen3":
            if not self.qk_norm:
                raise ValueError("transformers' Qwen3 always has q/k norms; set qk_norm=True")
            return transformers.Qwen3Config(use_sliding_window=False,
                                            attention_bias=self.attention_bias, **common)
        if self.qk_norm:
            raise ValueError(f"{self.family} has no q/k norm in transformers; "
                             "use family='qwen3'")
        if self.family == "mistral":
            if self.attention_bias:
                raise ValueError("transformers' Mistral has no attention bias")
            return transformers.MistralConfig(sliding_window=None, **common)
        return transformers.LlamaConfig(attention_bias=self.attention_bias, **common)


def _read_rope(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers >= 5 (`rope_parameters`) or 4.x
    (`rope_theta` + `rope_scaling`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer rope parameters are not supported")
    params = dict(params)
    rope_theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; "
                         f"use one of {ROPE_SCALING_TYPES} or the default rope")
    if rope_type == "linear":
        return rope_theta, RopeScaling("linear", float(params["factor"]))
    original = params.get("original_max_position_embeddings",
                          hf_config.max_position_embeddings)
    return rope_theta, RopeScaling("llama3", float(params["factor"]),
                                   float(params["low_freq_factor"]),
                                   float(params["high_freq_factor"]), int(original))


def _tiny(family: str, **overrides: Any) -> ModelConfig:
    base = {"family": family, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
            "eos_token_ids": (2,), "bos_token_id": 1}
    base.update(overrides)
    return ModelConfig(**base)


_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

NAMED_CONFIGS: MappingProxyType[str, ModelConfig] = MappingProxyType({
    "llama3-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, **_LLAMA3_SCALING),
        max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009),
        bos_token_id=128000),
    "llama3-1b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 32.0, **_LLAMA3_SCALING),
        max_position_embeddings=131072, tie_word_embeddings=True,
        eos_token_ids=(128001, 128008, 128009), bos_token_id=128000),
    "mistral-7b": ModelConfig(
        family="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=32768, eos_token_ids=(2,),
        bos_token_id=1),
    "qwen2-0.5b": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, eos_token_ids=(151645, 151643), bos_token_id=151643),
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        qk_norm=True, eos_token_ids=(151645, 151643), bos_token_id=151643),
    "tiny-llama": _tiny("llama"),
    # Rope wavelengths of head_dim 16 / theta 1e4 span 6 to 2e4 tokens, so an original
    # context of 64 puts frequencies in all three llama3 bands (kept, smoothed, divided).
    "tiny-llama3": _tiny("llama", rope_scaling=RopeScaling(
        "llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "tiny-mistral": _tiny("mistral", rope_scaling=RopeScaling("linear", 2.0)),
    "tiny-qwen2": _tiny("qwen2", attention_bias=True, tie_word_embeddings=True),
    # head_dim 32 != hidden_size / num_heads, like Qwen3.
    "tiny-qwen3": _tiny("qwen3", qk_norm=True, head_dim=32),
})


def named_config(name: str) -> ModelConfig:
    """A config from NAMED_CONFIGS; raises ValueError listing the known names."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(NAMED_CONFIGS)}")
    return NAMED_CONFIGS[name]

