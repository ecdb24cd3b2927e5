"""Prefill kernel variants on the lent GPU: the paged attention kernel with its key loops or
its softmax rewritten (Triton's warp specialisation, loop-level pipelining, the scale folded
into the exponent, lazy rescaling), timed next to the kernel as it is on the chunks of a
32K-token prompt in 8K steps.

    python scripts/prefill_variant_probe.py [--tilings 64x128x8x2,32x128x8x3]
        [--variants base,"fma softmax"]

A variant is a copy of kernels/paged_attention.py with source edits, written to a temporary
module (Triton reads a kernel's source from its file). Each variant's output is checked
against the first variant's; a variant that fails to compile is reported, not fatal.
Medians of triton.testing.do_bench, eager.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
from kvtier.cli.bench import kernels as kb
from kvtier.kernels import AttentionConfig

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "paged_attention.py"
UNMASKED = "for start_n in range(lo, unmasked_end, TILE_N):"
MASKED = "for start_n in range(unmasked_end, hi, TILE_N):"

SCALED_SCORES = """\
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N] float32
"""
SOFTMAX = """\
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may see no key of this tile yet (split-KV ranges); keep its exponents finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
"""
#: Raw scores, the scale folded into the row maxima and the exponent's multiply-add (one
#: float operation per score fewer), no -inf guard in unmasked tiles.
FMA_SOFTMAX = """\
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
"""
RESCALE = """\
    l_i = l_i * alpha + tl.sum(p, 1)
"""
ACC_UPDATE = """\
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
"""
#: Lazy rescaling: the running maxima (and acc) move only when a row's grows by more than
#: 2^8; otherwise the exponents run against the old maxima.
LAZY_SOFTMAX = """\
    m_cand = tl.maximum(m_i, tl.max(s, 1))
    grows = tl.max(tl.where(m_cand > m_i + 8.0, 1, 0), 0) > 0
    m_new = m_i
    if grows:
        m_new = m_cand
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
"""


def _loops(unmasked: str, masked: str) -> list[tuple[str, str]]:
    return [(UNMASKED, unmasked), (MASKED, masked)]


#: name -> source edits (old text, new text), each old text found exactly once
VARIANTS = {
    "base": [],
    "ws unmasked": _loops(
        "for start_n in tl.range(lo, unmasked_end, TILE_N, warp_specialize=True):", MASKED),
    "ws both": _loops(
        "for start_n in tl.range(lo, unmasked_end, TILE_N, warp_specialize=True):",
        "for start_n in tl.range(unmasked_end, hi, TILE_N, warp_specialize=True):"),
    "flatten": _loops("for start_n in tl.range(lo, unmasked_end, TILE_N, flatten=True):",
                      MASKED),
    "disallow acc multi buffer": _loops(
        "for start_n in tl.range(lo, unmasked_end, TILE_N, disallow_acc_multi_buffer=True):",
        MASKED),
    "fma softmax": [(SCALED_SCORES, SCALED_SCORES.replace(" * qk_scale", "")),
                    (SOFTMAX, FMA_SOFTMAX)],
    "lazy rescale": [(SOFTMAX, LAZY_SOFTMAX), (RESCALE, "    l_i = l_i + tl.sum(p, 1)\n"),
                     (ACC_UPDATE, ACC_UPDATE.replace("acc * alpha[:, None]", "acc"))],
}

#: (chunk, prefix) of a 32,768-token prompt in 8,192-token steps.
CHUNKS = ((8192, 0), (8192, 8192), (8192, 16384), (8192, 24576))


def load_variant(name: str, edits: list[tuple[str, str]], directory: Path):
    text = SOURCE.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{name}: the kernel changed; update the probe"
        text = text.replace(old, new)
    module_name = "pa_variant_" + "".join(c if c.isalnum() else "_" for c in name)
    path = directory / f"{module_name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def parse_tiling(text: str) -> AttentionConfig:
    bq, tn, w, s = (int(x) for x in text.split("x"))
    return AttentionConfig(bq, tn, 1, w, s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tilings", default="64x128x8x2,32x128x8x3,64x64x8x3")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    tilings = [parse_tiling(t) for t in args.tilings.split(",")]
    device = torch.device("cuda")
    setup = kb.PagedSetup(32768 // kb.BLOCK_SIZE + 64, device)
    directory = Path(tempfile.mkdtemp(prefix="pa-variants-"))
    modules = {}
    for name in args.variants.split(","):
        try:
            modules[name] = load_variant(name, VARIANTS[name], directory)
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            print(f"{name}: does not load: {exc!r}"[:300], flush=True)
    totals: dict[tuple[str, str], float] = {}
    for chunk, prefix in CHUNKS:
        meta = setup.batch([prefix + chunk], [chunk])
        flops = 4 * kb.NUM_HEADS * kb.HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
        for tiling in tilings:
            expected = None
            for name, module in modules.items():
                key = (name, f"q{tiling.block_q} t{tiling.tile_n} w{tiling.num_warps} "
                             f"s{tiling.num_stages}")
                try:
                    def call(module=module, tiling=tiling, meta=meta):
                        return module.paged_attention(**meta, softmax_scale=kb.SCALE,
                                                      config=tiling)
                    out = call()
                    if expected is None:
                        expected = out.clone()
                    err = kb.rel_error(out, expected)
                    ms = kb.median_ms(call)
                except Exception as exc:  # noqa: BLE001 - a variant that fails is reported
                    print(f"{chunk}+{prefix} {key}: FAILED {exc!r}"[:400], flush=True)
                    totals[key] = float("nan")
                    continue
                totals[key] = totals.get(key, 0.0) + ms
                print(f"{chunk}+{prefix:<6} {key[0]:26s} {key[1]:16s} {ms:7.3f} ms "
                      f"{flops / ms / 1e9:5.0f} TFLOP/s  err {err:.1e}", flush=True)
        torch.cuda.empty_cache()
    print("\nsum over the four chunks (one layer of a 32K prompt):")
    for (name, tiling), ms in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {name:26s} {tiling:16s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
