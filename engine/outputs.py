"""What the engine hands back for a request (vLLM's shape: a `RequestOutput` holding
`CompletionOutput`s), its log-probabilities, and where its KV came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings (seconds, from `time.perf_counter`) and token accounting of one request.

    cached_tokens_*: prompt (or resumed-sequence) tokens whose KV was not computed but taken
        from the GPU pool, restored from the host tier, or restored from the disk tier,
        summed over every admission of the request (a preempted request is admitted again).
    computed_tokens: tokens run through the model for this request, recomputations included.
    """

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    cached_tokens_gpu: int
    cached_tokens_host: int
    cached_tokens_disk: int
    computed_tokens: int
    num_preemptions: int
    cached_tokens_remote: int = 0  # restored from the shared remote tier

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        """Seconds from arrival to the end of the request."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def cached_tokens(self) -> int:
        """Tokens served from any cache tier."""
        return (self.cached_tokens_gpu + self.cached_tokens_host + self.cached_tokens_disk
                + self.cached_tokens_remote)


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's log-probability (natural log) under the model, and its rank (1 = the most
    likely token). decoded_token: the token's text, when the model has a tokenizer."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`).

    index: which of the request's `n` completions this is. token_ids: the generated tokens
    (an end-of-sequence or stop token that ended it is kept). finish_reason: "stop" (an
    end-of-sequence or stop token; its id is kept in `token_ids`, its text is not; or a stop
    string: the text ends before it), "length" (max_tokens, the model's context, or the GPU
    block budget), "abort" (`LLM.abort`), "error" (a computation of this request failed, or
    the engine step it ran in; `error` says which), or None while it runs. logprobs: with
    `SamplingParams.logprobs`, one {token id: Logprob} per generated token (the chosen
    token and the most likely ones); cumulative_logprob: the sum of the chosen tokens'
    log-probabilities (None without logprobs).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's result, shaped like vLLM's `RequestOutput`.

    outputs: its `n` completions in index order (`outputs[0].text` is the answer when n=1).
    finished: every completion has finished. metrics: kvtier's own accounting (timings and
    where the KV of each token came from: GPU pool, host tier, disk tier, or computed),
    summed over the completions.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the shape `kvtier generate --json` prints per output)."""
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "outputs": [{
                "index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason, "error": c.error,
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": None if c.logprobs is None else [
                    {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                  "decoded_token": lp.decoded_token}
                     for token, lp in entry.items()} for entry in c.logprobs],
            } for c in self.outputs],
            "finished": self.finished,
            "ttft_s": self.metrics.ttft_s,
            "cached_tokens": {
                "gpu": self.metrics.cached_tokens_gpu,
                "host": self.metrics.cached_tokens_host,
                "disk": self.metrics.cached_tokens_disk,
                "remote": self.metrics.cached_tokens_remote,
            },
            "computed_tokens": self.metrics.computed_tokens,
            "num_preemptions": self.metrics.num_preemptions,
        }


def combine_metrics(parts: list[RequestMetrics]) -> RequestMetrics:
    """The metrics of a request made of several completions: earliest arrival and first
    token, latest finish, token counts and preemptions summed."""
    if len(parts) == 1:
        return parts[0]
    firsts = [m.first_token_time for m in parts if m.first_token_time is not None]
    ends = [m.finished_time for m in parts]
    return RequestMetrics(
        min(m.arrival_time for m in parts), min(firsts) if firsts else None,
        None if any(t is None for t in ends) else max(ends),  # type: ignore[type-var]
        sum(m.cached_tokens_gpu for m in parts), sum(m.cached_tokens_host for m in parts),
        sum(m.cached_tokens_disk for m in parts), sum(m.computed_tokens for m in parts),
        sum(m.num_preemptions for m in parts),
        cached_tokens_remote=sum(m.cached_tokens_remote for m in parts))
