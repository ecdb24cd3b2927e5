"""`kvtier bench invariance`: whether a prompt's tokens and log-probabilities depend on the
batch it ran in and on how its prompt was chunked.

`num_prompts` seeded random prompts, their lengths spread evenly over `min_tokens` ..
`max_tokens`, are generated greedily (`max_tokens` new tokens each, the chosen token's
log-probability kept) under each engine shape of `shapes`: `max_num_seqs` x
`max_num_batched_tokens`, by default 1x2048, 8x2048, 64x2048 and 64x8192. Every prompt is
submitted at once, so the engine batches up to `max_num_seqs` of them and chunks prompts to
the step's token budget. The shapes run in the default and the deterministic mode on one
loaded model, tiers off. Per mode and shape, against the mode's first shape: requests with
the same tokens, and requests whose every chosen log-probability is the same float bit for
bit. The wall time of each run is given beside, so the deterministic mode's cost shows per
batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from kvtier.cli.bench.longctx import free_engine_memory, load_for_bench
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel

Progress = Callable[[str], None]
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((1, 2048), (8, 2048), (64, 2048), (64, 8192))
MODES = ("default", "deterministic")


@dataclass(frozen=True)
class InvarianceConfig:
    """What `run_invariance_bench` runs; see the module docstring."""

    model: str = "random:tiny-llama"
    device: str = "auto"
    dtype: str = "auto"
    num_prompts: int = 64
    min_tokens: int = 64
    max_tokens_prompt: int = 1024
    max_tokens: int = 32
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    modes: tuple[str, ...] = MODES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_tokens < 1 or self.min_tokens < 1:
            raise ValueError("--num-prompts, --max-tokens and --min-tokens must be at least 1")
        if self.max_tokens_prompt < self.min_tokens:
            raise ValueError(f"--max-prompt-tokens ({self.max_tokens_prompt}) must be at "
                             f"least --min-tokens ({self.min_tokens})")
        if not self.shapes:
            raise ValueError("--shapes needs at least one SEQSxTOKENS pair, e.g. 1x2048")
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"--modes takes {', '.join(MODES)}; got {', '.join(self.modes)}")


def make_prompts(config: InvarianceConfig, vocab_size: int) -> list[list[int]]:
    """Seeded token ids, lengths spread evenly over min_tokens .. max_tokens_prompt, and
    last one more prompt of the longest length for the warm-up."""
    rng = np.random.default_rng(config.seed)
    low = min(16, vocab_size - 1)  # keep clear of the usual special-token ids
    lengths = np.linspace(config.min_tokens, config.max_tokens_prompt,
                          config.num_prompts).round().astype(int)
    rng.shuffle(lengths)
    return [rng.integers(low, vocab_size, int(n)).tolist()
            for n in (*lengths, config.max_tokens_prompt)]


def _run_shape(loaded: LoadedModel, prompts: Sequence[list[int]], warmup: list[int],
               config: InvarianceConfig, seqs: int, budget: int,
               deterministic: bool) -> dict[str, Any]:
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True, logprobs=0)
    with LLM(loaded, max_num_seqs=seqs, max_num_batched_tokens=budget,
             max_model_len=config.max_tokens_prompt + config.max_tokens,
             host_cache=False, disk_cache=False, deterministic=deterministic) as llm:
        # The first request's compiles and graphs, untimed, on a prompt sharing no block
        # with the measured ones (a prefix hit would change what is computed).
        llm.generate([warmup], params)
        started = time.perf_counter()
        outputs = llm.generate(list(prompts), params)
        seconds = time.perf_counter() - started
        device = llm.device
    del llm
    free_engine_memory(device)
    completions = [output.outputs[0] for output in outputs]
    return {"seconds": seconds,
            "token_ids": [list(c.token_ids) for c in completions],
            "logprobs": [[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
                         for c in completions]}


def _same_bits(a: Sequence[float], b: Sequence[float]) -> bool:
    return np.array_equal(np.asarray(a, dtype=np.float64).view(np.uint64),
                          np.asarray(b, dtype=np.float64).view(np.uint64))


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shape: requests equal to the first shape's, in tokens and in log-probability
    bits, and its time over the first shape's."""
    first = next(iter(runs.values()))
    return {shape: {"same_tokens": sum(a == b for a, b in zip(run["token_ids"],
                                                              first["token_ids"])),
                    "same_logprob_bits": sum(_same_bits(a, b) for a, b in
                                             zip(run["logprobs"], first["logprobs"])),
                    "of": len(first["token_ids"]),
                    "seconds": run["seconds"]}
            for shape, run in runs.items()}


def run_invariance_bench(config: InvarianceConfig, progress: Progress | None = None,
                         loaded: LoadedModel | None = None) -> dict[str, Any]:
    """Run every mode and shape of `config` on one loaded model; return a JSON-ready dict:
    `modes[mode][shape]` compares each shape with the mode's first (`compare`), and
    `deterministic_time` gives the deterministic mode's seconds over the default's per
    shape when both ran."""
    report = progress or (lambda message: None)
    if loaded is None:
        report(f"loading {config.model}")
        loaded = load_for_bench(config.model, config.device, config.dtype)
    *prompts, warmup = make_prompts(config, loaded.config.vocab_size)
    results: dict[str, dict[str, Any]] = {}
    for mode in config.modes:
        runs = {}
        for seqs, budget in config.shapes:
            shape = f"{seqs}x{budget}"
            report(f"{mode} mode, {shape}: {len(prompts)} prompts")
            runs[shape] = _run_shape(loaded, prompts, warmup, config, seqs, budget,
                                     deterministic=mode == "deterministic")
        results[mode] = compare(runs)
    result: dict[str, Any] = {"config": asdict(config), "modes": results}
    if set(MODES) <= set(results):
        result["deterministic_time"] = {
            shape: results["deterministic"][shape]["seconds"] / row["seconds"]
            for shape, row in results["default"].items()}
    return result


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"1x2048,64x8192" -> ((1, 2048), (64, 8192)); ValueError naming --shapes otherwise."""
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        seqs, sep, budget = part.partition("x")
        if not sep or not seqs.isdigit() or not budget.isdigit() or \
                int(seqs) < 1 or int(budget) < 1:
            raise ValueError(f"--shapes takes comma-separated SEQSxTOKENS pairs "
                             f"(max_num_seqs x max_num_batched_tokens, e.g. 8x2048); "
                             f"got {part!r}")
        shapes.append((int(seqs), int(budget)))
    if not shapes:
        raise ValueError("--shapes needs at least one SEQSxTOKENS pair, e.g. 1x2048")
    return tuple(shapes)
