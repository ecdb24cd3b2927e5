"""Probe: prefill chunks through cuDNN attention on K/V gathered from the paged cache.

    python scripts/prefill_sdpa_probe.py --mode cudnn|triton -- bench longctx ...

With `--mode cudnn` the engine's attention function (kernels.paged_attention, looked up
when the model is built) is wrapped before the command runs: a prefill chunk of one request
(>= 512 queries, outside CUDA-graph capture) gathers the request's K/V into contiguous
tensors (query heads, GQA repeated) and runs torch's cuDNN attention: causal over a fresh
prompt; after a prefix, unmasked over the prefix plus causal over the chunk, merged by the
two log-sum-exps. Everything else (decodes, batches of several requests) keeps the Triton
kernel. `--mode triton` runs the command unchanged (the same-run baseline). Counts of
chunks taken each way go to stderr at exit. A measurement aid, not an engine backend.
"""

from __future__ import annotations

import atexit
import importlib
import runpy
import sys

import torch

#: Shortest chunk sent to cuDNN (shorter ones are decode-like and stay on Triton).
MIN_CHUNK = 512


def make_hybrid(original, counts: dict):
    """paged_attention with single-request prefill chunks sent to cuDNN."""
    op = torch.ops.aten._scaled_dot_product_cudnn_attention

    def gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
               group: int) -> torch.Tensor:
        """[1, heads, seq_len, d] of one request (each kv head repeated `group` times)."""
        _, block_size, kv_heads, dim = cache.shape
        n = -(-seq_len // block_size)
        rows = cache.index_select(0, block_table[:n].long()).view(n * block_size, kv_heads, 1,
                                                                  dim)[:seq_len]
        heads = rows.expand(seq_len, kv_heads, group, dim).reshape(seq_len, kv_heads * group,
                                                                   dim)
        return heads.transpose(0, 1).unsqueeze(0)

    def cudnn(q, k, v, causal: bool, scale: float):
        out, lse = op(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(1, q.shape[1], q.shape[2], 1)

    def hybrid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
               max_query_len, max_seq_len, softmax_scale, out=None, config=None):
        num_tokens, num_heads, _ = query.shape
        if (counts.get("disabled") or config is not None or seq_lens.shape[0] != 1
                or max_query_len < MIN_CHUNK or num_tokens != max_query_len
                or query.device.type != "cuda" or torch.cuda.is_current_stream_capturing()):
            counts["triton"] = counts.get("triton", 0) + 1
            return original(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                            max_query_len, max_seq_len, softmax_scale, out=out, config=config)
        group = num_heads // k_cache.shape[2]
        prefix = max_seq_len - max_query_len
        k = gather(k_cache, block_tables[0], max_seq_len, group)
        v = gather(v_cache, block_tables[0], max_seq_len, group)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d]
        try:
            if prefix == 0:
                result = cudnn(q, k, v, True, softmax_scale)[0]
            else:
                o1, lse1 = cudnn(q, k[:, :, :prefix], v[:, :, :prefix], False, softmax_scale)
                o2, lse2 = cudnn(q, k[:, :, prefix:], v[:, :, prefix:], True, softmax_scale)
                weight = torch.sigmoid(lse1 - lse2)  # share of the prefix part
                result = o2.float().lerp_(o1.float(), weight)
        except RuntimeError as error:
            counts["disabled"] = str(error).splitlines()[0][:200]
            return hybrid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                          max_query_len, max_seq_len, softmax_scale, out=out, config=config)
        counts["cudnn"] = counts.get("cudnn", 0) + 1
        if out is None:
            out = torch.empty_like(query)
        out.copy_(result[0].transpose(0, 1))
        return out

    return hybrid


def main() -> None:
    argv = sys.argv[1:]
    mode = "triton"
    if argv[:1] == ["--mode"]:
        mode, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    counts: dict = {}
    if mode == "cudnn":
        module = importlib.import_module("kvtier.kernels.paged_attention")
        module.paged_attention = make_hybrid(module.paged_attention, counts)
    atexit.register(lambda: print(f"prefill_sdpa_probe mode={mode} chunks={counts}",
                                  file=sys.stderr))
    sys.argv = ["kvtier", *argv]
    runpy.run_module("kvtier.cli.main", run_name="__main__")


if __name__ == "__main__":
    main()
