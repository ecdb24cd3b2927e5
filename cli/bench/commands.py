"""Typer commands for the benchmarks whose modules expose only a `run_*_bench` function.

Each command turns its options into the bench's arguments, shows progress on stderr, and
prints the result as JSON (`--json`) or as a rich table (`cli/bench/tables.py`). cli/main.py
attaches them to the `bench` group.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from kvtier.cli.bench import tables
from kvtier.cli.bench.diskread import run_diskread_bench
from kvtier.cli.bench.invariance import MODES as INVARIANCE_MODES
from kvtier.cli.bench.invariance import InvarianceConfig, parse_shapes, run_invariance_bench
from kvtier.cli.bench.kernels import run_kernel_bench
from kvtier.cli.bench.longctx import (
    EXTRA_STRATEGIES,
    STRATEGIES,
    LongctxConfig,
    run_longctx_bench,
    run_longctx_sweep,
)
from kvtier.cli.bench.serve import EXTRA_MODES as EXTRA_SERVE_MODES
from kvtier.cli.bench.serve import MODES as SERVE_MODES
from kvtier.cli.bench.serve import ServeConfig, run_serve_bench
from kvtier.cli.bench.swap import DEFAULT_BLOCK_BYTES, run_swap_bench
from kvtier.cli.common import print_json
from kvtier.cli.plot import check_plotting, plot_longctx
from kvtier.kernels import SWAP_METHODS
from rich.console import Console

_JSON_HELP = "Print the result as one JSON object instead of a table."
_MODEL_HELP = ("Model: an alias, a Hugging Face directory, a .gguf file, or random:<name> "
               "(e.g. random:llama3-8b).")
_DEVICE_HELP = "auto, cpu, cuda or cuda:N."
_DTYPE_HELP = "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16."
_DISK_DURABLE_HELP = ("fsync every disk tier write transaction. Off (as the engine): the OS "
                      "writes blocks back, an OS crash or power loss may lose recent blocks, "
                      "which then miss.")
_DETERMINISTIC_HELP = ("Also run every mode with the deterministic (batch-invariant) "
                       "kernels: outputs equal to the baseline per mode, and the cost.")


def _parse_names(text: str, known: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{option} takes a comma-separated list of {', '.join(known)}; "
                         f"got {text!r}")
    return names


def _parse_ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{option} takes comma-separated positive integers, got {text!r}")
    return values


def _with_status(message: str, run):
    """Run `run(update)` under a spinner on stderr; `update(text)` changes its line.

    When stderr is not a terminal (a log file, a pipe), each update is written as its own
    line with the seconds since the start, so a long run's log shows where it is.
    """
    console = Console(stderr=True)
    if not console.is_terminal:
        started = time.perf_counter()

        def log(text: str) -> None:
            console.print(f"[{time.perf_counter() - started:8.1f} s] {message}: {text}",
                          highlight=False, markup=False)
        return run(log)
    with console.status(message) as status:
        return run(lambda text: status.update(text))


def longctx(
    model: str = typer.Option("smollm2-135m", help=_MODEL_HELP),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
    dtype: str = typer.Option("auto", help=_DTYPE_HELP),
    num_docs: int = typer.Option(4, help="Documents (the GPU budget holds one request)."),
    doc_tokens: str = typer.Option("1024", help="Tokens per document; several "
                                   "comma-separated values run a sweep on one loaded model."),
    question_tokens: int = typer.Option(16, help="Tokens per question after a document."),
    max_tokens: int = typer.Option(4, help="Tokens generated per request."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    gpu_blocks: int | None = typer.Option(None, help="GPU block budget (default: one "
                                          "request's blocks plus two)."),
    max_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step "
                                           "(prefill chunk size)."),
    strategies: str = typer.Option(",".join(STRATEGIES), help="Comma-separated strategies "
                                   "to compare; recompute is the baseline and required. Also "
                                   "host_small_disk: the disk behind a host tier smaller "
                                   "than the documents (--host-cache-gb); disk_inprocess: "
                                   "disk with the disk tier in the engine's process (not a "
                                   "worker process, the default on a GPU)."),
    host_cache_gb: float | None = typer.Option(None, "--host-cache-gb", help="host_small_disk's "
                                               "host tier in GiB (default: an eighth of the "
                                               "documents' KV)."),
    disk_dir: Path | None = typer.Option(None, help="Where the disk strategy keeps its "
                                         "temporary tier (default: the system temporary "
                                         "directory); it is removed afterwards."),
    disk_durable: bool = typer.Option(False, "--disk-durable/--no-disk-durable",
                                      help=_DISK_DURABLE_HELP),
    restore_min_saving: float | None = typer.Option(
        None, "--restore-min-saving", help="Seconds a read from the disk or remote tier must "
        "be expected to save before the engines do it (default: the engine's); 0 reads "
        "every prefix the tiers hold, to measure the tiers rather than the engine's choice."),
    seed: int = typer.Option(0, help="Seed of the documents' token ids."),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="Also time transformers' "
                                    "own forward pass over the round-two prompts (same "
                                    "weights)."),
    cold: bool = typer.Option(False, "--cold", help="Drop the page cache before each "
                              "round-two request of every strategy, so disk restores start "
                              "cold (needs root; the result says when it was not "
                              "permitted)."),
    plot: Path | None = typer.Option(None, "--plot", help="Draw the swap timeline and the "
                                     "TTFT comparison to this PNG file (needs matplotlib)."),
    attn_backend: str = typer.Option("auto", "--attn-backend", help="auto, torch, triton, "
                                     "cudnn or flash."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    deterministic: bool = typer.Option(False, "--deterministic", help=_DETERMINISTIC_HELP),
) -> None:
    """TTFT of long prompts whose KV is recomputed vs restored from the host or disk tier."""
    lengths = _parse_ints(doc_tokens, "--doc-tokens")
    if plot is not None:
        check_plotting()  # before the run, not after it
    config = LongctxConfig(model=model, device=device, dtype=dtype, num_docs=num_docs,
                           doc_tokens=lengths[0], question_tokens=question_tokens,
                           max_tokens=max_tokens, block_size=block_size, gpu_blocks=gpu_blocks,
                           max_batched_tokens=max_batched_tokens,
                           strategies=_parse_names(strategies, STRATEGIES + EXTRA_STRATEGIES,
                                                   "--strategies"),
                           disk_dir=str(disk_dir) if disk_dir else None, seed=seed,
                           compare_hf=compare_hf, host_cache_gb=host_cache_gb,
                           disk_durable=disk_durable, restore_min_saving_s=restore_min_saving,
                           cold=cold, attn_backend=attn_backend, deterministic=deterministic)
    if len(lengths) > 1:
        sweep = _with_status("bench longctx", lambda update: run_longctx_sweep(
            config, lengths, update))
        if plot is not None:
            sweep["plot"] = str(plot_longctx(sweep["runs"][-1], plot))
        if json_output:
            print_json(sweep)
        else:
            tables.print_longctx_sweep(sweep)
        return
    result = _with_status("bench longctx", lambda update: run_longctx_bench(config, update))
    if plot is not None:
        result["plot"] = str(plot_longctx(result, plot))
    if json_output:
        print_json(result)
        return
    tables.print_longctx(result)
    if plot is not None:
        typer.echo(f"plot written to {result['plot']}")


def serve(
    model: str = typer.Option("smollm2-135m", help=_MODEL_HELP),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
    dtype: str = typer.Option("auto", help=_DTYPE_HELP),
    num_conversations: int = typer.Option(8, help="Concurrent conversations (clients)."),
    num_rounds: int = typer.Option(3, help="Requests per conversation."),
    system_tokens: int = typer.Option(256, help="Tokens of the system prompt all share."),
    user_tokens: int = typer.Option(32, help="Tokens of each new question."),
    max_tokens: int = typer.Option(16, help="Tokens of each answer."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    gpu_blocks: int | None = typer.Option(None, help="GPU block budget (default: a third of "
                                          "what all conversations need)."),
    max_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step."),
    modes: str = typer.Option(",".join(SERVE_MODES), help="Comma-separated tier modes; the "
                              "first is the baseline of the ratios. Also host_third: the "
                              "host tier of host_disk without the disk; host_disk_all: "
                              "host_disk asking the disk for every prefix; host_small_disk: a "
                              "host tier of --host-cache-gb, then disk; host_small_disk_all: "
                              "that, asking the disk for every prefix; "
                              "host_small_disk_inprocess / host_small_disk_worker: "
                              "host_small_disk with the disk tier in the engine's process / "
                              "in a worker process (default: a worker on a GPU)."),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="Also compare prefill and "
                                    "decode tokens/s with transformers' generate()."),
    hf_batch: int = typer.Option(8, help="Batch size N of the transformers comparison."),
    hf_prompt_tokens: int = typer.Option(128, help="Prompt tokens in the comparison."),
    hf_new_tokens: int = typer.Option(32, help="Generated tokens in the comparison."),
    repeats: int = typer.Option(3, help="Timed runs of the comparison; figures are medians."),
    runs: int = typer.Option(1, help="Runs of every mode, in turn; each mode reports its "
                             "median-throughput run (and every run's throughput)."),
    seed: int = typer.Option(0, help="Seed of the token ids."),
    url: str | None = typer.Option(None, "--url", help="Drive the workload over HTTP at a "
                                   "running `kvtier serve` (e.g. http://127.0.0.1:8000); the "
                                   "engine options are then the server's."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="KVTIER_API_KEY",
                                       help="API key of the server at --url."),
    attn_backend: str = typer.Option("auto", "--attn-backend", help="auto, torch, triton, "
                                     "cudnn or flash."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    remote_cache: str | None = typer.Option(
        None, "--remote-cache", help="Give the tiered modes a remote tier on this Redis URL "
        "(a fresh key prefix per engine)."),
    deterministic: bool = typer.Option(False, "--deterministic", help=_DETERMINISTIC_HELP),
    doc_tokens: int = typer.Option(0, help="Tokens of a document of each conversation's own, "
                                   "after the system prompt."),
    lockstep: bool = typer.Option(False, "--lockstep", help="Send every conversation's next "
                                  "request together, once the round's answers are all in."),
    host_cache_gb: float | None = typer.Option(None, "--host-cache-gb", help="host_small_disk's "
                                               "host tier in GiB (default: an eighth of what "
                                               "all conversations need)."),
    disk_durable: bool = typer.Option(False, "--disk-durable/--no-disk-durable",
                                      help=_DISK_DURABLE_HELP),
) -> None:
    """Throughput, TTFT and TPOT of multi-round conversations with tiers off, host, host+disk
    (or, with --url, against a running server)."""
    if url is not None:
        from kvtier.cli.bench.serve_http import print_remote, run_remote_serve_bench

        config = ServeConfig(num_conversations=num_conversations, num_rounds=num_rounds,
                             system_tokens=system_tokens, user_tokens=user_tokens,
                             max_tokens=max_tokens, seed=seed)
        result = _with_status("bench serve", lambda update: run_remote_serve_bench(
            url, config, api_key, progress=update))
        if json_output:
            print_json(result)
        else:
            print_remote(result)
        return
    config = ServeConfig(model=model, device=device, dtype=dtype,
                         num_conversations=num_conversations, num_rounds=num_rounds,
                         system_tokens=system_tokens, user_tokens=user_tokens,
                         max_tokens=max_tokens, block_size=block_size, gpu_blocks=gpu_blocks,
                         max_batched_tokens=max_batched_tokens,
                         modes=_parse_names(modes, SERVE_MODES + EXTRA_SERVE_MODES, "--modes"),
                         compare_hf=compare_hf, hf_batch=hf_batch,
                         hf_prompt_tokens=hf_prompt_tokens, hf_new_tokens=hf_new_tokens,
                         repeats=repeats, runs=runs, seed=seed, remote_cache=remote_cache,
                         attn_backend=attn_backend, deterministic=deterministic,
                         doc_tokens=doc_tokens, lockstep=lockstep, host_cache_gb=host_cache_gb,
                         disk_durable=disk_durable)
    result = _with_status("bench serve", lambda update: run_serve_bench(config, update))
    if json_output:
        print_json(result)
    else:
        tables.print_serve(result)


def _parse_pairs(text: str, separator: str, option: str) -> tuple[tuple[int, int], ...]:
    """"32x8192,1x32768" -> ((32, 8192), (1, 32768)); ValueError naming the option."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, second = part.partition(separator)
        try:
            pair = (int(first), int(second))
        except ValueError:
            raise ValueError(f"{option} takes comma-separated A{separator}B integer pairs, "
                             f"got {text!r}") from None
        if pair[0] <= 0 or pair[1] < 0:
            raise ValueError(f"{option}: {part!r} must be positive (a prefix may be 0)")
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{option} needs at least one A{separator}B pair, got {text!r}")
    return tuple(pairs)


def kernels(
    decode_cases: str = typer.Option("32x8192,1x32768,64x2048,4x131072",
                                     help="Decode cases, comma-separated BATCHxCONTEXT."),
    prefill_cases: str = typer.Option("8192+0,2048+30720",
                                      help="Prefill cases, comma-separated CHUNK+PREFIX."),
    store_tokens: str = typer.Option("8192,32768", help="Comma-separated token counts of "
                                     "the store_kv runs."),
    contiguous: bool = typer.Option(False, "--contiguous", help="Block tables in order "
                                    "instead of a random permutation."),
    sweep: bool = typer.Option(False, "--sweep", help="Also time alternative tilings."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Triton paged attention and store_kv against torch SDPA and device copies (CUDA)."""
    decode = _parse_pairs(decode_cases, "x", "--decode-cases")
    prefill = tuple((chunk, prefix) for chunk, prefix
                    in _parse_pairs(prefill_cases, "+", "--prefill-cases"))
    if any(batch <= 0 or context <= 0 for batch, context in decode):
        raise ValueError("--decode-cases: batch and context must be positive")
    result = _with_status("bench kernels", lambda update: run_kernel_bench(
        decode_cases=decode, prefill_cases=prefill,
        store_tokens=_parse_ints(store_tokens, "--store-tokens"), contiguous=contiguous,
        sweep=sweep))
    if json_output:
        print_json(result)
    else:
        tables.print_kernels(result)


def swap(
    block_bytes: str = typer.Option(",".join(str(b) for b in DEFAULT_BLOCK_BYTES),
                                    help="Comma-separated block sizes in bytes."),
    scattered: bool = typer.Option(True, "--scattered/--contiguous",
                                   help="Random GPU blocks and host slots, or one run each."),
    host_run_blocks: int = typer.Option(1, help="With --scattered: host slots in runs of "
                                        "this many (1: every slot random)."),
    methods: str = typer.Option(",".join(SWAP_METHODS), help="Comma-separated methods."),
    total_mib: int = typer.Option(512, help="MiB copied per direction per swap."),
    repeats: int = typer.Option(5, help="Timed repeats; figures are medians."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """GPU <-> pinned host block swaps per method and block size vs the plain pinned copy
    (CUDA)."""
    sizes = _parse_ints(block_bytes, "--block-bytes")
    names = _parse_names(methods, SWAP_METHODS, "--methods")
    if host_run_blocks <= 0 or total_mib <= 0 or repeats <= 0:
        raise ValueError("--host-run-blocks, --total-mib and --repeats must be positive")
    result = _with_status("bench swap", lambda update: run_swap_bench(
        block_bytes=sizes, total_mib=total_mib, scattered=scattered,
        host_run_blocks=host_run_blocks, methods=names, repeats=repeats, progress=update))
    if json_output:
        print_json(result)
    else:
        tables.print_swap(result)


def diskread(
    gib: float = typer.Option(2.0, help="GiB of 2 MiB blocks written to a fresh disk tier."),
    directory: Path = typer.Option(Path("."), "--dir", help="Where the tier and the raw "
                                   "file go (the disk under test); removed afterwards."),
    threads: str = typer.Option("1,4,8", help="Comma-separated thread counts to try."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Cold reads of 2 MiB disk-tier values: the ways of reading them, the tier's own
    path, and the disk's raw sequential read bandwidth (drop the page cache: needs root)."""
    counts = _parse_ints(threads, "--threads")
    result = _with_status("bench diskread", lambda update: run_diskread_bench(
        directory, gib, counts, update))
    if json_output:
        print_json(result)
        return
    tables.print_diskread(result)


def invariance(
    model: str = typer.Option("random:tiny-llama", help=_MODEL_HELP),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
    dtype: str = typer.Option("auto", help=_DTYPE_HELP),
    num_prompts: int = typer.Option(64, help="Prompts, all submitted at once."),
    min_tokens: int = typer.Option(64, help="Shortest prompt, in tokens."),
    max_prompt_tokens: int = typer.Option(1024, help="Longest prompt, in tokens."),
    max_tokens: int = typer.Option(32, help="Greedy tokens generated per prompt."),
    shapes: str = typer.Option("1x2048,8x2048,64x2048,64x8192", help="Engine shapes, "
                               "comma-separated SEQSxTOKENS (max_num_seqs x "
                               "max_num_batched_tokens); each is compared with the first."),
    modes: str = typer.Option(",".join(INVARIANCE_MODES), help="default, deterministic "
                              "or both."),
    seed: int = typer.Option(0, help="Seed of the prompts."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Whether tokens and log-probabilities change with the batch size and the step's token
    budget, in the default and the deterministic mode, and each run's time."""
    config = InvarianceConfig(
        model=model, device=device, dtype=dtype, num_prompts=num_prompts,
        min_tokens=min_tokens, max_tokens_prompt=max_prompt_tokens, max_tokens=max_tokens,
        shapes=parse_shapes(shapes), modes=_parse_names(modes, INVARIANCE_MODES, "--modes"),
        seed=seed)
    result = _with_status("bench invariance", lambda update: run_invariance_bench(
        config, update))
    if json_output:
        print_json(result)
    else:
        tables.print_invariance(result)
