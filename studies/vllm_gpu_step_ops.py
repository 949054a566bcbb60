"""How many torch operations the vLLM plugin's GPU path runs per layer and decode step, besides its decode kernel.

On a GPU each operation that computes is a kernel launch (a few microseconds each, from Python), so this count is
what a decode step pays per layer outside the batched paged decode kernel. The path is device-independent torch,
so the count is measured here on the CPU: :func:`kivi.vllm.paged.paged_step` with the ``"triton"`` page reader
(the opt-in GPU path: the decode rows' inputs built with torch, the writes on the torch path) over one layer's
cache laid out as vLLM allocates it (``benchmarks/plugin_step.py``), ``--requests`` requests of ``--context``
tokens, then ``--steps`` decode steps; the Triton kernel itself is replaced by a stub (its one launch is not
counted). Operations are counted with a ``TorchDispatchMode``; "launching" leaves out those that only make views
or metadata (:data:`METADATA_OPS`). A step in which key groups leave the window (every ``G``-th) does more.

    python studies/vllm_gpu_step_ops.py --json results/vllm/gpu_step_ops_s20.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kivi.config import KiviConfig  # noqa: E402
from kivi.vllm.decode import DecodeKernel, decode_kernel  # noqa: E402
from kivi.vllm.geometry import build_geometry  # noqa: E402
from kivi.vllm.paged import paged_step  # noqa: E402
from plugin_step import LayerCache  # noqa: E402

#: operations that make views, metadata or host wrappers only (no kernel of their own on a GPU)
METADATA_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.select.int", "aten.slice.Tensor", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.transpose.int", "aten.expand.default", "aten.as_strided.default", "aten.detach.default",
    "aten.set_.source_Storage", "aten.unbind.int", "aten.lift_fresh.default", "aten.alias.default",
    "aten.t.default", "aten.permute.default", "aten.empty.memory_format", "aten.empty_strided.default",
})


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    cfg, dtype = KiviConfig.preset(args.preset), torch.bfloat16
    hq, hkv, d, P, N, T = 9, 3, 64, 128, args.requests, args.context  # SmolLM2's attention, vLLM's CPU block size
    geo = build_geometry(cfg, page_size=P, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    cache = LayerCache(geo, N * (-(-(T + args.steps) // P)) + 2, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    n = N * T
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    paged_step(cfg, geo, "reference", q, k, v, cache.pages, cache.rings, cache.batch([(i, 0, T) for i in range(N)]),
               d ** -0.5, torch.empty(n, hq, d, dtype=dtype))
    made = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
    if made is None:
        raise SystemExit("the batched paged decode kernel does not apply (triton not installed?)")
    kernel = DecodeKernel(made.pool, made.layout, made.rings, None,
                          lambda q, *a, **kw: torch.zeros(q.shape, dtype=q.dtype))  # the one launch, not counted
    per_step = []
    for s in range(args.steps):
        q, k, v = (torch.randn(N, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        batch = cache.batch([(i, T + s, 1) for i in range(N)])
        count = Count()
        with count:
            paged_step(cfg, geo, "triton", q, k, v, cache.pages, cache.rings, batch, d ** -0.5,
                       torch.empty(N, hq, d, dtype=dtype), kernel=kernel)
        launching = sum(c for op, c in count.ops.items() if op not in METADATA_OPS)
        per_step.append(dict(step=s, ops=sum(count.ops.values()), launching=launching, by_op=dict(count.ops)))
    launches = [r["launching"] for r in per_step]
    summary = dict(preset=args.preset, requests=N, context=T, steps=args.steps, page_size=P, dtype=str(dtype),
                   ops_median=statistics.median(r["ops"] for r in per_step),
                   launching_median=statistics.median(launches), launching_max=max(launches),
                   launching_min=min(launches))
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summary=summary, per_step=per_step), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
