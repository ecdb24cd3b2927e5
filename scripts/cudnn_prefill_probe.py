"""kernels.cudnn_backend beside the Triton kernel, on the lent GPU.

    python scripts/cudnn_prefill_probe.py

The prefill chunks of a 32K-token prompt in 8K steps, a 2K chunk after a 30K prefix, ragged
batches of short chunks and a chunk batched with decodes, each over the benchmark's
cross-layer cache in random block order (Llama-3-8B shapes, bfloat16). cuDNN runs each
with the graph bucket the backend picks ("auto") and with one loose bucket (longest query
8K, tables 128K tokens wide) to see what a coarser bucketing would cost. Outputs are
checked against the Triton kernel's; a last case poisons the unwritten slots of the last
blocks with NaN to see whether cuDNN reads them. Medians of triton.testing.do_bench.
"""

from __future__ import annotations

import time

import torch
from kvtier.cli.bench import kernels as kb
from kvtier.kernels import cudnn_backend, paged_attention
from kvtier.kernels.cudnn_backend import GraphShape

#: (q_lens, prefix lens) per case.
CASES = {
    "8K chunk after 0": ([8192], [0]),
    "8K chunk after 8K": ([8192], [8192]),
    "8K chunk after 16K": ([8192], [16384]),
    "8K chunk after 24K": ([8192], [24576]),
    "2K chunk after 30K": ([2048], [30720]),
    "512 after 1K": ([512], [1024]),
    "128 after 4K": ([128], [4096]),
    "4 x 512 after 0-3K": ([512] * 4, [0, 1024, 2048, 3072]),
    "8 x 1K after 1-8K": ([1024] * 8, [1024 * (i + 1) for i in range(8)]),
    "2K chunk + 7 decodes": ([2048] + [1] * 7, [4096] + [2047 + 1000 * i for i in range(7)]),
    "16 x 256 after 0-15K": ([256] * 16, [1024 * i for i in range(16)]),
}
LOOSE_Q, LOOSE_PAGES = 8192, 8192


def main() -> None:
    import cudnn

    device = torch.device("cuda")
    print(f"cuDNN backend {cudnn.backend_version()}, torch {torch.__version__}", flush=True)
    setup = kb.PagedSetup(150_000 // kb.BLOCK_SIZE, device)
    totals = {"triton": 0.0, "auto": 0.0, "loose": 0.0}
    for name, (q_lens, prefixes) in CASES.items():
        seq_lens = [p + q for p, q in zip(prefixes, q_lens)]
        meta = setup.batch(seq_lens, q_lens)
        flops = sum(4 * kb.NUM_HEADS * kb.HEAD_DIM * q * (p + (q + 1) / 2)
                    for q, p in zip(q_lens, prefixes))
        expected = paged_attention(**meta, softmax_scale=kb.SCALE)
        times = {"triton": kb.median_ms(kb.paged_fn(meta, None))}
        errors = {}
        shapes = {"auto": None,
                  "loose": GraphShape(GraphShape.for_step(len(q_lens), 1, 1).num_reqs,
                                      LOOSE_Q, LOOSE_PAGES)}
        for label, shape in shapes.items():
            out = torch.empty_like(meta["query"])
            started = time.perf_counter()
            try:
                cudnn_backend.paged_attention(**meta, softmax_scale=kb.SCALE, out=out,
                                              shape=shape)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported, the probe goes on
                print(f"{name} {label}: FAILED {exc!r}"[:500], flush=True)
                continue
            first_ms = (time.perf_counter() - started) * 1e3
            errors[label] = kb.rel_error(out, expected)
            times[label] = kb.median_ms(
                lambda out=out, shape=shape, meta=meta: cudnn_backend.paged_attention(
                    **meta, softmax_scale=kb.SCALE, out=out, shape=shape))
            print(f"  {name} {label}: first call {first_ms:.0f} ms", flush=True)
        if name.startswith("8K"):
            for label in totals:
                totals[label] += times.get(label, float("nan"))
        row = "  ".join(f"{k} {v:7.3f} ms ({flops / v / 1e9:4.0f} TF)" for k, v in times.items())
        ratios = "  ".join(f"{k}/triton {times[k] / times['triton']:.3f} err {errors[k]:.1e}"
                           for k in errors)
        print(f"{name:22s} {row}  {ratios}", flush=True)
    print("32K in 8K chunks, one layer: " + ", ".join(
        f"{k} {v:.3f} ms ({v / totals['triton']:.3f})" for k, v in totals.items()), flush=True)
    print(f"graphs built: {cudnn_backend._PREFILL.num_graphs}", flush=True)
    # Unwritten slots of the last blocks holding NaN (the engine's cache starts zeroed).
    meta = setup.batch([1000, 777], [1000, 77])
    tail = [meta["block_tables"][0, 1000 // 16], meta["block_tables"][1, 777 // 16]]
    saved = [setup.cache[int(b)].clone() for b in tail]
    setup.cache[int(tail[0]), :, :, 1000 % 16:] = float("nan")
    setup.cache[int(tail[1]), :, :, 777 % 16:] = float("nan")
    got = cudnn_backend.paged_attention(**meta, softmax_scale=kb.SCALE)
    ref = paged_attention(**meta, softmax_scale=kb.SCALE)
    print(f"NaN in unwritten slots: cuDNN output has NaN: {bool(torch.isnan(got).any())}, "
          f"Triton: {bool(torch.isnan(ref).any())}", flush=True)
    for b, block in zip(tail, saved):
        setup.cache[int(b)] = block


if __name__ == "__main__":
    main()
