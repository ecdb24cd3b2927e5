"""transformers' own time to first token for the prompts of a benchmark, on the engine's
weights: the bar a long prefill in the engine is held against (`bench longctx --compare-hf`).

The model is transformers' LlamaForCausalLM sharing the loaded model's weight tensors
(`cli.bench.serve.hf_twin`), attention "sdpa". One forward pass over the whole prompt with
`logits_to_keep=1` (what `generate()` does for its first token), then the argmax: that is
transformers' TTFT with no engine around it. One short forward first, so cuBLAS handles and
allocator growth stay out of the figures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from kvtier.engine.loader import LoadedModel


def hf_prefill_ttft(loaded: LoadedModel, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Seconds from the call to the first token's id on the host, per prompt (batch 1), and
    the first tokens themselves. Raises ValueError when the model cannot be mapped onto
    transformers' (see `hf_twin`)."""
    from kvtier.cli.bench.serve import hf_twin

    hf_model = hf_twin(loaded)
    device = next(hf_model.parameters()).device
    seconds: list[float] = []
    first_tokens: list[int] = []
    with torch.inference_mode():
        hf_model(input_ids=torch.tensor([list(prompts[0][:64])], device=device),
                 logits_to_keep=1)
        for prompt in prompts:
            input_ids = torch.tensor([list(prompt)], device=device)  # [1, prompt_tokens]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            logits = hf_model(input_ids=input_ids, logits_to_keep=1).logits  # [1, 1, vocab]
            first_tokens.append(int(logits[0, -1].argmax()))  # syncs with the device
            seconds.append(time.perf_counter() - start)
    del hf_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ttft_s": seconds, "first_tokens": first_tokens}
