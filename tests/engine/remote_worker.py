"""One engine in its own process for the remote-tier tests: answers one question about a
long document and prints what it generated and where its prompt's KV came from, as JSON.

    python -m tests.engine.remote_worker '{"url": ..., "disk_dir": ..., "question": 0}'

Keys: url (None: no remote tier), disk_dir, question (index), doc_tokens (the document's
minimum length in tokens), max_tokens, timeout_s, backoff_s.
"""

from __future__ import annotations

import json
import sys

from kvtier.cli.docs_corpus import CORPUS
from kvtier.engine import LLM, SamplingParams

from kvtier.stats import Direction
from kvtier.tiers.remote.config import RemoteConfig

QUESTIONS = ("What do the texts above say about charging the lantern?",
             "Summarise the history of the town in two sentences.")


def long_document(tokenizer, min_tokens: int) -> str:
    """The corpus's texts, repeated under numbered parts until `min_tokens` tokens."""
    parts: list[str] = []
    while len(tokenizer.encode("\n\n".join(parts))) < min_tokens:
        doc = CORPUS[len(parts) % len(CORPUS)]
        parts.append(f"Part {len(parts) + 1}. {doc.title}\n{doc.text}")
    return "\n\n".join(parts)


def run(args: dict) -> dict:
    remote = None
    if args.get("url"):
        remote = RemoteConfig(args["url"], key_prefix=args.get("prefix", "kvtier"),
                              timeout_s=args.get("timeout_s", 0.5),
                              backoff_s=args.get("backoff_s", 5.0))
    with LLM("smollm2-135m", device="cpu", dtype="float32", disk_cache_dir=args["disk_dir"],
             disk_cache=args.get("disk", True), host_cache=args.get("host", True),
             remote_cache=remote, max_num_batched_tokens=1024) as llm:
        document = long_document(llm.tokenizer, args.get("doc_tokens", 4096))
        prompt = f"{document}\n\n{QUESTIONS[args['question']]}"
        params = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0.0)
        [output] = llm.generate([prompt], params)
        stats = llm.stats()
        doc_tokens = len(llm.tokenizer.encode(document))
        metrics = output.metrics
        return {
            "output_token_ids": list(output.outputs[0].token_ids),
            "prompt_tokens": len(output.prompt_token_ids),
            "doc_tokens": doc_tokens,
            "cached_remote": metrics.cached_tokens_remote,
            "cached_gpu_host_disk": metrics.cached_tokens_gpu + metrics.cached_tokens_host
            + metrics.cached_tokens_disk,
            "computed": metrics.computed_tokens,
            "ttft_s": metrics.ttft_s,
            "remote_read_bytes": stats.transfers[Direction.REMOTE_TO_HOST].num_bytes,
            "remote_written_bytes": stats.transfers[Direction.HOST_TO_REMOTE].num_bytes,
            "remote_stored": stats.remote.stored if stats.remote else 0,
        }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
