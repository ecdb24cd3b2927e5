"""Sampling parameters and the sampler: one next token per request from its logits row.

Greedy (temperature 0) is argmax with ties going to the lowest token id, exactly like
`torch.argmax` and transformers' greedy search. Otherwise logits are divided by the
temperature, cut to the top-k tokens and then to the smallest set whose probability reaches
top_p, and one token is drawn with the request's own `torch.Generator`: a seeded request
draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks tokens and when it stops.

    max_tokens: tokens to generate at most. temperature: 0 = greedy. top_k: keep the k most
    likely tokens (0 = off). top_p: keep the smallest set of tokens whose probability sums
    to at least top_p (1.0 = off). seed: per-request seed (None = the global RNG).
    stop_token_ids: extra ids that end the request. ignore_eos: keep going past EOS.
    stop: strings that end the request; the text returned stops before the first of them
    (a str is taken as one stop string).
    Raises ValueError naming the field for a value out of range.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Stop strings (issue 16); matched on the detokenized output by engine.streaming.
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if _not_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature!r}")
        if _not_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (_not_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        stop_ids = tuple(self.stop_token_ids)
        if any(_not_int(t) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(text, str) and text for text in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def make_generator(params: SamplingParams,
                   device: torch.device | str) -> torch.Generator | None:
    """A generator seeded from `params.seed` on `device`; None when unseeded or greedy."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(params.seed)


def _restrict(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p sets to -inf.

    logits: [n, vocab] float32 (already divided by temperature); top_ks [n] int64 (0 = off);
    top_ps [n] float32 (1 = off). The most likely token is always kept.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, vocab]
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)[:, None]  # [n, 1]
    # Ties with the k-th logit stay in: which of equal tokens to drop would be arbitrary.
    kth = sorted_logits.gather(1, k - 1)  # [n, 1]
    drop = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better-ranked tokens
    drop |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1) & (ranks > 0)
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per request.

    logits: [num_reqs, vocab] float32; params and generators: one per row (a generator on
    the logits' device, or None for the global RNG). Returns [num_reqs] int64 on the logits'
    device. Raises ValueError when the lengths disagree.
    """
    num_reqs = logits.shape[0]
    if len(params) != num_reqs or len(generators) != num_reqs:
        raise ValueError(f"got {num_reqs} logits rows, {len(params)} params and "
                         f"{len(generators)} generators; pass one of each per request")
    token_ids = logits.argmax(dim=-1)  # [num_reqs]; greedy rows are done
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return token_ids
    device = logits.device
    index = torch.tensor(rows, device=device)
    temperatures = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32,
                                device=device)
    top_ks = torch.tensor([params[i].top_k for i in rows], dtype=torch.int64, device=device)
    top_ps = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=device)
    scaled = logits[index].float() / temperatures[:, None]  # [num_sampled, vocab]
    probs = _restrict(scaled, top_ks, top_ps).softmax(dim=-1)
    for j, i in enumerate(rows):
        token_ids[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return token_ids
