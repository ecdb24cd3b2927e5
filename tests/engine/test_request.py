"""Request records: token bookkeeping, block hashes kept in step, and stop conditions."""

from __future__ import annotations

import pytest
import torch
from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.engine.request import Request, RequestId, RequestStatus, check_token_ids

from kvtier.hashing import BlockHasher, hash_blocks, namespace_hash
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)


def make_request(prompt: list[int], max_num_tokens: int = 64, **kwargs) -> Request:
    namespace = namespace_hash("test-model", LAYOUT)
    return Request(RequestId("r"), tuple(prompt), params=None,
                   hasher=BlockHasher(namespace, LAYOUT.block_size),
                   max_num_tokens=max_num_tokens, arrival_time=0.0, **kwargs)


def running(request: Request) -> Request:
    """Pretend the prompt was computed (what the scheduler does before a sample)."""
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens
    return request


def test_new_request_hashes_its_full_prompt_blocks() -> None:
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks of 4 and a partial one
    request = make_request(prompt)
    assert request.status is RequestStatus.WAITING
    assert request.num_tokens == 10 and request.num_output_tokens == 0
    namespace = namespace_hash("test-model", LAYOUT)
    assert request.block_hashes == hash_blocks(namespace, prompt, 4)
    assert request.parent_hash(0) == namespace
    assert request.parent_hash(1) == request.block_hashes[0]
    assert request.block_token_ids(1) == (14, 15, 16, 17)
    assert request.num_blocks_for(10) == 3 and request.num_blocks_for(12) == 3


def test_appended_tokens_extend_the_hash_chain() -> None:
    request = running(make_request([1, 2, 3, 4, 5, 6]))
    for token_id in (7, 8, 9):
        assert request.append_token(token_id, now=1.0) is None
        request.num_computed_tokens = request.num_tokens
    assert request.output_token_ids == [7, 8, 9]
    namespace = namespace_hash("test-model", LAYOUT)
    assert request.block_hashes == hash_blocks(namespace, list(range(1, 10)), 4)
    assert request.first_token_time == 1.0


def test_eos_stops_unless_ignored() -> None:
    request = running(make_request([5, 6, 7], eos_token_ids=frozenset({2})))
    assert request.append_token(2, now=0.0) == "stop"
    ignoring = running(make_request([5, 6, 7], eos_token_ids=frozenset({2}), ignore_eos=True))
    assert ignoring.append_token(2, now=0.0) is None


def test_stop_token_ids_stop_even_when_eos_is_ignored() -> None:
    request = running(make_request([5, 6, 7], ignore_eos=True,
                                   stop_token_ids=frozenset({9})))
    assert request.append_token(8, now=0.0) is None
    request.num_computed_tokens = request.num_tokens
    assert request.append_token(9, now=0.0) == "stop"


def test_length_is_reached_at_max_num_tokens() -> None:
    request = running(make_request([5, 6, 7], max_num_tokens=5))
    assert request.append_token(8, now=0.0) is None
    request.num_computed_tokens = request.num_tokens
    assert request.append_token(8, now=0.0) == "length"
    assert request.num_tokens == 5


def test_sampling_before_the_prompt_is_computed_is_an_error() -> None:
    request = make_request([5, 6, 7])
    request.status = RequestStatus.RUNNING
    with pytest.raises(AssertionError, match="sampled before"):
        request.append_token(1, now=0.0)


def test_reset_blocks_forgets_the_computed_prefix() -> None:
    request = running(make_request(list(range(8))))
    request.num_cached_blocks = 2
    assert request.reset_blocks() == []
    assert request.num_computed_tokens == 0 and request.num_cached_blocks == 0
    assert len(request.block_hashes) == 2  # hashes depend on tokens only, they stay


def test_empty_prompt_and_no_room_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        make_request([])
    with pytest.raises(ValueError, match="no room"):
        make_request([1, 2, 3], max_num_tokens=3)


def test_check_token_ids_rejects_out_of_vocabulary_ids() -> None:
    assert check_token_ids([0, 5, 9], vocab_size=10) == (0, 5, 9)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        check_token_ids([3, 10], vocab_size=10)
    with pytest.raises(ValueError, match="empty"):
        check_token_ids([], vocab_size=10)


def test_metrics_and_output_dict_report_where_tokens_came_from() -> None:
    request = running(make_request([1, 2, 3]))
    request.arrival_time = 10.0
    request.counters.cached_host = 16
    request.counters.cached_disk = 32
    request.counters.computed = 3
    request.append_token(4, now=10.5)
    metrics = request.metrics()
    assert metrics.ttft_s == pytest.approx(0.5)
    assert metrics.cached_tokens == 48
    completion = CompletionOutput(0, "", (4,), None, None, "length")
    output = RequestOutput("r", None, request.prompt_token_ids, [completion], True, metrics)
    entry = output.to_dict()
    assert entry["cached_tokens"] == {"gpu": 0, "host": 16, "disk": 32, "remote": 0}
    assert entry["outputs"][0]["token_ids"] == [4] and entry["computed_tokens"] == 3


def test_block_metas_are_built_once_and_name_each_full_block() -> None:
    hasher = BlockHasher(namespace_hash("metas", LAYOUT), 4)
    request = Request(RequestId("m"), tuple(range(10, 21)), params=None, hasher=hasher,
                      max_num_tokens=20, arrival_time=0.0)
    second = request.block_meta(1)
    assert request.block_meta(1) is second  # built once
    first = request.block_meta(0)
    assert (first.block_hash, first.parent_hash, first.token_ids) == \
        (request.block_hashes[0], hasher.namespace, (10, 11, 12, 13))
    assert (second.parent_hash, second.token_ids) == (first.block_hash, (14, 15, 16, 17))
