"""Streaming output: per request, the tokens and text each step adds, and stop strings.

`OutputTracker` follows the requests an `LLM` reports on. For each it keeps an incremental
detokenizer (engine.detokenizer) and how much was handed out already, and it enforces the
request's stop strings: text that could still be the beginning of a stop string is held
back until it is not, and a stop string ends the request with the text cut just before it
(the stop string itself is never returned, as in vLLM and the OpenAI API). The text of the
token that ended a request ("stop" by an end-of-sequence or stop token id) is not part of
the output either; its id is.

Requests nobody streams and that have no stop strings cost nothing here until they finish:
their text is then one plain decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kvtier.engine.outputs import Logprob, RequestOutput
    from kvtier.engine.request import Request


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one step added to one request.

    token_ids: output tokens new since the request's previous delta. text: the text they
    complete (possibly "", e.g. while a character or a possible stop string is incomplete).
    finish_reason: None while running, else "stop", "length", "abort" or "error". stop_reason:
    the stop string or stop token id that ended it (None otherwise). output: the request's
    final `RequestOutput` on its last delta, else None. index: which of the parent
    request's `n` completions this is. logprobs: with `SamplingParams.logprobs`, one
    {token id: Logprob} per token of `token_ids`. error: why the request failed (finish
    reason "error": a computation of its own failed, or the step it ran in).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    output: RequestOutput | None = None
    index: int = 0
    logprobs: tuple[dict[int, Logprob], ...] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _OutputState:
    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    text_end: int | None = None            # where a stop string cut the text
    stop_reason: str | int | None = None
    final_text: str | None = None          # set once the request finished

    @property
    def text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        return self.detokenizer.text[:self.text_end]


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _find_stop(text: str, start: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` ending after `start`: (its index, it)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class OutputTracker:
    """Detokenizer and stop-string state of the requests of one engine (one thread)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _OutputState] = {}

    def _state(self, request: Request) -> _OutputState:
        state = self._states.get(request.request_id)
        if state is None:
            stop = tuple(getattr(request.params, "stop", ()) or ())
            state = _OutputState(IncrementalDetokenizer(self.tokenizer), stop)
            self._states[request.request_id] = state
        return state

    def _feed(self, request: Request, state: _OutputState) -> None:
        """Give the detokenizer the output tokens it has not seen (the ending stop token of
        a finished request excepted) and look for a stop string in the new text."""
        token_ids = _text_token_ids(request)
        seen = len(state.detokenizer.token_ids)
        if len(token_ids) <= seen or state.text_end is not None:
            return
        before = len(state.detokenizer.text)
        state.detokenizer.add(token_ids[seen:])
        self._cut_at_stop(state, before)

    def _cut_at_stop(self, state: _OutputState, searched: int) -> None:
        if not state.stop or state.text_end is not None:
            return
        found = _find_stop(state.detokenizer.text, searched, state.stop)
        if found is not None:
            state.text_end, state.stop_reason = found

    def check_stop(self, request: Request) -> bool:
        """Advance a running request's text; True when it now contains a stop string (the
        caller ends the request with "stop"). Requests without stop strings are skipped."""
        if not getattr(request.params, "stop", ()):
            return False
        state = self._state(request)
        self._feed(request, state)
        return state.text_end is not None

    def delta(self, request: Request) -> RequestDelta:
        """Tokens and text new since the last delta of `request`; on a finished request the
        last delta (with its finish reason), after which `forget` may be called."""
        state = self._state(request)
        if request.is_finished:
            self._finalize(request, state)
            end = len(state.text)
        else:
            self._feed(request, state)
            text = state.text
            end = len(text) - _held_back(text, state.stop) if state.text_end is None \
                else len(text)
        output_ids = request.output_token_ids
        new_ids = tuple(output_ids[state.num_reported_tokens:])
        new_text = state.text[state.num_reported_chars:end]
        state.num_reported_tokens = len(output_ids)
        state.num_reported_chars = max(end, state.num_reported_chars)
        return RequestDelta(request.request_id, new_ids, new_text, request.finish_reason,
                            self.stop_reason(request))

    def final_text(self, request: Request) -> str:
        """The whole output text of a finished request."""
        state = self._states.get(request.request_id)
        if state is None:  # never streamed and no stop strings: one plain decode
            if self.tokenizer is None:
                return ""
            return self.tokenizer.decode(_text_token_ids(request), skip_special_tokens=True)
        self._finalize(request, state)
        return state.text

    def stop_reason(self, request: Request) -> str | int | None:
        """The stop string, or the stop token id, that ended `request` (None otherwise)."""
        state = self._states.get(request.request_id)
        if state is not None and state.stop_reason is not None:
            return state.stop_reason
        if request.finish_reason == "stop" and request.output_token_ids:
            last = request.output_token_ids[-1]
            if last in request.stop_token_ids:
                return last
        return None

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _finalize(self, request: Request, state: _OutputState) -> None:
        if state.final_text is not None:
            return
        self._feed(request, state)
        if state.text_end is None:
            before = len(state.detokenizer.text)
            state.detokenizer.finish()
            self._cut_at_stop(state, before)
        state.final_text = state.detokenizer.text[:state.text_end]


def _text_token_ids(request: Request) -> list[int]:
    """Output tokens that make up the text: all but a final end-of-sequence / stop token."""
    output_ids = request.output_token_ids
    if request.finish_reason == "stop" and output_ids and (
            output_ids[-1] in request.stop_token_ids
            or (output_ids[-1] in request.eos_token_ids and not request.ignore_eos)):
        return output_ids[:-1]
    return output_ids
