"""What the engine hands back for a request: its tokens, text, and where its KV came from."""

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
        return self.cached_tokens_gpu + self.cached_tokens_host + self.cached_tokens_disk


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished (or, from `step`, possibly finished) request.

    finish_reason is "stop" (an end-of-sequence or stop token was generated: it is kept in
    `token_ids`, its text is not; or a stop string was: the text ends before it), "length"
    (max_tokens, the model's context, or the GPU block budget was reached) or "abort"
    (`LLM.abort`); None while the request is still running.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the shape `kvtier generate --json` prints per output)."""
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "ttft_s": self.metrics.ttft_s,
            "cached_tokens": {
                "gpu": self.metrics.cached_tokens_gpu,
                "host": self.metrics.cached_tokens_host,
                "disk": self.metrics.cached_tokens_disk,
            },
            "computed_tokens": self.metrics.computed_tokens,
            "num_preemptions": self.metrics.num_preemptions,
        }
