"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

The batch is flattened: `input_ids` and `positions` are [num_tokens] covering prefill chunks
and decodes of several requests; `AttentionMetadata` says which tokens belong to which
request and where their K/V go. Every layer reads and writes its slice of the cross-layer
cache `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` through
`kvtier.device_cache.layer_views`.

Parameter names are transformers' (`model.layers.3.self_attn.q_proj.weight`, ...), so Hugging
Face state dicts load as they are. After loading, `pack_projections` packs each layer's q/k/v
and gate/up weights into one matrix each (the named parameters become views into it): a
decode step then runs 4 matrix products per layer instead of 7, and the small k/v ones no
longer run alone. The numerics follow transformers' modeling code operation by operation
(RMSNorm in float32, rope tables computed in float32 then cast), so float32 outputs match it
to rounding of the attention's reduction order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from kvtier.engine.attention import AttentionMetadata, PagedAttention
from kvtier.engine.config import ModelConfig, RopeScaling
from torch import nn

from kvtier import kernels
from kvtier.device_cache import layer_views


def layer_ops(attn_backend: str) -> ModuleType:
    """Where a layer's elementwise pieces (rms_norm, silu_and_mul, rotary_embedding_) come
    from: the fused Triton kernels for the GPU backends, their torch references for "torch"
    (the CPU path, which rounds exactly where transformers does)."""
    return kernels.reference if attn_backend == "torch" else kernels


def linear_op(attn_backend: str, deterministic: bool) -> Callable[..., torch.Tensor]:
    """The matrix product of the projections and the logits head: `F.linear` (cuBLAS or
    CPU BLAS, whose per-row results depend on the number of rows), or in the deterministic
    mode `invariant_linear` (the Triton kernel on the GPU backends, its fixed-block torch
    version for "torch")."""
    if not deterministic:
        return F.linear
    return (kernels.reference.invariant_linear if attn_backend == "torch"
            else kernels.invariant_linear)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 and cast back first.

    `forward(x, residual)` first adds x into the residual stream in place and normalises the
    sum, returning (normed, residual): the pre-norm layer's "add, then norm" as one step.
    `ops` is a `layer_ops` choice; only the torch one takes inputs of more than two dims.
    """

    def __init__(self, dim: int, eps: float, ops: ModuleType = kernels.reference) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                  device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with linear or llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep short wavelengths, divide long ones by `factor`, interpolate between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((old_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The table of rotary position embedding, indexed by absolute position (the rotation
    itself is `rotary_embedding_` of `layer_ops`, applied in place to q and k).

    `cos_sin_cache` [max_position, head_dim] holds cos in the first half of the last dim and
    sin in the second, computed in float32 on the module's device (then cast to the model
    dtype along with the module, as transformers casts its per-step tables).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", self._table(None), persistent=False)

    def _table(self, device: torch.device | None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)
        positions = torch.arange(self.max_position, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def reset_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the table in float32 on `device`, stored in `dtype` (needed after
        building on the meta device)."""
        self.cos_sin_cache = self._table(device).to(dtype)

def pack_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the weights (and biases) of linears that read the same input into one matrix.

    Returns (weight [sum of out_features, in_features], bias [sum of out_features] or None);
    each linear's parameters become views into them, so names, state dicts and in-place
    initialisation keep working and no second copy of the weights stays alive.
    """
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    assert all(has_bias) or not any(has_bias), "either every packed linear has a bias or none"
    bias = torch.cat([linear.bias for linear in linears]) if all(has_bias) else None
    offset = 0
    for linear in linears:
        rows = slice(offset, offset + linear.out_features)
        linear.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=False)
        offset += linear.out_features
    return weight, bias


class Attention(nn.Module):
    """GQA self-attention: q/k/v projections (optional bias), optional per-head q/k RMSNorm,
    rope, then paged attention over this layer's cache views."""

    def __init__(self, config: ModelConfig, layer_idx: int, attn_backend: str) -> None:
        super().__init__()
        self.ops = layer_ops(attn_backend)
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.uses_o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                   backend=attn_backend)
        self.qkv_weight: torch.Tensor | None = None  # [q_size + 2 * kv_size, hidden_size]
        self.qkv_bias: torch.Tensor | None = None
        self.linear = F.linear  # `LlamaForCausalLM.set_deterministic` swaps it

    def pack(self) -> None:
        """Pack q/k/v into `qkv_weight` (see `pack_linears`)."""
        self.qkv_weight, self.qkv_bias = pack_linears((self.q_proj, self.k_proj, self.v_proj))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        assert self.qkv_weight is not None, "call pack_projections() after loading weights"
        num_tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.linear(hidden, self.qkv_weight, self.qkv_bias)  # [num_tokens, q + 2 kv]
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        self.ops.rotary_embedding_(q, k, positions, cos_sin_cache)  # in place
        k_cache, v_cache = layer_views(kv_cache, self.layer_idx)
        out = self.attn(q, k, v, k_cache, v_cache, attn_metadata)  # [num_tokens, heads, dim]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.linear(out, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops
        self.linear = F.linear  # `LlamaForCausalLM.set_deterministic` swaps it
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [2 * intermediate, hidden_size]

    def pack(self) -> None:
        """Pack gate/up into `gate_up_weight` (see `pack_linears`)."""
        self.gate_up_weight, _ = pack_linears((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up_weight is not None, "call pack_projections() after loading weights"
        gate_up = self.linear(x, self.gate_up_weight)  # [num_tokens, 2 * intermediate]
        return self.linear(self.ops.silu_and_mul(gate_up), self.down_proj.weight)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the hidden states between layers,
    so each residual add is fused into the next norm."""

    def __init__(self, config: ModelConfig, layer_idx: int, attn_backend: str) -> None:
        super().__init__()
        ops = layer_ops(attn_backend)
        self.self_attn = Attention(config, layer_idx, attn_backend)
        self.mlp = MLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: this layer's input, or the last layer's output when `residual` (the stream
        before it) is given; both [num_tokens, hidden_size]. Returns (output, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' `model.*`)."""

    def __init__(self, config: ModelConfig, attn_backend: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, attn_backend)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, layer_ops(attn_backend))
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos_sin_cache = self.rotary_emb.cos_sin_cache  # [max_position, head_dim]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache,
                                     attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The causal LM over the paged cache; `attn_backend` as in `engine.attention`.

    With tied embeddings there is no `lm_head` module: logits use `model.embed_tokens`.
    `deterministic` (see `set_deterministic`) starts off.
    """

    def __init__(self, config: ModelConfig, attn_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.deterministic = False
        self.linear = F.linear
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 (positions < max_position_embeddings);
        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], written
        at `attn_metadata.slot_mapping`. Returns hidden [num_tokens, hidden_size]."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, \
            f"input_ids {tuple(input_ids.shape)} / positions {tuple(positions.shape)} must be " \
            "equal flat [num_tokens]"
        return self.model(input_ids, positions, kv_cache, attn_metadata)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.linear(hidden, weight).float()

    def set_deterministic(self, on: bool) -> None:
        """Switch every matrix product and the attention to their batch-invariant kernels
        (on) or back to the fastest ones (off). With it on, a token's hidden states and
        logits are the same bits whatever the step it runs in: how many tokens share it,
        how its prompt was chunked, which of its keys were restored from a tier. The
        elementwise kernels (norms, rope, SiLU) work per row in both modes. Weights are
        untouched; CUDA graphs recorded in one mode replay that mode's kernels."""
        linear = linear_op(self.attn_backend, on)
        self.linear = linear
        for layer in self.model.layers:
            layer.self_attn.linear = linear
            layer.mlp.linear = linear
            layer.self_attn.attn.set_deterministic(on)
        self.deterministic = on

    @torch.no_grad()
    def pack_projections(self) -> None:
        """Pack every layer's q/k/v and gate/up weights (after loading or allocating them;
        moving the model to another device or dtype afterwards would unpack the views)."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()

    def reset_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute the non-weight buffers (the rope table) on `device` in `dtype`; needed
        after building on the meta device."""
        with torch.no_grad():
            self.model.rotary_emb.reset_cache(torch.device(device), dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     device: torch.device | str, dtype: torch.dtype) -> None:
        """Make (name, tensor) pairs with transformers' names the model's parameters.

        Each tensor is cast to `dtype` on `device` and becomes the parameter itself (no copy
        when it already matches), so a model built on the meta device is materialised
        without a second copy of the weights. A tied checkpoint's `lm_head.weight` is skipped
        (it equals the embeddings) and so are rotary `inv_freq` buffers of old checkpoints.
        Raises ValueError for an unknown name, a shape mismatch, or parameters the weights
        did not cover.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                                 f"{self.config.family} model (wrong architecture?)")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(params[name].shape)}")
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            value = tensor.to(device=device, dtype=dtype)
            setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
