"""The response side of the OpenAI API: a request's completions gathered from the engine's
deltas, and their log-probabilities in the completions and the chat shapes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.cli.server.engine_output import FinishedRequest, read_output
from kvtier.engine.outputs import Logprob
from kvtier.engine.streaming import RequestDelta

#: Log-probabilities below this are reported as it (JSON has no -Infinity), as vLLM does.
_MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class Completion:
    """One of a request's `n` completions, gathered from its deltas."""

    index: int
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, delta: RequestDelta) -> None:
        self.parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class Result:
    """What a request produced: its completions in index order, and its finished output."""

    completions: list[Completion]
    finished: FinishedRequest | None = None

    @classmethod
    def empty(cls, num_completions: int) -> Result:
        return cls([Completion(i) for i in range(num_completions)])

    def add(self, delta: RequestDelta) -> None:
        self.completions[delta.index].add(delta)
        if delta.output is not None:
            self.finished = read_output(delta.output)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.completions)


def usage(finished: FinishedRequest | None, num_completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object, with the prompt tokens served from the KV cache."""
    prompt = len(finished.prompt_token_ids) if finished else 0
    cached = finished.cached_tokens if finished else 0
    return {"prompt_tokens": prompt, "completion_tokens": num_completion_tokens,
            "total_tokens": prompt + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, _MIN_LOGPROB)


def _token(logprob: Logprob, token_id: int) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: item[1].rank)[:num_top]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                        num_top: int, text_offset: int = 0) -> dict[str, Any]:
    """The completions API's `logprobs` object for these tokens; `text_offset` is where
    their text starts in the completion (for a streamed chunk)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        if chosen is None:
            continue
        token = _token(chosen, token_id)
        tokens.append(token)
        values.append(_value(chosen))
        tops.append({_token(lp, t): _value(lp) for t, lp in _top(entry, num_top)}
                    if num_top else None)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                  num_top: int) -> dict[str, Any]:
    """The chat API's `logprobs` object ({"content": [...]}) for these tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        if chosen is None:
            continue
        token = _token(chosen, token_id)
        content.append({
            "token": token, "logprob": _value(chosen),
            "bytes": list(token.encode("utf-8", errors="replace")),
            "top_logprobs": [{"token": _token(lp, t), "logprob": _value(lp),
                              "bytes": list(_token(lp, t).encode("utf-8", errors="replace"))}
                             for t, lp in _top(entry, num_top)]})
    return {"content": content}
