"""Fresh prefills (no cached prefix) through cuDNN on the step's own K/V, beside the paged
cuDNN backend and torch's SDPA, on the lent GPU.

    python scripts/fresh_prefill_probe.py

A step whose requests all start at token 0 attends only to the keys it computed itself, and
those sit contiguous in the step's `key` / `value` tensors ([num_tokens, kv_heads, head_dim])
before they are stored. This probe times, for such steps (Llama-3-8B shapes, bfloat16, the
benchmark's cross-layer cache in random block order):

  * "paged":  kernels.cudnn_backend.paged_attention (cuDNN through the block tables);
  * "ragged": one cuDNN graph over the packed step K/V with ragged offsets, causal (what a
              fresh-step path in the backend would run);
  * "sdpa":   torch's scaled_dot_product_attention per request on [1, heads, len, dim]
              views (its default dispatch: cuDNN on an H100), which is what transformers runs;

and the first call of "sdpa" for a length it has not seen (torch builds a cuDNN plan per
shape). Outputs are checked against the paged backend. Medians of triton.testing.do_bench.
"""

from __future__ import annotations

import time

import torch
from kvtier.cli.bench import kernels as kb
from kvtier.kernels import cudnn_backend

CASES = {
    "8K": [8192],
    "16K": [16384],
    "32K": [32768],
    "4 x 2K": [2048] * 4,
    "3K + 5K": [3072, 5120],
}


def ragged_graph(handle, num_reqs: int, max_len: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float):
    import cudnn

    io, i32 = cudnn.data_type.BFLOAT16, cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    b, s = num_reqs, max_len

    def packed(name, heads):
        dims = [b, heads, s, head_dim]
        strides = [s * heads * head_dim, head_dim, heads * head_dim, 1]
        return g.tensor(name=name, dim=dims, stride=strides, data_type=io), dims, strides

    q, q_dims, q_strides = packed("q", num_heads)
    k, _, _ = packed("k", num_kv_heads)
    v, _, _ = packed("v", num_kv_heads)
    one = dict(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    q_off = g.tensor(name="q_off", **one)
    kv_off = g.tensor(name="kv_off", **one)
    q.set_ragged_offset(q_off)
    k.set_ragged_offset(kv_off)
    v.set_ragged_offset(kv_off)
    lens = dict(dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    seq_q = g.tensor(name="seq_q", **lens)
    seq_kv = g.tensor(name="seq_kv", **lens)
    o, _ = g.sdpa(name="fresh", q=q, k=k, v=v, is_inference=True, attn_scale=scale,
                  use_causal_mask=True, use_padding_mask=True, seq_len_q=seq_q,
                  seq_len_kv=seq_kv)
    o.set_output(True).set_dim(q_dims).set_stride(q_strides).set_ragged_offset(q_off)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")
    return g, dict(q=q, k=k, v=v, o=o, q_off=q_off, kv_off=kv_off, seq_q=seq_q,
                   seq_kv=seq_kv), workspace


def main() -> None:
    import cudnn

    device = torch.device("cuda")
    print(f"cuDNN {cudnn.backend_version()}, torch {torch.__version__}", flush=True)
    setup = kb.PagedSetup(150_000 // kb.BLOCK_SIZE, device)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    for name, q_lens in CASES.items():
        meta = setup.batch(q_lens, q_lens)
        n = len(q_lens)
        starts = meta["query_start_loc"]
        # The step's own K/V, packed as the model has them before store_kv.
        per_req = [setup.contiguous_kv({"block_tables": meta["block_tables"][r:r + 1]}, q)
                   for r, q in enumerate(q_lens)]  # ([1, kv_heads, q, dim], same)
        k = torch.cat([kr[0].transpose(0, 1) for kr, _ in per_req])
        v = torch.cat([vr[0].transpose(0, 1) for _, vr in per_req])
        k, v = k.contiguous(), v.contiguous()  # [num_tokens, kv_heads, head_dim]
        query = meta["query"]
        flops = sum(4 * kb.NUM_HEADS * kb.HEAD_DIM * q * (q + 1) / 2 for q in q_lens)
        expected = cudnn_backend.paged_attention(**meta, softmax_scale=kb.SCALE)
        times = {"paged": kb.median_ms(lambda meta=meta: cudnn_backend.paged_attention(
            **meta, softmax_scale=kb.SCALE))}

        bucket = cudnn_backend.GraphShape.for_step(n, max(q_lens), 1)
        started = time.perf_counter()
        g, t, ws = ragged_graph(handle, bucket.num_reqs, bucket.max_query_len, kb.NUM_HEADS,
                                kb.NUM_KV_HEADS, kb.HEAD_DIM, kb.SCALE)
        build_ms = (time.perf_counter() - started) * 1e3
        pad = bucket.num_reqs - n
        cu = torch.cat([starts[:n + 1], starts[n:n + 1].expand(pad)]).to(torch.int32)
        lens = (cu[1:] - cu[:-1]).view(-1, 1, 1, 1)
        out = torch.empty_like(query)
        feed = {t["q"]: query, t["k"]: k, t["v"]: v, t["o"]: out,
                t["q_off"]: (cu * kb.NUM_HEADS * kb.HEAD_DIM).view(-1, 1, 1, 1),
                t["kv_off"]: (cu * kb.NUM_KV_HEADS * kb.HEAD_DIM).view(-1, 1, 1, 1),
                t["seq_q"]: lens, t["seq_kv"]: lens}
        g.execute(feed, ws, handle=handle)
        torch.cuda.synchronize()
        err_ragged = kb.rel_error(out, expected)
        times["ragged"] = kb.median_ms(
            lambda g=g, feed=feed, ws=ws: g.execute(feed, ws, handle=handle))

        views = []
        for r in range(n):
            a, b = int(starts[r]), int(starts[r + 1])
            views.append((query[a:b].transpose(0, 1).unsqueeze(0),
                          k[a:b].transpose(0, 1).unsqueeze(0),
                          v[a:b].transpose(0, 1).unsqueeze(0)))

        def sdpa(views=views) -> list[torch.Tensor]:
            return [torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=kb.SCALE, enable_gqa=True)
                for qq, kk, vv in views]
        started = time.perf_counter()
        outs = sdpa()
        torch.cuda.synchronize()
        sdpa_first_ms = (time.perf_counter() - started) * 1e3
        got = torch.cat([o[0].transpose(0, 1) for o in outs])
        err_sdpa = kb.rel_error(got, expected)
        times["sdpa"] = kb.median_ms(sdpa)
        row = "  ".join(f"{k_} {v_:7.3f} ms ({flops / v_ / 1e9:4.0f} TF)"
                        for k_, v_ in times.items())
        print(f"{name:8s} {row}  ragged/paged {times['ragged'] / times['paged']:.3f} "
              f"sdpa/paged {times['sdpa'] / times['paged']:.3f}  err ragged {err_ragged:.1e} "
              f"sdpa {err_sdpa:.1e}  ragged build {build_ms:.0f} ms, sdpa first call "
              f"{sdpa_first_ms:.0f} ms", flush=True)
    # torch's cuDNN plan cache: a length not seen before.
    for q_len in (30001, 30002, 12345):
        qq = torch.randn(1, kb.NUM_HEADS, q_len, kb.HEAD_DIM, device=device, dtype=kb.DTYPE)
        kk = torch.randn(1, kb.NUM_KV_HEADS, q_len, kb.HEAD_DIM, device=device, dtype=kb.DTYPE)
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(qq, kk, kk, is_causal=True,
                                                         enable_gqa=True)
        torch.cuda.synchronize()
        first = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(qq, kk, kk, is_causal=True,
                                                         enable_gqa=True)
        torch.cuda.synchronize()
        print(f"sdpa new length {q_len}: first call {first:.1f} ms, second "
              f"{(time.perf_counter() - started) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
