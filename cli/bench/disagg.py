"""`kvtier bench disagg`: goodput under latency SLOs, colocated against disaggregated.

The same devices serve the same workload twice behind `kvtier router`: colocated (one
`kvtier serve` instance of role both per device, whole requests to the one with fewest in
flight) and disaggregated (a prefill instance on --prefill-device, a decode instance on
--decode-device, the prompt's KV handed over between them). The bench starts the instances
and the routers itself (or takes the instances' URLs), one mode after the other.

Workload: `num_requests` per arrival rate, each prompt `long_tokens` (with probability
`long_fraction`) or `short_tokens` random token ids, each answer `max_tokens` greedy tokens
(`ignore_eos`), streamed from `/v1/completions`; requests arrive as a Poisson process of the
rate (seeded exponential gaps), or for rate 0 one at a time, each sent when the one before
has ended (what a request costs with no queueing: no goodput); each rate with fresh prompts
(no prefix cache carried from one rate to the next) that are the same in both modes.
Timings are the client's: TTFT from sending a request to its first token; TPOT from the
first token to the last over the tokens after the first.

Goodput: a mode meets the SLO at a rate when the P90 TTFT <= --ttft-slo and the P90 TPOT
<= --tpot-slo over that rate's requests; its goodput is the highest rate of the sweep at
which it does (0 when none), in requests/s for the devices used (both modes use the same).
Each rate also reports the requests/s that met both SLOs one by one.

Beside them: the handoffs' bytes and bandwidth as the prefill instance reported them
(`x-kvtier-handoff`), against the link's ceiling measured in the same run (`link.py`: one
large NCCL send/recv between the two devices' processes, gloo on the CPU, and between two
GPUs, unless another transport is asked for, a copy engine's peer copy beside it (CUDA
IPC's own path); with `--transport mooncake`, one-sided Mooncake writes of the same size
between two processes' host buffers; none for redis), and whether the disaggregated
answers equal the colocated ones token for token. Requests whose prompt the decode
instance computed itself are counted by the router's reason (`fallback_reasons`), and each
instance's `pair_generation` says whether its NCCL pair broke and formed again during the
run (0: never). This module runs the instances and the clients; the report's figures and
tables are `kvtier.cli.bench.disagg_report`'s.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer
from kvtier.cli.bench.cluster import Process, free_port, launch, wait_healthy
from kvtier.cli.bench.disagg_report import Record, handoff_report, print_disagg, rate_report
from kvtier.cli.bench.link import measure_link, measure_mooncake, measure_peer_copy
from kvtier.cli.common import print_json

Progress = Callable[[str], None]
MODES = ("colocated", "disaggregated")
#: Seed offset of the warm-up requests (never a rate's).
_WARMUP_SEED = 1_000_003


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """What `kvtier bench disagg` runs; its options under the same names."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    prefill_device: str = "auto"
    decode_device: str = "auto"
    colocated_devices: tuple[str, ...] = ()
    transport: str | None = None
    modes: tuple[str, ...] = MODES
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    num_requests: int = 64
    long_tokens: int = 4096
    short_tokens: int = 256
    long_fraction: float = 0.25
    max_tokens: int = 64
    ttft_slo_s: float = 0.4
    tpot_slo_s: float = 0.04
    seed: int = 0
    link_bytes: int = 2**30
    serve_args: tuple[str, ...] = ()
    #: The disaggregated router's --prefill-queue-limit (None: no limit).
    prefill_queue_limit: int | None = None
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    both_urls: tuple[str, ...] = ()
    start_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    #: Where the instances' and routers' logs are kept (None: a temporary directory,
    #: deleted at the end).
    logs_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_requests", "long_tokens", "short_tokens", "max_tokens",
                     "link_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        if self.prefill_queue_limit is not None and self.prefill_queue_limit < 1:
            raise ValueError(f"--prefill-queue-limit must be at least 1, got "
                             f"{self.prefill_queue_limit}")
        if not self.rates or min(self.rates) < 0:
            raise ValueError(f"--rates takes requests/s (0: one request at a time), got "
                             f"{self.rates}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"--long-fraction must lie in [0, 1], got {self.long_fraction}")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("--ttft-slo and --tpot-slo must be > 0 seconds")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"--modes takes {' and/or '.join(MODES)}, got {self.modes}")
        if bool(self.prefill_urls) != bool(self.decode_urls):
            raise ValueError("--prefill-url and --decode-url go together")


@dataclass(frozen=True, slots=True)
class _Request:
    arrival_s: float
    prompt: list[int]
    long: bool


def resolve_devices(config: DisaggConfig) -> tuple[str, str, tuple[str, ...]]:
    """The prefill, decode and colocated devices: "auto" is cuda:0 / cuda:1 with two GPUs,
    cuda:0 for both with one, cpu without."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    defaults = ("cuda:0", "cuda:1") if count >= 2 else ("cuda:0",) * 2 if count else \
        ("cpu", "cpu")
    prefill = defaults[0] if config.prefill_device == "auto" else config.prefill_device
    decode = defaults[1] if config.decode_device == "auto" else config.decode_device
    return prefill, decode, config.colocated_devices or (prefill, decode)


def make_workload(config: DisaggConfig, vocab_size: int, rate: float,
                  seed_offset: int) -> list[_Request]:
    """`num_requests` seeded requests arriving as a Poisson process of `rate` (0: no
    arrival times; `_play` then sends each once the one before has ended)."""
    rng = np.random.default_rng([config.seed, seed_offset])
    gaps = rng.exponential(1.0 / rate, config.num_requests) if rate > 0 \
        else np.zeros(config.num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    requests = []
    for arrival in arrivals:
        long = bool(rng.random() < config.long_fraction)
        length = config.long_tokens if long else config.short_tokens
        prompt = rng.integers(0, vocab_size, length).tolist()
        requests.append(_Request(float(arrival), prompt, long))
    return requests


# ---- the instances ---------------------------------------------------------------------

def _serve_args(config: DisaggConfig, device: str, role: str | None) -> list[str]:
    args = ["serve", config.model, "--device", device, "--dtype", config.dtype,
            "--no-disk-cache", "--max-num-requests", str(4 * config.num_requests + 16)]
    if role is not None:
        args += ["--role", role]
    return args + list(config.serve_args)


@contextmanager
def _cluster(mode: str, config: DisaggConfig, devices: tuple[str, str, tuple[str, ...]],
             logs: Path, progress: Progress
             ) -> Iterator[tuple[str, list[str], dict[str, list[str]]]]:
    """The router's URL over the mode's instances (started here unless given as URLs), a
    line per instance, and the instances' URLs by part; every process started here is
    stopped on leaving."""
    prefill_device, decode_device, colocated_devices = devices
    started: list[Process] = []
    try:
        if mode == "colocated":
            urls = {"both": list(config.both_urls)}
            if not urls["both"]:
                started += [launch(f"both{i}", _serve_args(config, device, None), logs,
                                   num_threads=None)
                            for i, device in enumerate(colocated_devices)]
                urls["both"] = [p.url for p in started]
                where = [f"both on {d}" for d in colocated_devices]
            else:
                where = [f"both at {url}" for url in urls["both"]]
        else:
            urls = {"prefill": list(config.prefill_urls), "decode": list(config.decode_urls)}
            if not urls["prefill"]:
                pair: list[str] = []
                # The pair's torch.distributed group (CUDA IPC is on by default on GPUs).
                if config.transport in (None, "nccl"):
                    pair = ["--handoff-nccl", f"tcp://127.0.0.1:{free_port()}"]
                started += [launch("prefill", _serve_args(config, prefill_device, "prefill")
                                   + pair, logs, num_threads=None),
                            launch("decode", _serve_args(config, decode_device, "decode")
                                   + pair, logs, num_threads=None)]
                urls = {"prefill": [started[0].url], "decode": [started[1].url]}
                where = [f"prefill on {prefill_device}", f"decode on {decode_device}"]
            else:
                where = [f"{part} at {url}" for part, given in urls.items() for url in given]
        if started:
            progress(f"{mode}: starting {len(started)} instances ({', '.join(where)})")
            wait_healthy(started, config.start_timeout_s)
        router_args = ["router", "--decode-timeout", str(config.request_timeout_s)]
        for part, given in urls.items():
            router_args += [arg for url in given for arg in (f"--{part}", url)]
        if config.transport is not None and mode == "disaggregated":
            router_args += ["--transport", config.transport]
        if config.prefill_queue_limit is not None and mode == "disaggregated":
            router_args += ["--prefill-queue-limit", str(config.prefill_queue_limit)]
        router = launch(f"router-{mode}", router_args, logs)
        started.append(router)
        wait_healthy([router], 120.0)
        yield router.url, where, urls
    finally:
        for process in reversed(started):
            process.stop()


# ---- the client ------------------------------------------------------------------------

async def _send(client: httpx.AsyncClient, model: str, request: _Request,
                config: DisaggConfig, start: float) -> Record:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    payload = {"model": model, "prompt": request.prompt, "max_tokens": config.max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True,
               "return_token_ids": True}
    sent = time.perf_counter()
    first = last = None
    token_ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise ValueError(f"the router answered {response.status_code}: {body[:300]}")
        header = response.headers.get("x-kvtier-handoff")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise ValueError(f"a request failed while streaming: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    last = time.perf_counter()
                    first = first if first is not None else last
                    token_ids += choice["token_ids"]
    if first is None or last is None:
        raise ValueError("the router streamed no token ids; are the instances `kvtier serve`?")
    tpot = (last - first) / (len(token_ids) - 1) if len(token_ids) > 1 else None
    return Record(request.long, first - sent, tpot, token_ids,
                   json.loads(header) if header else None, last - start)


async def _play(url: str, model: str, requests: list[_Request], config: DisaggConfig,
                one_at_a_time: bool = False) -> list[Record]:
    """Send `requests` at their arrival times, or with `one_at_a_time` each once the one
    before has ended (what a request costs with no queueing)."""
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=config.request_timeout_s) as client:
        start = time.perf_counter()
        if one_at_a_time:
            return [await _send(client, model, r, config, start) for r in requests]
        return list(await asyncio.gather(*(_send(client, model, r, config, start)
                                           for r in requests)))


async def _model_card(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        answer = await client.get("/v1/models")
        answer.raise_for_status()
        return answer.json()["data"][0]


def _warm_up(url: str, model: str, config: DisaggConfig, vocab_size: int,
             num_instances: int) -> None:
    """One long and one short request per instance, one at a time: first-use costs
    (kernel compiles, the transport's connection) stay out of the measured rates."""
    rng = np.random.default_rng([config.seed, _WARMUP_SEED])
    for index in range(2 * num_instances):
        long = index % 2 == 0
        length = config.long_tokens if long else config.short_tokens
        request = _Request(0.0, rng.integers(0, vocab_size, length).tolist(), long)
        asyncio.run(_play(url, model, [request], config))


def _pair_generations(urls: dict[str, list[str]]) -> dict[str, list[int | None]]:
    """Per part, each instance's `kvtier_handoff_pair_generation` (how often its NCCL pair
    formed again; None: it has no pair, or its /metrics could not be read)."""
    from prometheus_client.parser import text_string_to_metric_families

    generations: dict[str, list[int | None]] = {}
    for part, given in urls.items():
        for url in given:
            generation = None
            try:
                text = httpx.get(f"{url}/metrics", timeout=30).text
            except httpx.HTTPError:
                text = ""
            for family in text_string_to_metric_families(text):
                if family.name == "kvtier_handoff_pair_generation" and family.samples:
                    generation = int(family.samples[0].value)
            generations.setdefault(part, []).append(generation)
    return generations


@contextmanager
def _logs_dir(kept: str | None) -> Iterator[Path]:
    """`kept` (made if missing), else a temporary directory deleted on leaving."""
    if kept is not None:
        path = Path(kept)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-disagg-") as temporary:
        yield Path(temporary)


def run_disagg_bench(config: DisaggConfig, progress: Progress | None = None
                     ) -> dict[str, Any]:
    """Run the workload over each mode of `config` and return the JSON-ready report (see
    the module's docstring). Raises ValueError for bad options or a failed request, and
    RuntimeError when an instance does not start (with its log's tail)."""
    progress = progress or (lambda _: None)
    devices = resolve_devices(config)
    link = None
    if "disaggregated" in config.modes and not config.prefill_urls \
            and config.transport != "redis":
        progress(f"link: {config.link_bytes / 2**20:,.0f} MiB {devices[0]} -> {devices[1]}")
        if config.transport == "mooncake":
            link = measure_mooncake(config.link_bytes)
        else:
            link = measure_link(devices[0], devices[1], config.link_bytes)
        if config.transport in (None, "cuda_ipc") and devices[0] != devices[1] \
                and all(d.startswith("cuda") for d in devices[:2]):
            # the copy engines' own ceiling, beside the NCCL one
            link["copy_engine"] = measure_peer_copy(devices[0], devices[1], config.link_bytes)
    modes: dict[str, Any] = {}
    tokens: dict[str, list[list[list[int]]]] = {}
    with _logs_dir(config.logs_dir) as logs:
        for mode in config.modes:
            with _cluster(mode, config, devices, logs, progress) as (url, where, urls):
                card = asyncio.run(_model_card(url))
                if config.long_tokens + config.max_tokens > card["max_model_len"]:
                    raise ValueError(f"--long-tokens {config.long_tokens} plus --max-tokens "
                                     f"{config.max_tokens} pass the model's context "
                                     f"({card['max_model_len']})")
                progress(f"{mode}: warming up")
                _warm_up(url, card["id"], config, card["vocab_size"], len(where))
                runs, records_of_mode = [], []
                for index, rate in enumerate(config.rates):
                    progress(f"{mode}: {config.num_requests} requests " + (
                        f"at {rate:g} req/s" if rate else "one at a time"))
                    workload = make_workload(config, card["vocab_size"], rate, index)
                    records = asyncio.run(_play(url, card["id"], workload, config,
                                                one_at_a_time=rate == 0))
                    runs.append(rate_report(rate, records, config.ttft_slo_s, config.tpot_slo_s))
                    records_of_mode.append(records)
                # Read while the instances run: whether their NCCL pair broke and formed
                # again during the run.
                generations = _pair_generations(urls) if mode == "disaggregated" else None
            # (One request at a time is no arrival rate: it has no goodput.)
            met = [run["rate_rps"] for run in runs if run["slo_met"] and run["rate_rps"]]
            modes[mode] = {"instances": where, "rates": runs,
                           "goodput_rps": max(met) if met else 0.0}
            if mode == "disaggregated":
                modes[mode]["handoff"] = handoff_report(
                    [r for records in records_of_mode for r in records], link)
                modes[mode]["handoff"]["pair_generation"] = generations
            tokens[mode] = [[r.token_ids for r in records] for records in records_of_mode]
    result: dict[str, Any] = {
        "bench": "disagg", "model": config.model, "dtype": config.dtype,
        "devices": {"prefill": devices[0], "decode": devices[1],
                    "colocated": list(devices[2])},
        "config": {k: v for k, v in asdict(config).items()
                   if k not in ("prefill_urls", "decode_urls", "both_urls")},
        "link": link, "modes": modes, "goodput_ratio": None, "ttft_p50_ratio": None,
        "outputs_equal": None}
    if len(tokens) == 2:
        colocated, disaggregated = modes["colocated"], modes["disaggregated"]
        if colocated["goodput_rps"] > 0:
            result["goodput_ratio"] = disaggregated["goodput_rps"] / colocated["goodput_rps"]
        # Per rate, what the handoff adds to a prompt's TTFT (at a low rate, with no
        # queueing: the handoff's own cost against the same prefill colocated).
        result["ttft_p50_ratio"] = [
            d["ttft_s"]["p50"] / c["ttft_s"]["p50"]
            for c, d in zip(colocated["rates"], disaggregated["rates"])]
        pairs = [(a, b) for rate_a, rate_b in zip(tokens["colocated"], tokens["disaggregated"])
                 for a, b in zip(rate_a, rate_b)]
        result["outputs_equal"] = {"equal": sum(a == b for a, b in pairs),
                                   "total": len(pairs)}
    return result


# ---- the command -----------------------------------------------------------------------

def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option} takes comma-separated numbers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def disagg(
    model: str = typer.Option("smollm2-135m", help="Model of every instance: an alias, a "
                              "directory, a .gguf file or random:<name> (random:llama3-8b)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    prefill_device: str = typer.Option("auto", help="Device of the prefill instance (auto: "
                                       "cuda:0, or cpu without CUDA)."),
    decode_device: str = typer.Option("auto", help="Device of the decode instance (auto: "
                                      "cuda:1 with two GPUs, else as the prefill's)."),
    colocated_devices: str = typer.Option("", help="Comma-separated devices of the colocated "
                                          "instances, one instance each (default: the "
                                          "prefill and the decode devices)."),
    transport: str | None = typer.Option(None, help="Handoff transport (cuda_ipc, nccl, "
                                         "mooncake, redis; default: the best both "
                                         "instances have)."),
    modes: str = typer.Option(",".join(MODES), help="Comma-separated modes to run."),
    rates: str = typer.Option("1,2,4", help="Comma-separated arrival rates (requests/s, "
                              "Poisson) swept in each mode; 0 sends one request at a "
                              "time (what a request costs with no queueing)."),
    num_requests: int = typer.Option(64, help="Requests per rate."),
    long_tokens: int = typer.Option(4096, help="Tokens of a long prompt."),
    short_tokens: int = typer.Option(256, help="Tokens of a short prompt."),
    long_fraction: float = typer.Option(0.25, help="Share of long prompts."),
    max_tokens: int = typer.Option(64, help="Tokens generated per request (greedy)."),
    ttft_slo: float = typer.Option(0.4, help="SLO on the P90 time to first token (s)."),
    tpot_slo: float = typer.Option(0.04, help="SLO on the P90 time per output token (s)."),
    seed: int = typer.Option(0, help="Seed of the prompts and the arrivals."),
    link_bytes: int = typer.Option(2**30, help="Bytes of the link ceiling's send/recv."),
    serve_arg: list[str] = typer.Option([], "--serve-arg", help="An option passed to every "
                                        "instance's `kvtier serve` (repeat; e.g. "
                                        "--serve-arg=--max-num-batched-tokens=2048)."),
    prefill_queue_limit: int | None = typer.Option(
        None, help="The disaggregated router's --prefill-queue-limit: past this many "
        "requests on the prefill instance, the decode instance computes prompts itself "
        "(counted as fallbacks, reason busy; default: no limit)."),
    prefill_url: list[str] = typer.Option([], "--prefill-url", help="Use this running "
                                          "prefill instance instead of starting one."),
    decode_url: list[str] = typer.Option([], "--decode-url", help="Use this running decode "
                                         "instance instead of starting one."),
    both_url: list[str] = typer.Option([], "--both-url", help="Use this running instance of "
                                       "role both for the colocated mode (repeat)."),
    logs_dir: str | None = typer.Option(None, help="Keep the instances' and routers' logs "
                                        "here (one file each; default: deleted at the "
                                        "end)."),
    json_output: bool = typer.Option(False, "--json", help="Print the result as one JSON "
                                     "object instead of a table."),
) -> None:
    """Goodput under P90 TTFT/TPOT SLOs, colocated vs prefill/decode disaggregated.

    Goodput is the highest arrival rate of the sweep at which the P90 TTFT <= --ttft-slo
    and the P90 TPOT <= --tpot-slo (requests/s over the same devices in both modes); each
    rate also reports the requests/s that met both SLOs one by one.
    """
    from kvtier.cli.bench.commands import _with_status

    config = DisaggConfig(
        model=model, dtype=dtype, prefill_device=prefill_device, decode_device=decode_device,
        colocated_devices=_names(colocated_devices), transport=transport,
        modes=_names(modes), rates=_floats(rates, "--rates"), num_requests=num_requests,
        long_tokens=long_tokens, short_tokens=short_tokens, long_fraction=long_fraction,
        max_tokens=max_tokens, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo, seed=seed,
        link_bytes=link_bytes, serve_args=tuple(serve_arg),
        prefill_queue_limit=prefill_queue_limit, prefill_urls=tuple(prefill_url),
        decode_urls=tuple(decode_url), both_urls=tuple(both_url), logs_dir=logs_dir)
    result = _with_status("bench disagg", lambda update: run_disagg_bench(config, update))
    if json_output:
        print_json(result)
    else:
        print_disagg(result)
