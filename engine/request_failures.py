"""Requests that fail alone: a computation of one request (sampling with its parameters, its
log-probabilities, detokenizing its output, looking for its stop strings) or the step it ran
in raised. The request ends with finish reason "error" and a message for its caller; the
other requests of the step, and the engine, go on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from kvtier.engine.outputs import Logprob
from kvtier.engine.request import OutputTokenIds, Request, RequestId
from kvtier.engine.sampler import sample, sample_logprobs
from kvtier.engine.scheduler import Scheduler

log = logging.getLogger("kvtier.engine")


class RequestFailures:
    """The failed requests and the message each one's caller gets (the first failure's)."""

    def __init__(self) -> None:
        self._messages: dict[RequestId, str] = {}

    def fail(self, request: Request, what: str, exc: BaseException) -> None:
        """Record that a computation of `request` alone failed while doing `what`."""
        log.error("request %s failed while %s", request.request_id, what,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self._messages.setdefault(request.request_id, f"the engine failed while {what}; "
                                  "the request was stopped")

    def fail_step(self, request: Request) -> None:
        """Record that the step `request` ran in failed."""
        self._messages.setdefault(request.request_id, "an internal error in the engine step "
                                  "it ran in stopped the request; retry it")

    def message(self, request_id: RequestId) -> str | None:
        """The request's error message, None while it has not failed."""
        return self._messages.get(request_id)

    def pop(self, request_id: RequestId) -> str | None:
        """The request's error message, forgotten (the request is being completed)."""
        return self._messages.pop(request_id, None)

    def end_failed(self, requests: Mapping[RequestId, Request], scheduler: Scheduler,
                   finished: list[Request]) -> None:
        """Stop every failed request of `requests` still running (appended to `finished`);
        one that finished meanwhile ends with "error" all the same."""
        for request_id in self._messages:
            request = requests.get(request_id)
            if request is None:
                continue
            if not request.is_finished:
                scheduler.stop(request, "error")
                finished.append(request)
            else:
                request.finish_reason = "error"


def sample_each_alone(logits: torch.Tensor, requests: Sequence[Request],
                      generators: Mapping[RequestId, torch.Generator],
                      failures: RequestFailures) -> torch.Tensor:
    """`sample` for the step's rows (`logits: [num_reqs, vocab_size]`); if the batch raises,
    one row at a time, so that a row that fails fails its request alone (its token is a
    placeholder, never returned: the request ends with "error"). Returns `[num_reqs]`."""
    gens = [generators.get(r.request_id) for r in requests]
    try:
        return sample(logits, [r.params for r in requests], gens,
                      [r.prompt_token_ids for r in requests], OutputTokenIds(requests))
    except Exception:  # noqa: BLE001 (one request's values must not fail the others)
        pass
    token_ids = logits.argmax(dim=-1)  # [num_reqs]
    for row, (request, generator) in enumerate(zip(requests, gens)):
        try:
            token_ids[row] = sample(logits[row:row + 1], [request.params], [generator],
                                    [request.prompt_token_ids], [request.output_token_ids])[0]
        except Exception as exc:  # noqa: BLE001
            failures.fail(request, "sampling (its parameters give no valid probability "
                          "distribution over the tokens)", exc)
    return token_ids


def record_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request],
                    decode: Callable[[int], str] | None, failures: RequestFailures,
                    logprobs: Mapping[RequestId, list[dict[int, Logprob]]]) -> None:
    """Append each request's log-probabilities of this step (`logits: [num_reqs, vocab_size]`,
    `token_ids: [num_reqs]`) to its list in `logprobs`, for the requests that asked; a
    request whose entry cannot be computed fails alone (and gets an empty entry): the rows
    are then computed one at a time."""
    try:
        entries = sample_logprobs(logits, token_ids, [r.params for r in requests], decode)
    except Exception:  # noqa: BLE001 (one request's values must not fail the others)
        pass
    else:
        for request, entry in zip(requests, entries):
            if entry is not None:
                logprobs[request.request_id].append(entry)
        return
    for row, request in enumerate(requests):
        if request.params.logprobs is None:
            continue
        try:
            [entry] = sample_logprobs(logits[row:row + 1], token_ids[row:row + 1],
                                      [request.params], decode)
        except Exception as exc:  # noqa: BLE001 (this request fails, alone)
            failures.fail(request, "computing its log-probabilities", exc)
            entry = {}
        logprobs[request.request_id].append(entry)
