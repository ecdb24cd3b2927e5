"""`kvtier bench serve --url`: the `bench serve` workload driven over HTTP at a running server.

The same seeded conversations as the in-process benchmark (cli/bench/serve.py): a shared
system prompt, `num_rounds` questions per conversation, each answer `max_tokens` tokens
long (greedy, `ignore_eos`), the history growing every round. `num_conversations` closed-loop
clients each stream their requests from `/v1/completions` (prompts as token ids, answers
read back as token ids through `return_token_ids`), so the server always has up to
`num_conversations` requests. Timings are the client's: TTFT from sending a request to its
first token, TPOT from the first token to the last over the tokens after the first.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from kvtier.cli.bench.longctx import summarize
from kvtier.cli.bench.serve import ServeConfig, make_conversations

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class _Record:
    """One request as its client saw it."""

    ttft_s: float
    tpot_s: float | None
    num_tokens: int
    prompt_tokens: int
    cached_tokens: int


async def _send(client: httpx.AsyncClient, model: str, prompt: list[int],
                config: ServeConfig) -> tuple[_Record, list[int]]:
    payload = {"model": model, "prompt": prompt, "max_tokens": config.max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True,
               "return_token_ids": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    token_ids: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise ValueError(f"the server answered {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ValueError(f"the server failed a request: {chunk['error']}")
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                if new:
                    last = time.perf_counter()
                    first = first if first is not None else last
                    token_ids += new
            usage = chunk.get("usage") or usage
    if first is None or last is None:
        raise ValueError("the server streamed no token ids; is it `kvtier serve`?")
    tpot = (last - first) / (len(token_ids) - 1) if len(token_ids) > 1 else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return _Record(first - start, tpot, len(token_ids), len(prompt), cached), token_ids


async def _drive(url: str, api_key: str | None, config: ServeConfig, timeout_s: float,
                 progress: Progress) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=config.num_conversations + 2)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=timeout_s) as client:
        response = await client.get("/v1/models")
        if response.status_code != 200:
            raise ValueError(f"GET {url}/v1/models answered {response.status_code}: "
                             f"{response.text[:300]}")
        card = response.json()["data"][0]
        if "vocab_size" not in card:
            raise ValueError(f"{url} does not report vocab_size in /v1/models; the "
                             "workload sends token ids and needs a kvtier server")
        if config.context_tokens > card.get("max_model_len", config.context_tokens):
            raise ValueError(f"a conversation reaches {config.context_tokens} tokens, past the "
                             f"model's context ({card['max_model_len']}); use fewer rounds")
        system, questions = make_conversations(config, card["vocab_size"])
        records: list[_Record] = []

        async def conversation(index: int) -> None:
            history = list(system)
            for round_index in range(config.num_rounds):
                history += questions[index][round_index]
                record, answer = await _send(client, card["id"], history, config)
                records.append(record)
                history += answer
                progress(f"{len(records)} of {config.num_conversations * config.num_rounds} "
                         "requests done")

        start = time.perf_counter()
        await asyncio.gather(*(conversation(i) for i in range(config.num_conversations)))
        elapsed = time.perf_counter() - start
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    generated = sum(r.num_tokens for r in records)
    return {
        "bench": "serve",
        "url": url,
        "model_id": card["id"],
        "config": {k: v for k, v in asdict(config).items()
                   if k in ("num_conversations", "num_rounds", "system_tokens", "user_tokens",
                            "max_tokens", "seed")},
        "elapsed_s": elapsed,
        "num_requests": len(records),
        "generated_tokens": generated,
        "throughput_tok_s": generated / elapsed,
        "ttft_s": summarize([r.ttft_s for r in records]),
        "tpot_s": summarize(tpots) if tpots else None,
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_prompt_tokens": sum(r.cached_tokens for r in records),
    }


def run_remote_serve_bench(url: str, config: ServeConfig, api_key: str | None = None,
                           timeout_s: float = 600.0,
                           progress: Progress | None = None) -> dict[str, Any]:
    """Drive the workload of `config` (its workload sizes; the engine options are the
    server's) against the OpenAI-compatible server at `url`; return a JSON-ready dict with
    throughput (generated tokens/s), TTFT and TPOT p50/p90/p99, and cached prompt tokens.
    Raises ValueError when the server is not a kvtier server or answers an error, and
    httpx's errors when it cannot be reached."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    return asyncio.run(_drive(url, api_key, config, timeout_s, progress or (lambda _: None)))


def print_remote(result: dict[str, Any]) -> None:
    """The result as a table."""
    from kvtier.cli.common import print_table

    config = result["config"]
    ttft, tpot = result["ttft_s"], result["tpot_s"]

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:,.1f}"

    print_table(f"bench serve --url {result['url']}: {config['num_conversations']} "
                f"conversations x {config['num_rounds']} rounds, {result['model_id']}; "
                "TTFT and TPOT in ms",
                ("requests", "tok/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
                 "cached prompt tokens"),
                [(result["num_requests"], f"{result['throughput_tok_s']:,.1f}",
                  ms(ttft["p50"]), ms(ttft["p90"]), ms(ttft["p99"]),
                  *((ms(tpot["p50"]), ms(tpot["p90"]), ms(tpot["p99"])) if tpot
                    else ("-", "-", "-")),
                  f"{result['cached_prompt_tokens']:,} of {result['prompt_tokens']:,}")])
