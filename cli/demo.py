"""`kvtier demo`: a multi-turn long-document session that makes KV blocks spill and return.

The session asks questions about short documents (`cli.docs_corpus`), one per turn; each
prompt is the whole document followed by the question, so a document's blocks are a prefix
shared by its turns. Rounds go forward through the documents, then backward, and so on.
The GPU block budget holds one turn, the host tier a part of the documents, so blocks spill
from the GPU to the host tier and on to the LMDB disk tier, and later turns restore them.

The same turns run first on a reference engine with the tiers off and room for everything;
the tiered answers must be token-identical to it (the command exits 1 when they are not). The
disk tier persists in `<user cache dir>/demo-kv`, so a second run starts warm from disk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer
from kvtier.cli.common import print_json, print_table
from kvtier.cli.docs_corpus import CORPUS, Document
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model, resolve_device
from kvtier.engine.paths import cache_dir
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.stats import Direction, ManagerStats, Tier
from kvtier.tiers.disk import admin as disk_admin
from kvtier.tiers.remote.config import redact

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """Sizes of one session.

    gpu_headroom_blocks: GPU blocks beyond what the longest turn needs (so the GPU keeps
        about one turn's blocks). host_fraction: host tier slots as a fraction of all the
        documents' prompt blocks (the rest can only live on disk).
    """

    num_docs: int
    num_rounds: int
    max_tokens: int
    gpu_headroom_blocks: int = 2
    host_fraction: float = 0.6


# Sized so the full session takes about a minute on a 2-core CPU: decoding dominates there.
FULL_PLAN = DemoPlan(num_docs=4, num_rounds=2, max_tokens=16)
QUICK_PLAN = DemoPlan(num_docs=2, num_rounds=2, max_tokens=6, host_fraction=0.75)


@dataclass(frozen=True, slots=True)
class Turn:
    document: Document
    question: str

    @property
    def prompt(self) -> str:
        return (f"{self.document.title}\n\n{self.document.text}\n\n"
                f"Question: {self.question} Answer in one short sentence.")


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One answered turn: where its prompt's KV came from, and what moved meanwhile."""

    turn: int
    document: str
    question: str
    answer: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    ttft_s: float
    tokens_gpu: int
    tokens_host: int
    tokens_disk: int
    tokens_prefilled: int  # prompt tokens run through the model
    bytes_moved: dict[str, int]  # Direction.value -> bytes during the turn
    tokens_remote: int = 0  # restored from the shared remote tier (--remote-cache)


def plan_turns(plan: DemoPlan) -> list[Turn]:
    """Round r asks question r of each document: forward in even rounds, backward in odd."""
    if not 1 <= plan.num_docs <= len(CORPUS):
        raise ValueError(f"the demo has {len(CORPUS)} documents, asked for {plan.num_docs}")
    docs = CORPUS[:plan.num_docs]
    turns = []
    for r in range(plan.num_rounds):
        for doc in (docs if r % 2 == 0 else docs[::-1]):
            turns.append(Turn(doc, doc.questions[r % len(doc.questions)]))
    return turns


def _bytes_moved(before: ManagerStats, after: ManagerStats) -> dict[str, int]:
    return {d.value: after.bytes_moved(d) - before.bytes_moved(d) for d in Direction}


def _play(llm: LLM, turns: Sequence[Turn], params: SamplingParams, progress: Progress,
          label: str) -> list[TurnRecord]:
    task = progress.add_task(label, total=len(turns))
    records = []
    for index, turn in enumerate(turns):
        before = llm.stats()
        [output] = llm.chat([{"role": "user", "content": turn.prompt}], params)
        [completion] = output.outputs
        metrics = output.metrics
        num_prompt = len(output.prompt_token_ids)
        records.append(TurnRecord(
            turn=index + 1, document=turn.document.name, question=turn.question,
            answer=completion.text.strip(), token_ids=completion.token_ids,
            num_prompt_tokens=num_prompt,
            ttft_s=metrics.ttft_s or 0.0, tokens_gpu=metrics.cached_tokens_gpu,
            tokens_host=metrics.cached_tokens_host, tokens_disk=metrics.cached_tokens_disk,
            tokens_prefilled=max(num_prompt - metrics.cached_tokens, 0),
            bytes_moved=_bytes_moved(before, llm.stats()),
            tokens_remote=metrics.cached_tokens_remote))
        progress.advance(task)
    return records


def _tier_summary(stats: ManagerStats, records: Sequence[TurnRecord]) -> dict[str, Any]:
    """Per tier: block hits and misses of lookups, and the share of prompt tokens served."""
    num_prompt = sum(r.num_prompt_tokens for r in records) or 1
    served = {"gpu": sum(r.tokens_gpu for r in records),
              "host": sum(r.tokens_host for r in records),
              "disk": sum(r.tokens_disk for r in records),
              "remote": sum(r.tokens_remote for r in records)}
    summary = {}
    for tier in Tier:
        counts = stats.tiers[tier]
        looked_up = counts.hits + counts.misses
        summary[tier.value] = {"hits": counts.hits, "misses": counts.misses,
                               "hit_rate": counts.hits / looked_up if looked_up else None,
                               "tokens": served[tier.value],
                               "token_share": served[tier.value] / num_prompt}
    summary["prefilled"] = {"tokens": sum(r.tokens_prefilled for r in records),
                            "token_share": sum(r.tokens_prefilled for r in records) / num_prompt}
    return summary


def run_demo(plan: DemoPlan, disk_dir: Path, model: str = "smollm2-135m", device: str = "auto",
             fresh: bool = False, console: Console | None = None,
             remote_cache: str | None = None) -> dict[str, Any]:
    """Play the session twice (tiers off, then tiers on) and return a JSON-ready result.

    Raises ValueError for a model without a tokenizer or a bad option, and the engine's and
    the disk tier's errors (OSError for an unusable `disk_dir`).
    """
    console = console or Console(stderr=True)
    turns = plan_turns(plan)
    params = SamplingParams(max_tokens=plan.max_tokens, temperature=0.0)
    if fresh and (disk_dir / "data.mdb").exists():
        disk_admin.clear(disk_dir)
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        loading = progress.add_task(f"loading {model}", total=None)
        loaded = load_model(model, resolve_device(device), "auto")
        if loaded.tokenizer is None:
            raise ValueError(f"the demo asks questions in text and {model} has no tokenizer; "
                             "use a model with one (default: smollm2-135m)")
        progress.remove_task(loading)
        # Room for every turn at once: the reference never evicts, so it never needs a tier.
        with LLM(loaded, host_cache=False, disk_cache=False,
                 gpu_memory_utilization=0.25) as reference:
            layout = reference.layout
            turn_blocks = [math.ceil(
                (len(reference.tokenize_chat([{"role": "user", "content": t.prompt}]))
                 + plan.max_tokens) / layout.block_size) for t in turns]
            reference_records = _play(reference, turns, params, progress,
                                      "reference run (tiers off)")
        del reference  # its KV cache is large; free it before the tiered engine allocates
        doc_blocks = {t.document.name: n for t, n in zip(turns, turn_blocks)}
        gpu_blocks = max(turn_blocks) + plan.gpu_headroom_blocks
        host_slots = max(1, int(plan.host_fraction * sum(doc_blocks.values())))
        with LLM(loaded, gpu_blocks=gpu_blocks,
                 host_cache_gb=(host_slots + 0.5) * layout.bytes_per_block / GIB,
                 disk_cache=True, disk_cache_dir=disk_dir, remote_cache=remote_cache) as llm:
            records = _play(llm, turns, params, progress, "tiered run (GPU -> host -> disk)")
            stats = llm.stats()
    # After close: the host tier has been flushed to disk, which is what a next run sees.
    disk_blocks = disk_admin.cache_stats(disk_dir)["num_blocks"]
    mismatches = [r.turn for r, ref in zip(records, reference_records)
                  if r.token_ids != ref.token_ids]
    return {
        "model": model, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
        "disk_dir": str(disk_dir), "plan": asdict(plan),
        "budgets": {"gpu_blocks": gpu_blocks, "host_slots": host_slots,
                    "bytes_per_block": layout.bytes_per_block,
                    "document_blocks": sum(doc_blocks.values())},
        "turns": [asdict(r) for r in records],
        "tiers": _tier_summary(stats, records),
        "disk_blocks_after": disk_blocks,
        "warm_start": records[0].tokens_disk + records[0].tokens_remote > 0,
        "remote_cache": redact(remote_cache) if remote_cache is not None else None,
        "identical": not mismatches,
        "mismatched_turns": mismatches,
        "elapsed_s": time.perf_counter() - start,
    }


def _print_turns(result: dict[str, Any]) -> None:
    """The per-turn table, in a compact style so that its eleven columns fit 80 characters."""
    budgets = result["budgets"]
    table = Table(title=f"{result['model']} on {result['device']} ({result['dtype']}): GPU "
                  f"budget {budgets['gpu_blocks']} blocks, host tier {budgets['host_slots']} "
                  f"blocks, documents {budgets['document_blocks']} blocks",
                  caption="Prompt tokens restored from the GPU, host or disk tier or "
                  "prefilled; MiB moved per direction (G gpu, H host, D disk) during the turn.",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    remote = result.get("remote_cache") is not None
    directions = [d for d in Direction if remote or Tier.REMOTE not in (d.src, d.dst)]
    token_keys = ("tokens_gpu", "tokens_host", "tokens_disk") + ("tokens_remote",) * remote \
        + ("tokens_prefilled",)
    headers = ("#", "doc", "TTFT ms", "GPU", "host", "disk") + ("remote",) * remote \
        + ("prefill",) + tuple(d.value.replace("->", ">").replace("gpu", "G").replace(
            "host", "H").replace("disk", "D").replace("remote", "R") for d in directions)
    for header in headers:
        table.add_column(header, justify="left" if header in ("#", "doc") else "right")
    for turn in result["turns"]:
        moved = [f"{turn['bytes_moved'][d.value] / 2**20:.1f}" for d in directions]
        table.add_row(str(turn["turn"]), turn["document"], f"{turn['ttft_s'] * 1e3:,.0f}",
                      *(str(turn[key]) for key in token_keys), *moved)
    Console().print(table)


def _print_report(result: dict[str, Any]) -> None:
    _print_turns(result)
    print_table("Answers", ("turn", "question", "answer"),
                [(t["turn"], t["question"], t["answer"]) for t in result["turns"]])
    tiers = result["tiers"]
    print_table("Tier hit rates (blocks looked up) and prompt tokens served",
                ("tier", "hits", "misses", "hit rate", "tokens", "share"),
                [(name, tiers[name]["hits"], tiers[name]["misses"],
                  "-" if tiers[name]["hit_rate"] is None else f"{tiers[name]['hit_rate']:.0%}",
                  tiers[name]["tokens"], f"{tiers[name]['token_share']:.0%}")
                 for name in ("gpu", "host", "disk")
                 + ("remote",) * (result.get("remote_cache") is not None)]
                + [("prefilled", "", "", "", tiers["prefilled"]["tokens"],
                    f"{tiers['prefilled']['token_share']:.0%}")])
    first = result["turns"][0]
    if result["warm_start"]:
        typer.echo(f"Warm start: turn 1 restored {first['tokens_disk']} tokens from the disk "
                   f"tier that an earlier run left in {result['disk_dir']}.")
    else:
        typer.echo(f"Cold start: the disk tier had nothing for turn 1; run the demo again to "
                   f"start warm from {result['disk_dir']} ({result['disk_blocks_after']} "
                   "blocks now).")
    if result["identical"]:
        typer.echo(f"All {len(result['turns'])} answers are token-identical to the tiers-off "
                   "run.")
    else:
        typer.echo(f"MISMATCH: turns {result['mismatched_turns']} differ from the tiers-off "
                   "run.")
    typer.echo(f"Finished in {result['elapsed_s']:.1f} s.")


def demo(
    quick: bool = typer.Option(False, "--quick", help="A smaller session (2 documents, "
                               "shorter answers), for tests and a first look."),
    fresh: bool = typer.Option(False, "--fresh", help="Clear the demo's disk tier first."),
    cache_dir_option: Path | None = typer.Option(
        None, "--cache-dir", help="Directory of the demo's disk tier (default: "
        "<user cache dir>/demo-kv)."),
    model: str = typer.Option("smollm2-135m", help="Model: an alias, a Hugging Face "
                              "directory or a .gguf file (it needs a tokenizer)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    json_output: bool = typer.Option(False, "--json", help="Print the results as one JSON "
                                     "object instead of tables."),
    remote_cache: str | None = typer.Option(
        None, "--remote-cache", help="Share KV blocks through a Redis / Redis Cluster URL "
        "below the disk tier (a second machine's demo then starts warm)."),
) -> None:
    """Play a multi-turn long-document session whose KV spills GPU -> host -> disk and comes
    back; show per-turn restores and check every answer against a tiers-off run."""
    disk_dir = cache_dir_option.expanduser() if cache_dir_option else cache_dir() / "demo-kv"
    result = run_demo(QUICK_PLAN if quick else FULL_PLAN, disk_dir, model, device, fresh,
                      remote_cache=remote_cache)
    if json_output:
        print_json(result)
    else:
        _print_report(result)
    if not result["identical"]:
        raise typer.Exit(1)
