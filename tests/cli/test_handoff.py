"""Prefill/decode disaggregation with real processes: `kvtier serve --role prefill` hands a
prompt's KV to `kvtier serve --role decode` over loopback, SmolLM2 in float32 on the CPU.

- Over each transport (Mooncake TCP, Redis, torch.distributed with gloo: the NCCL code
  path on CPU tensors), the decode instance then answers with the greedy tokens of one
  engine that computed everything, its prompt found in its GPU pool.
- A later turn sends only its new blocks.
- Over torch.distributed every block is a group of its own and three sends may await their
  commits: concurrent handoffs' groups interleave, and each lands where it belongs.
- A prefill instance killed mid-handoff leaves the decode instance answering correctly:
  its reservation expires, what landed is used and the rest computed.
- A decode instance that cannot be reached gives the prefill endpoint a 502.
- A handoff the decode instance ends mid-way (its commits answered 404) leaves the NCCL
  pair in step: the next handoff over it lands.
- A commit lost on its way breaks the pair; both instances form it again, and the next
  handoff over it lands. So does a pair whose prefill instance was killed mid-handoff (the
  decode instance answers that prompt right) and started again, then its decode instance.

One decode and one prefill process serve every transport (starting a process costs
seconds); the kill test starts a prefill process of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
from kvtier.cli.bench.cluster import Process, free_port, launch, wait_healthy
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel

from kvtier.handoff.mooncake import mooncake_available
from tests.cli.handoff_proxy import EndingProxy
from tests.cli.serve_harness import MODEL_NAME, at_once, parse_metrics, wait_for_pair
from tests.model_cache import seed_model_cache

pytestmark = pytest.mark.slow

_START_TIMEOUT_S = 180.0
MAX_TOKENS = 6


def _serve(cache_dir: Path, log: Path, *args: str) -> Process:
    """A `kvtier serve` of SmolLM2 on the CPU with `args`, healthy; its output in `log`."""
    instance = launch(log.stem, ["serve", MODEL_NAME, "--device", "cpu", "--dtype", "float32",
                                 "--gpu-blocks", "256", "--no-host-cache", "--no-disk-cache",
                                 *args], log.parent, cache_dir=cache_dir, num_threads=1)
    try:
        wait_healthy([instance], _START_TIMEOUT_S)
    except BaseException:
        instance.stop(60)
        raise
    return instance


def _metrics(instance: Process) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{instance.url}/metrics", timeout=30).text)


@dataclass(slots=True)
class Pair:
    decode: Process
    prefill: Process
    transports: list[str]
    cache_dir: Path
    tmp: Path


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         smollm2_conversion: Path) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("handoff")
    cache_dir = seed_model_cache(tmp / "cache", smollm2_conversion)
    nccl = f"tcp://127.0.0.1:{free_port()}"
    # A reservation expires 10 s after its last commit: on a loaded 2-core CI machine a
    # fresh prefill instance's first commit can come later than a shorter expiry.
    decode_args = ["--role", "decode", "--handoff-timeout", "10", "--handoff-nccl", nccl,
                   "--handoff-nccl-backend", "gloo"]
    try:
        redis = request.getfixturevalue("redis_server")
    except pytest.skip.Exception:
        redis = None  # the Redis transport's test skips, saying why
    if redis is not None:
        decode_args += ["--handoff-redis", redis.url]
    decode = _serve(cache_dir, tmp / "decode.log", *decode_args)
    prefill = None
    try:
        # One block (720 KiB) per group, three awaiting their commits: a prompt is many
        # sends, and their commits are under way together.
        prefill = _serve(cache_dir, tmp / "prefill.log", "--role", "prefill",
                         "--handoff-nccl", nccl, "--handoff-nccl-backend", "gloo",
                         "--handoff-nccl-group-mib", "1", "--handoff-nccl-in-flight", "3")
        wait_for_pair(prefill.url, 60)  # it forms in the background
        info = httpx.get(f"{decode.url}/v1/handoff/info").json()
        assert info["role"] == "decode" and info["model"] == MODEL_NAME
        yield Pair(decode, prefill, info["transports"], cache_dir, tmp)
    finally:
        for instance in (prefill, decode):
            if instance is not None:
                instance.stop(60)


@pytest.fixture(scope="module")
def colocated(model: LoadedModel) -> Iterator[LLM]:
    """One engine doing prefill and decode: the tokens to match."""
    with LLM(model, gpu_blocks=256, host_cache=False, disk_cache=False) as llm:
        yield llm


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + 131 * i) % 5000 + 50 for i in range(num_tokens)]


def _hand_over(pair: Pair, prompt: list[int], transport: str | None,
               prefill: Process | None = None, timeout_s: float = 60.0,
               decode_url: str | None = None) -> httpx.Response:
    return httpx.post(f"{(prefill or pair.prefill).url}/v1/handoff/prefill", json={
        "endpoint": "/v1/completions",
        "request": {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0},
        "decode": decode_url or pair.decode.url, "transport": transport,
        "timeout_s": timeout_s}, timeout=120)


def _decode(pair: Pair, prompt: list[int]) -> tuple[list[int], int]:
    """The decode instance's greedy tokens for `prompt`, and its cached prompt tokens."""
    answer = httpx.post(f"{pair.decode.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True}, timeout=120).json()
    return (answer["choices"][0]["token_ids"],
            answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _reference(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0]
    return list(out.outputs[0].token_ids)


def _check_available(pair: Pair, transport: str) -> None:
    if transport not in pair.transports:
        reason = {"mooncake": mooncake_available(),
                  "redis": "redis-server is not installed (apt-get install -y redis-server)"}
        pytest.skip(reason.get(transport) or f"the decode instance has no {transport}")


@pytest.mark.parametrize("transport", ["mooncake", "redis", "nccl"])
def test_each_transport_hands_the_prompt_over(pair: Pair, colocated: LLM,
                                              transport: str) -> None:
    _check_available(pair, transport)
    prompt = _prompt(len(transport), 117)  # 7 full blocks and 5 tokens
    response = _hand_over(pair, prompt, transport)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["transport"] == transport and result["prompt_tokens"] == 117
    assert (result["blocks_total"], result["blocks_sent"], result["blocks_skipped"]) == (7, 7, 0)
    tokens, cached = _decode(pair, prompt)
    assert tokens == _reference(colocated, prompt)
    assert cached == 7 * 16  # the handed-over blocks, none computed again
    sample = f'kvtier_handoffs_total{{outcome="ok",role="decode",transport="{transport}"}}'
    assert _metrics(pair.decode)[sample] >= 1


def test_concurrent_handoffs_over_nccl_each_land_where_they_belong(
        pair: Pair, colocated: LLM) -> None:
    _check_available(pair, "nccl")
    prompts = [_prompt(20 + k, 150 + 17 * k) for k in range(3)]  # 9, 10 and 11 full blocks
    responses = at_once([partial(_hand_over, pair, prompt, "nccl") for prompt in prompts], 180)
    for k, prompt in enumerate(prompts):
        assert responses[k].status_code == 200, responses[k].text
        result = responses[k].json()
        assert (result["blocks_sent"], result["groups"]) == (9 + k, 9 + k)
        tokens, cached = _decode(pair, prompt)
        assert tokens == _reference(colocated, prompt)
        assert cached == (9 + k) * 16
    rejected = 'kvtier_handoff_blocks_total{kind="rejected",role="decode",transport="nccl"}'
    assert _metrics(pair.decode).get(rejected, 0) == 0


def test_a_handoffs_holds_go_back_once_its_short_request_took_the_blocks(
        pair: Pair) -> None:
    transport = "mooncake" if "mooncake" in pair.transports else pair.transports[0]
    used_before = _gpu_blocks_used(pair.decode)  # other tests' holds may still be there
    prompt = _prompt(9, 64)  # 4 whole blocks: the request takes blocks 0-2, computes 3
    assert _hand_over(pair, prompt, transport).status_code == 200
    # One token: the request starts and ends in one engine step, never seen by a sweep.
    answer = httpx.post(f"{pair.decode.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=120).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * 16
    deadline = time.monotonic() + 10  # far below --handoff-hold (60 s)
    while (used := _gpu_blocks_used(pair.decode)) > used_before:
        assert time.monotonic() < deadline, f"{used - used_before} blocks still held"
        time.sleep(0.1)


def test_a_later_turn_sends_only_its_new_blocks(pair: Pair, colocated: LLM) -> None:
    transport = "mooncake" if "mooncake" in pair.transports else pair.transports[0]
    first = _prompt(3, 70)
    assert _hand_over(pair, first, transport).status_code == 200
    answer, _ = _decode(pair, first)
    second = first + answer + _prompt(4, 60)  # 136 tokens: 8 full blocks
    result = _hand_over(pair, second, transport).json()
    # The first turn's 4 blocks are held already (and the answer's: block 4 is complete).
    assert result["blocks_total"] == 8 and result["blocks_skipped"] >= 4
    assert result["blocks_sent"] == 8 - result["blocks_skipped"]
    tokens, cached = _decode(pair, second)
    assert tokens == _reference(colocated, second)
    assert cached == 8 * 16


def test_a_prefill_instance_killed_mid_handoff(pair: Pair, colocated: LLM) -> None:
    transport = "mooncake" if "mooncake" in pair.transports else "redis"
    _check_available(pair, transport)
    # Chunks of 16 tokens: the prompt takes many steps, blocks are committed as they come.
    doomed = _serve(pair.cache_dir, pair.tmp / "doomed.log", "--role", "prefill",
                    "--max-num-batched-tokens", "16", "--handoff-nccl-backend", "gloo")
    prompt = _prompt(5, 1200)
    bytes_sample = f'kvtier_handoff_bytes_total{{role="decode",transport="{transport}"}}'
    timeout_sample = (f'kvtier_handoffs_total{{outcome="timeout",role="decode",'
                      f'transport="{transport}"}}')
    before = _metrics(pair.decode)
    outcome: list[object] = []

    def hand_over() -> None:
        try:
            response = _hand_over(pair, prompt, transport, prefill=doomed)
            outcome.append((response.status_code, response.text))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=hand_over)
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while _metrics(pair.decode).get(bytes_sample, 0) <= before.get(bytes_sample, 0):
            assert time.monotonic() < deadline and thread.is_alive(), \
                f"no block landed: {outcome}"
            time.sleep(0.05)
        doomed.kill()  # mid-handoff: blocks have landed, the prompt is not done
        thread.join(60)
        assert outcome and isinstance(outcome[0], httpx.HTTPError), outcome
        # The reservation expires (--handoff-timeout 10); the decode instance never waits.
        deadline = time.monotonic() + 60
        while _metrics(pair.decode).get(timeout_sample, 0) <= before.get(timeout_sample, 0):
            assert time.monotonic() < deadline, "the reservation did not expire"
            time.sleep(0.2)
        tokens, cached = _decode(pair, prompt)
        assert tokens == _reference(colocated, prompt)
        assert 0 < cached < 1200 - 16  # what landed is used, the rest computed
    finally:
        doomed.stop()


def test_an_unreachable_decode_instance_is_a_502(pair: Pair) -> None:
    gone = Pair(Process("gone", pair.decode.proc, f"http://127.0.0.1:{free_port()}",
                        pair.decode.log), pair.prefill, [], pair.cache_dir, pair.tmp)
    response = _hand_over(gone, _prompt(6, 40), None)
    assert response.status_code == 502, response.text
    assert "cannot reach the decode instance" in response.json()["error"]["message"]
    # The prefill had started (the reservation is made while it computes): every block it
    # tapped for the handoff is given back.
    deadline = time.monotonic() + 10
    while (used := _gpu_blocks_used(pair.prefill)) != 0:
        assert time.monotonic() < deadline, f"{used} prefill blocks still referenced"
        time.sleep(0.1)
    bad = httpx.post(f"{pair.prefill.url}/v1/handoff/prefill", json={
        "endpoint": "/v1/embeddings", "request": {}, "decode": pair.decode.url})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "endpoint"


def _gpu_blocks_used(instance: Process) -> float:
    for line in httpx.get(f"{instance.url}/metrics").text.splitlines():
        if line.startswith('kvtier_gpu_blocks{state="used"}'):
            return float(line.split()[-1])
    raise AssertionError("no kvtier_gpu_blocks in /metrics")


def test_commits_waiting_for_their_turn_never_hold_up_the_ones_they_wait_for(
        pair: Pair) -> None:
    # More commits waiting for the part before them than the decode instance's default
    # executor has threads (cores + 4): each runs on a thread of its own, so the parts they
    # wait for still get in, and every commit is answered.
    transport = pair.transports[0]
    num = 16
    ids = []
    for k in range(num):
        answer = httpx.post(f"{pair.decode.url}/internal/handoff/reserve", json={
            "token_ids": _prompt(60 + k, 40), "cache_salt": None, "transport": transport},
            timeout=30)
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["handoff_id"])

    def commit(handoff_id: str, part: int) -> httpx.Response:
        return httpx.post(f"{pair.decode.url}/internal/handoff/commit", json={
            "handoff_id": handoff_id, "transport": transport, "blocks": [],
            "last": part == 1, "part": part}, timeout=60)

    later: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: later.extend(
        at_once([partial(commit, handoff_id, 1) for handoff_id in ids], 120)))
    waiting.start()
    time.sleep(0.5)  # the second parts are waiting at the decode instance
    first = at_once([partial(commit, handoff_id, 0) for handoff_id in ids], 120)
    waiting.join(120)
    assert [r.status_code for r in first] == [200] * num, [r.text for r in first]
    assert [r.status_code for r in later] == [200] * num, [r.text for r in later]


def _lands_over_nccl(pair: Pair, colocated: LLM, seed: int) -> None:
    """A 117-token prompt handed over through the pair: the decode instance answers with
    the colocated tokens, its 7 full blocks found cached."""
    prompt = _prompt(seed, 117)
    response = _hand_over(pair, prompt, "nccl")
    assert response.status_code == 200, response.text
    tokens, cached = _decode(pair, prompt)
    assert tokens == _reference(colocated, prompt)
    assert cached == 7 * 16


def test_a_handoff_ended_mid_way_leaves_the_nccl_pair_in_step(pair: Pair,
                                                              colocated: LLM) -> None:
    _check_available(pair, "nccl")
    with EndingProxy(pair.decode.url, end_at=1) as proxy:
        # 8 full blocks, one per send, three sends awaiting their commits: the handoff is
        # ended while sends of it are in flight.
        response = _hand_over(pair, _prompt(40, 130), "nccl", decode_url=proxy.url)
    assert len(proxy.ended) == 1
    assert response.status_code == 502, response.text
    assert "404" in response.json()["error"]["message"]
    # Every send of the ended handoff was received and counted done on both sides: the
    # pair is still ready, no send is left landed at the decode instance, and the next
    # handoff's bytes land where they belong.
    assert "nccl" in httpx.get(f"{pair.prefill.url}/v1/handoff/info").json()["transports"]
    assert _metrics(pair.decode)["kvtier_handoff_pair_landed"] == 0
    _lands_over_nccl(pair, colocated, 41)


def _pair_ready(instance: Process, timeout_s: float = 60.0) -> bool:
    """Wait until `instance` lists the torch.distributed pair among its transports."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "nccl" in httpx.get(f"{instance.url}/v1/handoff/info").json()["transports"]:
            return True
        time.sleep(0.2)
    return False


def test_a_lost_commit_breaks_the_nccl_pair_and_the_pair_forms_again(
        pair: Pair, colocated: LLM) -> None:
    _check_available(pair, "nccl")
    before = _metrics(pair.prefill)["kvtier_handoff_pair_generation"]
    for k in (1, 2):  # twice: each break ends the generation it happened in
        with EndingProxy(pair.decode.url, end_at=k, lose=True) as proxy:
            response = _hand_over(pair, _prompt(40 + 2 * k, 130), "nccl",
                                  decode_url=proxy.url)
        assert len(proxy.ended) == 1
        assert response.status_code == 502, response.text
        # The prefill instance found its send never committed: the pair broke, and both
        # instances formed the next generation without a restart.
        assert _pair_ready(pair.prefill) and _pair_ready(pair.decode)
        for instance in (pair.prefill, pair.decode):
            metrics = _metrics(instance)
            assert metrics["kvtier_handoff_pair_ready"] == 1
            assert metrics["kvtier_handoff_pair_generation"] == before + k
        # The lost commit's send had landed; it went with its generation.
        assert _metrics(pair.decode)["kvtier_handoff_pair_landed"] == 0
        # The next handoff goes over the new generation, its bytes where they belong.
        _lands_over_nccl(pair, colocated, 41 + 2 * k)


def test_either_instance_of_an_nccl_pair_restarted_forms_the_pair_again(
        pair: Pair, colocated: LLM) -> None:
    nccl = ["--handoff-nccl", f"tcp://127.0.0.1:{free_port()}", "--handoff-nccl-backend",
            "gloo"]
    decode_args = ("--role", "decode", "--handoff-timeout", "3", *nccl)
    # Chunks of 16 tokens: a prompt takes many steps, its blocks committed as they come.
    prefill_args = ("--role", "prefill", "--max-num-batched-tokens", "16", *nccl)
    tmp = pair.tmp
    instances = [_serve(pair.cache_dir, tmp / "decode1.log", *decode_args),
                 _serve(pair.cache_dir, tmp / "prefill1.log", *prefill_args)]
    try:
        assert _pair_ready(instances[0]) and _pair_ready(instances[1])
        # The prefill instance dies mid-handoff: the decode instance answers that prompt
        # right (what landed is used, the rest computed) ...
        _kill_mid_handoff(Pair(*instances, ["nccl"], pair.cache_dir, tmp), colocated)
        for k, replaced in enumerate((1, 0)):  # ... and a new one takes its place; then the
            if replaced == 0:                  # decode instance is restarted
                instances[0].kill()
            name = f"{'prefill' if replaced else 'decode'}{2 + k}"
            args = prefill_args if replaced else decode_args
            instances[replaced] = _serve(pair.cache_dir, tmp / f"{name}.log", *args)
            # The other instance joins the new one's pair without a restart of its own.
            assert _pair_ready(instances[0]) and _pair_ready(instances[1]), name
            restarted = Pair(*instances, ["nccl"], pair.cache_dir, tmp)
            _lands_over_nccl(restarted, colocated, 50 + k)
        # torch logs a stack trace for each look into a store that is gone: the decode
        # instance looked a few times when its prefill instance died, not at every poll.
        assert (tmp / "decode1.log").read_text().count("Exception raised from") < 5
    finally:
        for instance in instances:
            instance.stop(60)


def _kill_mid_handoff(pair: Pair, colocated: LLM) -> None:
    """Kill `pair`'s prefill instance once some blocks of a long prompt have landed over
    NCCL; the decode instance then answers that prompt with the colocated tokens."""
    prompt = _prompt(55, 1200)
    landed = 'kvtier_handoff_bytes_total{role="decode",transport="nccl"}'
    outcome: list[object] = []

    def hand_over() -> None:
        try:
            response = _hand_over(pair, prompt, "nccl")
            outcome.append((response.status_code, response.text))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=hand_over)
    thread.start()
    deadline = time.monotonic() + 120
    while not _metrics(pair.decode).get(landed, 0):
        assert time.monotonic() < deadline and thread.is_alive(), \
            f"no block landed: {outcome}"
        time.sleep(0.05)
    pair.prefill.kill()
    thread.join(60)
    assert outcome and isinstance(outcome[0], httpx.HTTPError), outcome
    # The decode instance never waits for the handoff: what landed is cached already.
    tokens, cached = _decode(pair, prompt)
    assert tokens == _reference(colocated, prompt)
    assert 0 < cached < 1200 - 16
