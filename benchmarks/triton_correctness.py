"""CPU check of the Triton decode path on real cache layouts (TRITON_INTERPRET=1): a correctness table,
and what a decode step spends preparing the kernel's inputs.

1. Correctness: a :class:`~kivi.cache.layer.KiviLayer` per preset (``extreme`` K2V2, ``balanced``
   K4V2 + 4 sinks, ``high`` K4V4 + 4 sinks, ``k8v8`` + 4 sinks, 3-bit ``k3v3`` + 4 sinks and ``k3v2``;
   ``--presets`` picks some) and dtype, filled with a prefill and then
   ``block_size`` chunks (a prefill block + several ``block_size`` blocks per side, the last one
   partly filled), then one decode step with a left-padding mask; the max abs error of the
   ``"triton"`` backend (the kernel, in the interpreter) against ``reference_attention`` (materialize +
   softmax in float32). Interpreter times are meaningless for speed and are not reported.
2. Preparation per decode step (CPU tensors, no kernel): building the kernel's sides from the views
   (block tables memoised in the store) against the previous path's ``BlockStore.read`` of both sides
   (every stored block concatenated every step), at a long context. Only the preparation is timed.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/triton_correctness.py --out results/triton/triton12_correctness.json
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from common import environment, time_calls, write_json  # noqa: E402
from kivi.attention.reference import reference_attention  # noqa: E402
from kivi.attention.triton_backend import kernel_side_of, triton_view_attention  # noqa: E402
from kivi.cache.layer import KiviLayer  # noqa: E402
from kivi.config import KiviConfig  # noqa: E402

PRESETS = {
    "extreme": dict(k_bits=2, v_bits=2, sink_tokens=0),
    "balanced": dict(k_bits=4, v_bits=2, sink_tokens=4),
    "high": dict(k_bits=4, v_bits=4, sink_tokens=4),
    "k8v8": dict(k_bits=8, v_bits=8, sink_tokens=4),
    "k3v3": dict(k_bits=3, v_bits=3, sink_tokens=4),  # 3-bit codes may straddle two bytes
    "k3v2": dict(k_bits=3, v_bits=2, sink_tokens=0),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def filled_layer(cfg, B, hkv, d, T, extra, dtype, seed=0):
    """Views of one decode step after a prefill of ``T - extra - 1`` tokens and ``extra`` tokens in
    ``block_size`` chunks."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, hkv, T, d, generator=g) * 1.5).to(dtype)
    k[..., 1] += 5.0
    v = torch.randn(B, hkv, T, d, generator=g).to(dtype)
    layer = KiviLayer(cfg)
    pos = T - extra - 1
    layer.append(k[:, :, :pos], v[:, :, :pos])
    while pos < T - 1:
        n = min(cfg.block_size, T - 1 - pos)
        layer.append(k[:, :, pos : pos + n], v[:, :, pos : pos + n])
        pos += n
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    return layer, kv, vv


def correctness(args) -> list[dict]:
    rows = []
    print(f"{'preset':>9} {'dtype':>5} {'Hq/Hkv':>6} {'T':>4} {'blocks k/v':>10} {'max|err|':>9} {'max|ref|':>8} "
          f"{'rel':>8}")
    for preset in args.presets:
        bits = PRESETS[preset]
        cfg = KiviConfig(group_size=16, residual_length=16, block_size=32, **bits)
        for dname, dtype in DTYPES.items():
            for hq, hkv in ((9, 3), (8, 1)):
                T = args.context
                layer, kv, vv = filled_layer(cfg, 2, hkv, 32, T, args.extra, dtype, seed=hq)
                q = torch.randn(2, hq, 1, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
                mask = torch.ones(2, 1, 1, T, dtype=torch.bool)
                mask[1, ..., :11] = False  # left padding over the sink and into the store
                got = triton_view_attention(q, kv, vv, scaling=32**-0.5, attention_mask=mask)
                ref = reference_attention(q, kv, vv, scaling=32**-0.5, attention_mask=mask)
                err = (got.float() - ref.float()).abs().max().item()
                top = ref.float().abs().max().item()
                nk = sum(b is not None for b in layer.k.store.blocks)
                nv = sum(b is not None for b in layer.v.store.blocks)
                rows.append(dict(preset=preset, dtype=dname, hq=hq, hkv=hkv, context=T, key_blocks=nk, value_blocks=nv,
                                 sink_tokens=bits["sink_tokens"], max_abs_err=err, ref_max_abs=top, rel=err / top))
                print(f"{preset:>9} {dname:>5} {hq:>3}/{hkv:<2} {T:>4} {nk:>5}/{nv:<4} {err:9.2e} {top:8.3f} "
                      f"{err / top:8.1e}",
                      flush=True)
    return rows


def preparation(args) -> dict:
    """Median microseconds per decode step to prepare both sides: kernel sides vs BlockStore.read."""
    cfg = KiviConfig(group_size=32, residual_length=128, block_size=256, k_bits=2, v_bits=2)
    T, extra = args.prep_context, args.prep_extra
    layer, kv, vv = filled_layer(cfg, 1, 3, 64, T, extra, torch.float16)  # SmolLM2 kv heads / head_dim
    dev = torch.device("cpu")

    def sides():
        return kernel_side_of(kv, dev), kernel_side_of(vv, dev)

    def concat():
        return kv.store.read(kv.split), vv.store.read(vv.split)

    sides()  # builds and memoises the tables (once per set of blocks)
    out = {}
    for name, fn in (("kernel_sides", sides), ("blockstore_read", concat)):
        out[name + "_us"] = 1e6 * statistics.median(time_calls(fn, args.repeat, warmup=0))
    out.update(context=T, blocks=sum(b is not None for b in layer.k.store.blocks), kv_heads=3, head_dim=64,
               dtype="fp16", bits=2, repeat=args.repeat)
    out["ratio"] = out["blockstore_read_us"] / out["kernel_sides_us"]
    print(f"\nper-step preparation, T={T} ({out['blocks']} key blocks), SmolLM2 kv shapes, K2V2 fp16 (CPU tensors): "
          f"kernel sides {out['kernel_sides_us']:.1f} us, "
          f"BlockStore.read of both sides {out['blockstore_read_us']:.1f} us "
          f"({out['ratio']:.1f}x)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS),
                    help="cache layouts of the correctness table (default: all)")
    ap.add_argument("--context", type=int, default=171, help="tokens in the correctness layouts (odd)")
    ap.add_argument("--extra", type=int, default=96, help="tokens appended in block_size chunks after the prefill")
    ap.add_argument("--prep-context", type=int, default=32768 + 37)
    ap.add_argument("--prep-extra", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = correctness(args)
    prep = preparation(args)
    import triton

    result = dict(env=dict(environment(), triton=triton.__version__, interpreter=os.environ.get("TRITON_INTERPRET")),
                  correctness=rows, preparation=prep, wall_s=time.time() - t0)
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    worst = max(r["rel"] for r in rows)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
