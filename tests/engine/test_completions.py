"""`Completions`: which engine request serves which completion, and the caller's output once
every completion has finished, in completion order whatever order they finish in."""

from __future__ import annotations

import pytest
from kvtier.engine.completions import Completions, completion_request_ids
from kvtier.engine.outputs import CompletionOutput, RequestMetrics


def metrics(arrival: float, first: float, finished: float, computed: int) -> RequestMetrics:
    return RequestMetrics(arrival, first, finished, 0, 0, 0, computed, 0)


def output(index: int, text: str) -> CompletionOutput:
    return CompletionOutput(index, text, (index,), None, None, "length", None)


def test_one_completion_runs_as_the_request_itself() -> None:
    completions = Completions()
    assert completions.add("req-0", "hi", (1, 2), 1) == ["req-0"]
    assert "req-0" in completions and completions.ids("req-0") == ["req-0"]
    assert completions.request_of("req-0") == "req-0" and completions.index_of("req-0") == 0
    done = completions.finish("req-0", output(0, "a"), metrics(1.0, 2.0, 3.0, 2))
    assert done is not None and done.request_id == "req-0" and done.prompt == "hi"
    assert [c.text for c in done.outputs] == ["a"] and done.metrics.computed_tokens == 2
    assert "req-0" not in completions
    with pytest.raises(KeyError):
        completions.ids("req-0")


def test_the_output_waits_for_every_completion_and_keeps_their_order() -> None:
    completions = Completions()
    ids = completions.add("x", None, (5,), 3)
    assert ids == completion_request_ids("x", 3) == ["0_x", "1_x", "2_x"]
    assert [completions.index_of(i) for i in ids] == [0, 1, 2]
    assert {completions.request_of(i) for i in ids} == {"x"}
    assert completions.finish("2_x", output(2, "c"), metrics(1.0, 2.5, 4.0, 1)) is None
    assert completions.finish("0_x", output(0, "a"), metrics(1.0, 2.0, 3.0, 1)) is None
    assert "x" in completions
    done = completions.finish("1_x", output(1, "b"), metrics(1.5, 2.2, 3.5, 1))
    assert done is not None and [c.text for c in done.outputs] == ["a", "b", "c"]
    # Earliest arrival and first token, latest finish, tokens summed.
    assert (done.metrics.arrival_time, done.metrics.first_token_time,
            done.metrics.finished_time, done.metrics.computed_tokens) == (1.0, 2.0, 4.0, 3)
    assert "x" not in completions
