"""Model implementations over the paged KV cache. Every supported family (llama, mistral,
qwen2, qwen3) runs on the one Llama-style decoder; `engine.config.ModelConfig` says which
options (qkv bias, q/k norm, tied embeddings, rope scaling) a model uses."""

from kvtier.engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
