"""The sampler: greedy is argmax, seeded draws repeat, top-k / top-p cut the support, and
draws follow the softmax of logits / temperature."""

from __future__ import annotations

import pytest
import torch
from kvtier.engine.sampler import SamplingParams, make_generator, sample

NUM_DRAWS = 4000


def draw(logits_row: torch.Tensor, params: SamplingParams, num_draws: int = NUM_DRAWS,
         seed: int = 0) -> torch.Tensor:
    """Token ids of `num_draws` draws from one logits row: a batch of equal rows sharing one
    seeded generator, so the draws are independent and repeatable."""
    generator = torch.Generator().manual_seed(seed)
    logits = logits_row[None, :].expand(num_draws, -1)
    return sample(logits, [params] * num_draws, [generator] * num_draws)


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0],
                           [5.0, -1.0, 5.0, 5.0],
                           [-2.0, -3.0, -1.5, -9.0]])
    params = [SamplingParams()] * 3
    assert sample(logits, params, [None] * 3).tolist() == [1, 0, 2]
    big = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(big, [SamplingParams()] * 16, [None] * 16), big.argmax(-1))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (10, 11, 12)]

    def run(rows: list[int]) -> list[list[int]]:
        generators = [make_generator(params[r], "cpu") for r in rows]
        out = [sample(logits[rows], [params[r] for r in rows], generators) for _ in range(30)]
        return torch.stack(out).T.tolist()  # [len(rows), 30]

    batched = run([0, 1, 2])
    assert batched == run([0, 1, 2])
    assert run([1]) == [batched[1]]  # same draws alone as in the batch
    assert batched[0] != batched[1]
    assert make_generator(SamplingParams(temperature=1.0), "cpu") is None
    assert make_generator(SamplingParams(seed=3), "cpu") is None  # greedy needs no RNG


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        ids = draw(logits, SamplingParams(temperature=temperature))
        freqs = torch.bincount(ids, minlength=4).float() / NUM_DRAWS
        expected = torch.softmax(logits / temperature, dim=0)
        torch.testing.assert_close(freqs, expected, atol=0.03, rtol=0)


def test_top_k_restricts_the_support():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.0])
    ids = draw(logits, SamplingParams(temperature=2.0, top_k=3))
    assert set(ids.tolist()) == {1, 3, 5}
    ids = draw(logits, SamplingParams(temperature=2.0, top_k=1), num_draws=200)
    assert set(ids.tolist()) == {1}
    ids = draw(logits, SamplingParams(temperature=2.0, top_k=100))  # k > vocab: no cut
    assert set(ids.tolist()) == set(range(6))


def test_top_p_restricts_the_support():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    ids = draw(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert set(ids.tolist()) == {1, 3}  # 0.5 + 0.3 reaches 0.75
    freqs = torch.bincount(ids, minlength=4).float() / NUM_DRAWS
    torch.testing.assert_close(freqs, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=0.03, rtol=0)
    ids = draw(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert set(ids.tolist()) == {1, 2, 3}
    ids = draw(logits, SamplingParams(temperature=1.0, top_p=0.1), num_draws=200)
    assert set(ids.tolist()) == {1}  # the most likely token always stays
    ids = draw(logits, SamplingParams(temperature=1.0, top_p=0.75, top_k=1), num_draws=200)
    assert set(ids.tolist()) == {1}


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(), SamplingParams(temperature=1.5, seed=1),
              SamplingParams(), SamplingParams(temperature=1.5, top_k=2, seed=2)]
    generators = [make_generator(p, "cpu") for p in params]
    for _ in range(20):
        ids = sample(logits, params, generators)
        assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()
        assert int(ids[3]) in logits[3].topk(2).indices.tolist()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -2}, "top_k"),  # -1 is vLLM's "off", like 0
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
])
def test_bad_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_and_length_mismatch():
    params = SamplingParams(stop_token_ids=[4, 5])
    assert params.stop_token_ids == (4, 5) and params.greedy and params.max_tokens == 16
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(ValueError, match="one of each per request"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None, None])
