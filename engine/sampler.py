"""Sampling parameters and the sampler: one next token per request from its logits row.

Greedy (temperature 0) is argmax with ties going to the lowest token id, exactly like
`torch.argmax` and transformers' greedy search. Otherwise logits are divided by the
temperature, cut by min_p, to the top-k tokens and then to the smallest set whose
probability reaches top_p, and one token is drawn with the request's own
`torch.Generator`: a seeded request draws the same tokens whatever else shares its batch.
Repetition, presence and frequency penalties (`kvtier.engine.logits_processors`) apply
before all of that, greedy included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from kvtier.engine.logits_processors import (
    apply_min_p,
    apply_penalties,
    compute_logprobs,
    penalties_active,
)
from kvtier.engine.outputs import Logprob
from pydantic import Field, field_validator

from kvtier.validation import CheckedModel

_Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]

#: Temperatures in (0, MIN_TEMPERATURE) are raised to it (as vLLM does): dividing float32
#: logits by less overflows them to inf, and the probabilities to NaN.
MIN_TEMPERATURE = 0.01
#: Bounds that keep every value representable where the sampler puts it (int64 tensors,
#: float32 logits, a 64-bit generator seed).
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3


class SamplingParams(CheckedModel):
    """How one request picks tokens and when it stops (vLLM's names and meanings).

    n: completions generated for the prompt (each its own sequence; they share the
    prompt's cached blocks). max_tokens: tokens to generate at most per completion.
    temperature: 0 = greedy. top_k: keep the k most likely tokens (0 = off; vLLM's -1 is
    accepted too). top_p: keep the smallest set of tokens whose probability sums to at least
    top_p (1.0 = off). min_p: drop tokens less likely than min_p times the most likely one
    (0 = off). repetition_penalty: divide positive (multiply negative) logits of tokens seen
    in the prompt or output (1.0 = off; > 1 discourages repeats). presence_penalty /
    frequency_penalty: subtract from the logits of tokens already generated, once / once per
    occurrence (0 = off; in [-2, 2]). logprobs: return the log-probability of each chosen
    token and of this many most likely tokens (None = off; 0 = the chosen token only); they
    are the model's own distribution, before penalties and temperature. seed: per-request
    seed (None = the engine's seed and the arrival order). ignore_eos: keep going past EOS.
    stop_token_ids: extra ids that end the request. stop: strings that end the request; the
    text returned stops before the first of them (a str is taken as one stop string).
    Raises `kvtier.validation.ConfigError` (a ValueError) naming the field for a value out
    of range.
    """

    n: Annotated[int, Field(ge=1)] = Field(1, description="completions per prompt, >= 1")
    max_tokens: Annotated[int, Field(ge=0)] = Field(
        16, description="tokens to generate at most, >= 1 for a request")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = Field(
        0.0, description=f"in [0, {MAX_TEMPERATURE:g}]; 0 = greedy; values below "
        f"{MIN_TEMPERATURE} are raised to it")
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] = Field(
        0, description="keep the k most likely tokens; 0 or -1 = off")
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = Field(
        1.0, description="nucleus probability mass in (0, 1]; 1 = off")
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        0.0, description="in [0, 1]; 0 = off")
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY,
                                               le=MAX_REPETITION_PENALTY,
                                               allow_inf_nan=False)] = Field(
        1.0, description=f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]; "
        "1 = off, > 1 discourages repeats")
    presence_penalty: _Penalty = Field(0.0, description="in [-2, 2]; 0 = off")
    frequency_penalty: _Penalty = Field(0.0, description="in [-2, 2]; 0 = off")
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        None, description="top log-probabilities per token, 0-20; None = off")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = Field(
        None, description="an integer in [0, 2**63 - 1] or None")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence")
    stop_token_ids: tuple[Annotated[int, Field(ge=0, le=MAX_TOP_K)], ...] = Field(
        (), description="non-negative token ids that end the request")
    # Stop strings, matched on the detokenized output by `kvtier.engine.streaming`.
    stop: tuple[str, ...] = Field((), description="non-empty strings that end the request")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty_stop_strings(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not all(value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, value: float) -> float:
        return max(value, MIN_TEMPERATURE) if value > 0 else value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device | str,
                   engine_seed: int | None = None, index: int = 0,
                   completion: int = 0) -> torch.Generator | None:
    """A generator on `device` for completion `completion` of a request: seeded from
    `params.seed` (plus the completion, so the n completions of a seeded request differ),
    else from `engine_seed` and the request's arrival `index` (deterministic per run); None
    when greedy or unseeded."""
    if params.greedy:
        return None
    seed = params.seed
    if seed is not None:
        seed = (seed + completion) % 2**64  # the generator takes 64 bits
    elif engine_seed is not None:
        seed = engine_seed + index + completion * 1_000_003
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


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
           generators: Sequence[torch.Generator | None],
           prompt_token_ids: Sequence[Sequence[int]] | None = None,
           output_token_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """One token id per request.

    logits: [num_reqs, vocab] float32; params and generators: one per row (a generator on
    the logits' device, or None for the global RNG); prompt_token_ids / output_token_ids:
    each row's prompt and generated tokens, needed only when a row has a penalty. Penalties
    apply first (greedy rows take the argmax of the penalized logits), then temperature,
    min_p, top_k and top_p. Returns [num_reqs] int64 on the logits' device. Raises
    ValueError when the lengths disagree, a penalty has no token history, or a sampled
    row's probabilities are not a distribution (non-finite logits).
    """
    num_reqs = logits.shape[0]
    if len(params) != num_reqs or len(generators) != num_reqs:
        raise ValueError(f"got {num_reqs} logits rows, {len(params)} params and "
                         f"{len(generators)} generators; pass one of each per request")
    if any(penalties_active(p) for p in params):
        if prompt_token_ids is None or output_token_ids is None:
            raise ValueError("a request has a penalty: pass prompt_token_ids and "
                             "output_token_ids for every row")
        logits = apply_penalties(logits.float(), params, prompt_token_ids, output_token_ids)
    token_ids = logits.argmax(dim=-1)  # [num_reqs]; greedy rows are done
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return token_ids
    device = logits.device
    index = torch.tensor(rows, device=device)
    temperatures = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32,
                                device=device)
    top_ks = torch.tensor([max(params[i].top_k, 0) for i in rows], dtype=torch.int64,
                          device=device)
    top_ps = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=device)
    scaled = logits[index].float() / temperatures[:, None]  # [num_sampled, vocab]
    if any(params[i].min_p > 0 for i in rows):
        min_ps = torch.tensor([params[i].min_p for i in rows], dtype=torch.float32,
                              device=device)
        scaled = apply_min_p(scaled, min_ps)
    probs = _restrict(scaled, top_ks, top_ps).softmax(dim=-1)
    # A row with no valid distribution fails here, with a message, rather than in
    # `multinomial` (a device-side assert on CUDA, which would end every request).
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # [num_sampled]
    if not bool(valid.all()):
        bad = [rows[j] for j in torch.nonzero(~valid).flatten().tolist()]
        raise ValueError(f"rows {bad}: the sampling parameters leave no valid probability "
                         "distribution (non-finite or all-zero probabilities)")
    for j, i in enumerate(rows):
        token_ids[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return token_ids


def sample_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                    params: Sequence[SamplingParams],
                    decode=None) -> list[dict[int, Logprob] | None]:
    """Log-probabilities for the rows whose params ask for them (None for the others).

    logits: [num_reqs, vocab] the model's own; token_ids: [num_reqs] the sampled tokens.
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[dict[int, Logprob] | None] = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    entries = compute_logprobs(logits[index], token_ids[index],
                               [params[i].logprobs for i in rows], decode)
    for i, entry in zip(rows, entries):
        out[i] = entry
    return out
