"""The caller's requests and the engine requests behind them.

A request asking for n completions runs as n engine `Request`s that share the prompt's cached
blocks: itself when n = 1, else `<i>_<id>` for completion i (the ids `LLM.stream_step`
reports). `Completions` keeps which engine request serves which completion of which
request, and assembles the caller's `RequestOutput` once every completion has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, combine_metrics
from kvtier.engine.request import RequestId


@dataclass(slots=True)
class ParentRequest:
    """A request as the caller sees it: its prompt and its `n` completions so far (each
    completion runs as an engine `Request` of its own)."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    metrics: list[RequestMetrics] = field(default_factory=list)


def completion_request_ids(request_id: str, n: int) -> list[RequestId]:
    """The engine requests of a request with `n` completions: itself when n = 1, else
    `<i>_<request_id>` for each."""
    return [RequestId(request_id)] if n == 1 else \
        [RequestId(f"{i}_{request_id}") for i in range(n)]


class Completions:
    """The caller's requests still unfinished, by id, and the engine requests behind them."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[RequestId, tuple[str, int]] = {}  # -> (request, completion)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...],
            n: int) -> list[RequestId]:
        """Register a request with `n` completions; returns its engine requests' ids, in
        completion order. The caller checks first that no id is in use."""
        assert request_id not in self._parents, f"request id {request_id!r} is in use"
        self._parents[request_id] = ParentRequest(prompt, prompt_token_ids, n)
        child_ids = completion_request_ids(request_id, n)
        for completion, rid in enumerate(child_ids):
            self._child_parent[rid] = (request_id, completion)
        return child_ids

    def ids(self, request_id: str) -> list[RequestId]:
        """The engine requests of the unfinished request `request_id` (KeyError if none)."""
        return completion_request_ids(request_id, self._parents[request_id].n)

    def request_of(self, engine_request_id: RequestId) -> str:
        """The caller's request that the engine request `engine_request_id` serves."""
        return self._child_parent[engine_request_id][0]

    def index_of(self, engine_request_id: RequestId) -> int:
        """Which completion of its request `engine_request_id` is (0 when n = 1)."""
        return self._child_parent[engine_request_id][1]

    def finish(self, engine_request_id: RequestId, output: CompletionOutput,
               metrics: RequestMetrics) -> RequestOutput | None:
        """Record the finished completion `output` of the engine request; the request's
        `RequestOutput` once all its completions are in (and the request is forgotten),
        else None."""
        request_id, completion = self._child_parent.pop(engine_request_id)
        parent = self._parents[request_id]
        parent.completions[completion] = output
        parent.metrics.append(metrics)
        if len(parent.completions) < parent.n:
            return None
        del self._parents[request_id]
        return RequestOutput(request_id, parent.prompt, parent.prompt_token_ids,
                             [parent.completions[i] for i in range(parent.n)], True,
                             combine_metrics(parent.metrics))
