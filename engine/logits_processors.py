"""Logits transforms of the sampler: penalties, min-p, and log-probabilities.

They follow the definitions of vLLM's sampling parameters, which for the repetition
penalty and min-p are also transformers' (`RepetitionPenaltyLogitsProcessor`,
`MinPLogitsWarper`; the tests compare them). Each works on a float32 `[n, vocab]` tensor
of logits, one row per request, and leaves rows whose parameters turn it off untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from kvtier.engine.outputs import Logprob


def penalties_active(params: Any) -> bool:
    """Whether any of the request's penalties changes its logits."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, params: Sequence[Any],
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Penalized copy of `logits` [n, vocab] float32.

    repetition_penalty applies to every token seen in the prompt or the output: a positive
    logit is divided by it, a negative one multiplied. presence_penalty is subtracted once
    from every token already generated, frequency_penalty once per time it was generated.
    """
    out = logits.clone()
    vocab = logits.shape[1]
    for row, p in enumerate(params):
        if not penalties_active(p):
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_token_ids[row]) | set(output_token_ids[row])),
                                dtype=torch.int64, device=logits.device)
            scores = out[row, seen]
            out[row, seen] = torch.where(scores < 0, scores * p.repetition_penalty,
                                         scores / p.repetition_penalty)
        if output_token_ids[row] and (p.presence_penalty or p.frequency_penalty):
            generated = torch.tensor(list(output_token_ids[row]), dtype=torch.int64,
                                     device=logits.device)
            counts = torch.bincount(generated, minlength=vocab).to(out.dtype)  # [vocab]
            out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits of tokens whose probability is below `min_p` times the most
    likely token's. logits: [n, vocab] float32 (already divided by the temperature);
    min_ps: [n] float32 (0 = off). The most likely token is always kept."""
    probs = logits.softmax(dim=-1)  # [n, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]  # [n, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int],
                     decode: Any = None) -> list[dict[int, Logprob]]:
    """Per row, the chosen token's log-probability and the `num_top[row]` most likely.

    logits: [n, vocab] float32, the model's own (before penalties and temperature);
    token_ids: [n] the chosen tokens. `decode(token_id) -> str` fills `decoded_token`
    (None without it). Rank 1 is the most likely token.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(1, token_ids.view(-1, 1).long())  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    rows: list[dict[int, Logprob]] = []
    for row, count in enumerate(num_top):
        token = int(token_ids[row])
        entry = {token: Logprob(float(chosen[row, 0]), int(ranks[row]),
                                decode(token) if decode else None)}
        for rank in range(count):
            top = int(top_ids[row, rank])
            if top not in entry:
                entry[top] = Logprob(float(top_values[row, rank]), rank + 1,
                                     decode(top) if decode else None)
        rows.append(entry)
    return rows
