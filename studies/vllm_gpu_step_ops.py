"""How many kernel launches and host reads the vLLM plugin's GPU path makes per layer and decode step.

On a GPU each launch costs a few microseconds from Python, and each host read of a device tensor (a copy to the
host, ``.item()``, ``bool()`` / ``int()`` of a tensor) waits for everything queued before it: Python can no longer
launch ahead of the GPU. So these counts are what a decode step pays per layer outside the batched paged decode
kernel's own work. The path is device-independent torch and Triton, so the count is measured
here on the CPU (Triton under ``TRITON_INTERPRET=1``, set here): :func:`kivi.vllm.paged.paged_step` with the
``"triton"`` page reader (the opt-in GPU path) over one layer's cache laid out as vLLM allocates it
(``benchmarks/plugin_step.py``), ``--requests`` requests of ``--context`` tokens, then ``--steps`` decode steps
(each step's plan made before it, as the plugin's metadata builder makes it once for every layer),
once with the Triton writes (``--writes triton``, :mod:`kivi.kernels.triton_paged_write`) and once with the torch
writes (``torch``, what the path did before them). The decode kernel's host wrapper
(:func:`kivi.kernels.triton_paged.triton_paged_decode`) runs and its two launches are counted, but not executed
(:data:`SKIPPED`: the interpreter would take minutes; its output is not used here). The Triton writes append their
finiteness flag to a list as the plugin's layers do (:class:`kivi.vllm.write.FiniteChecks` reads every layer's
back once per step: one host read a step, not counted per layer). torch operations are counted with a
``TorchDispatchMode`` ("launching" leaves out those that only make views or metadata, :data:`METADATA_OPS`),
Triton launches by wrapping the interpreter's launch; host reads are ``Tensor.cpu`` / ``Tensor.tolist`` calls, the
decode wrapper's ``on_host`` calls (each a copy of a slot table on a GPU) and ``aten._local_scalar_dense``
operations (``item``, ``int``, ``bool`` of a tensor; host arrays read through numpy are the plan's and are not
counted). A step in which key groups leave the window (every ``G``-th) does more. Copies from the host to the
device (the plan's tables, once per layer with the Triton writes) are no operation on the CPU and are not counted.

    python studies/vllm_gpu_step_ops.py --json results/vllm/gpu_step_ops_s21.json
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kivi.config import KiviConfig  # noqa: E402
from kivi.vllm.decode import DecodeKernel, decode_kernel  # noqa: E402
from kivi.vllm.geometry import build_geometry  # noqa: E402
from kivi.vllm.paged import paged_step  # noqa: E402
from kivi.vllm.plan import step_plan  # noqa: E402
from plugin_step import LayerCache  # noqa: E402

#: operations that make views, metadata or host wrappers only (no kernel of their own on a GPU)
METADATA_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.select.int", "aten.slice.Tensor", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.transpose.int", "aten.expand.default", "aten.as_strided.default", "aten.detach.default",
    "aten.set_.source_Storage", "aten.unbind.int", "aten.lift_fresh.default", "aten.alias.default",
    "aten.t.default", "aten.permute.default", "aten.empty.memory_format", "aten.empty_strided.default",
    "aten.empty_like.default", "aten.view.dtype",
})
#: the decode kernel's launches: counted, not executed
SKIPPED = frozenset({"paged_split_kernel", "decode_reduce_kernel"})
HOST_READ_OPS = frozenset({"aten._local_scalar_dense.default"})


class Count(TorchDispatchMode):
    """Counts torch operations, except those the Triton interpreter runs while it emulates a launch (``paused``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_host_reads(count: Count, reads: Counter) -> list:
    """Wrap ``Tensor.cpu`` / ``Tensor.tolist`` to count their calls in ``reads`` while ``count`` is active and not
    paused; returns what :func:`restore` puts back."""
    saved = [(name, getattr(torch.Tensor, name)) for name in ("cpu", "tolist")]
    for name, fn in saved:
        def wrapped(self, *a, _fn=fn, _name=name, **kw):
            if count.active and not count.paused:
                reads[f"Tensor.{_name}"] += 1
            return _fn(self, *a, **kw)
        setattr(torch.Tensor, name, wrapped)
    return saved


def count_on_host(count: Count, reads: Counter):
    """Wrap :func:`kivi.attention.fused_cpu.paged.on_host` where the Triton decode wrapper calls it: on a GPU each
    call copies a slot table to the host (on the CPU it returns its input, so ``Tensor.cpu`` does not see it)."""
    import kivi.kernels.triton_paged as tp

    fn = tp.on_host

    def wrapped(fp):
        if count.active and not count.paused:
            reads["on_host"] += 1
        return fn(fp)

    tp.on_host = wrapped
    return lambda: setattr(tp, "on_host", fn)


def restore(saved: list) -> None:
    for name, fn in saved:
        setattr(torch.Tensor, name, fn)


def count_steps(writes: str, preset: str, N: int, T: int, steps: int) -> dict:
    """Per decode step: torch operations (all / launching) and Triton launches, with ``writes`` ("triton" or
    "torch") writing the pages and rings."""
    from triton.runtime.interpreter import InterpretedFunction

    cfg, dtype = KiviConfig.preset(preset), torch.bfloat16
    hq, hkv, d, P = 9, 3, 64, 128  # SmolLM2's attention, vLLM's CPU block size
    geo = build_geometry(cfg, page_size=P, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    cache = LayerCache(geo, N * (-(-(T + steps) // P)) + 2, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    n = N * T
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    paged_step(cfg, geo, "reference", q, k, v, cache.pages, cache.rings, cache.batch([(i, 0, T) for i in range(N)]),
               d ** -0.5, torch.empty(n, hq, d, dtype=dtype))
    made = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
    if made is None or (writes == "triton" and made.writer is None):
        raise SystemExit("the decode kernel or the Triton writes do not apply here (triton not installed?)")
    kernel = DecodeKernel(made.pool, made.layout, made.rings, made.writer if writes == "triton" else None,
                          made.attend)
    takes_flags = "flags" in inspect.signature(paged_step).parameters  # an older checkout: read back per layer
    launches = []
    count = Count()
    reads: Counter[str] = Counter()
    run = InterpretedFunction.run

    def counted(self, *a, **kw):
        launches.append(1)
        if self.fn.__name__ in SKIPPED:
            return None
        count.paused = True
        try:
            return run(self, *a, **kw)
        finally:
            count.paused = False

    InterpretedFunction.run = counted
    saved = count_host_reads(count, reads)
    unwrap = count_on_host(count, reads)
    per_step = []
    try:
        for s in range(steps):
            q, k, v = (torch.randn(N, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
            batch = cache.batch([(i, T + s, 1) for i in range(N)])
            # the step's plan is made once per step for every layer (the plugin's metadata builder), not counted
            batch = dataclasses.replace(batch, plan=step_plan(cfg, geo, batch.query_start, batch.seq_lens))
            count.ops.clear()
            launches.clear()
            reads.clear()
            flags = {"flags": []} if takes_flags else {}
            with count:
                paged_step(cfg, geo, "triton", q, k, v, cache.pages, cache.rings, batch, d ** -0.5,
                           torch.empty(N, hq, d, dtype=dtype), kernel=kernel, **flags)
            torch_launching = sum(c for op, c in count.ops.items() if op not in METADATA_OPS)
            host_reads = sum(reads.values()) + sum(count.ops[op] for op in HOST_READ_OPS)
            per_step.append(dict(step=s, ops=sum(count.ops.values()), torch_launching=torch_launching,
                                 triton=len(launches), launches=torch_launching + len(launches),
                                 host_reads=host_reads, reads=dict(reads), by_op=dict(count.ops)))
    finally:
        InterpretedFunction.run = run
        restore(saved)
        unwrap()
    counts = [r["launches"] for r in per_step]
    summary = dict(writes=writes, preset=preset, requests=N, context=T, steps=steps, page_size=P, dtype=str(dtype),
                   launches_median=statistics.median(counts), launches_max=max(counts), launches_min=min(counts),
                   triton_median=statistics.median(r["triton"] for r in per_step),
                   host_reads_median=statistics.median(r["host_reads"] for r in per_step),
                   host_reads_max=max(r["host_reads"] for r in per_step),
                   ops_median=statistics.median(r["ops"] for r in per_step))
    return dict(summary=summary, per_step=per_step)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--writes", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    for writes in args.writes:
        out[writes] = count_steps(writes, args.preset, args.requests, args.context, args.steps)
        print(json.dumps(out[writes]["summary"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
