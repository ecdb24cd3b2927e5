"""The one place where the server reads the engine's `RequestOutput`.

Everything the server needs from a finished request goes through `read_output`, so a change
of `RequestOutput`'s shape is a change here only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A finished request as the server sees it.

    cached_tokens_*: prompt tokens taken from each cache tier instead of being computed.
    ttft_s / tpot_s: seconds to the first token / per later token (None when unknown).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    cached_tokens_gpu: int
    cached_tokens_host: int
    cached_tokens_disk: int
    num_preemptions: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    cached_tokens_remote: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from any cache tier (at most the prompt's length)."""
        total = (self.cached_tokens_gpu + self.cached_tokens_host + self.cached_tokens_disk
                 + self.cached_tokens_remote)
        return min(total, len(self.prompt_token_ids))


def read_output(output: RequestOutput) -> FinishedRequest:
    """The server's view of a finished `RequestOutput`."""
    m = output.metrics
    completion = output.outputs[0]  # the server takes n = 1 only
    tpot = None
    if m.first_token_time is not None and m.finished_time is not None \
            and len(completion.token_ids) > 1:
        tpot = (m.finished_time - m.first_token_time) / (len(completion.token_ids) - 1)
    return FinishedRequest(
        request_id=output.request_id, prompt_token_ids=tuple(output.prompt_token_ids),
        token_ids=tuple(completion.token_ids), text=completion.text,
        finish_reason=completion.finish_reason, cached_tokens_gpu=m.cached_tokens_gpu,
        cached_tokens_host=m.cached_tokens_host, cached_tokens_disk=m.cached_tokens_disk,
        num_preemptions=m.num_preemptions, ttft_s=m.ttft_s, tpot_s=tpot,
        latency_s=m.latency_s, cached_tokens_remote=m.cached_tokens_remote)
