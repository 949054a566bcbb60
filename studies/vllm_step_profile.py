"""Where a vLLM engine step's time goes with kivi's plugin, prefill steps and decode steps apart, against bf16.

Each variant (``bf16``: vLLM's own cache; ``kivi``: the plugin, ``--kivi`` fields) runs in a fresh process:
one in-process ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, enforce_eager, prefix caching off,
one thread) serving the same requests (WikiText-2 prompts spread over ``--prompt-range``, greedy,
ignore_eos), all submitted at once. Timers wrap, by name (whatever the checkout defines):

* ``engine.step()`` (the whole step), vLLM's ``GPUModelRunner._model_forward`` (the model: its time less
  the attention's is "model outside attention"), the attention impl's ``forward`` (and bf16's
  ``do_kv_cache_update``); "engine outside the model" is the step less both (scheduling, inputs, sampling);
* for ``kivi``: :func:`kivi.vllm.paged.paged_step` and the functions it calls (``PARTS``), each timed
  exclusive of the timed functions it calls; "paged_step: rest" is its own Python and torch ops (the
  per-request views, concatenations, index lists).

A step is a *prefill step* when any request in it has more than one token (its decode rows, if any, are
counted with it), else a *decode step*. Prints one table per variant (ms per step and share of the step)
and the SHA-1 of the generated tokens (two checkouts' runs of a variant compare their results). Run with .venv-vllm:

    PYTHONPATH=$PWD .venv-vllm/bin/python studies/vllm_step_profile.py --requests 4 --prompt-range 1024 2048
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

#: (module, attribute, label) timed inside kivi's paged_step when the checkout defines them
PARTS = [
    ("kivi.vllm.paged", "block_field_views", "field views of the cache"),
    ("kivi.vllm.paged", "decode_kernel", "decode_kernel (pool, layout)"),
    ("kivi.vllm.paged", "gather_decode", "gather_decode (window rows for the kernel)"),
    ("kivi.vllm.backend", "step_plan", "step_plan (metadata builder, once per step)"),
    ("kivi.vllm.paged", "step_plan", "step_plan (per layer: no plan given)"),
    ("kivi.vllm.paged", "leaving_rows", "leaving_rows (kernel rows' leaving tokens)"),
    ("kivi.vllm.paged", "_ring_read", "_ring_read"),
    ("kivi.vllm.paged", "_ring_write", "_ring_write"),
    ("kivi.vllm.paged", "write_rings", "write_rings (all requests)"),
    ("kivi.vllm.paged", "page_store", "page_store (BlockStore views)"),
    ("kivi.vllm.paged", "_set_boundary", "_set_boundary (per-query precision)"),
    ("kivi.vllm.paged", "_quantize", "quantize leaving tokens"),
    ("kivi.vllm.paged", "_rows", "page row indices (_rows, per request)"),
    ("kivi.vllm.paged", "_page_index", "page row indices (_page_index, all requests)"),
    ("kivi.vllm.paged", "scatter_tokens", "scatter_tokens (page writes)"),
    ("kivi.vllm.paged", "write_step", "write_step (a decode-only step's writes, one compiled call)"),
    ("kivi.vllm.paged", "paged_decode", "paged_decode (row ids, query)"),
    ("kivi.vllm.decode", "paged_decode_attention", "decode kernel call"),
    ("kivi.vllm.paged", "exact_attention", "exact prefill (SDPA)"),
    ("kivi.vllm.prefill", "vllm_cpu_prefill", "exact prefill (vLLM's CPU kernel, all first chunks)"),
    ("kivi.vllm.paged", "run_backend", "run_backend (chunk / per-request decode)"),
]


class Clock:
    """Exclusive time per label and step kind: a timed call's time, less that of the timed calls inside it."""

    def __init__(self) -> None:
        self.stack: list[float] = []  # child time accumulated per open call
        self.now: dict[str, float] = defaultdict(float)  # this step's exclusive seconds per label
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*a, **k):
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                child = self.stack.pop()
                self.now[label] += dt - child
                self.calls[label] += 1
                if self.stack:
                    self.stack[-1] += dt
        return timed


def patch(owner, name: str, clock: Clock, label: str) -> bool:
    fn = getattr(owner, name, None)
    if fn is None:
        return False
    setattr(owner, name, clock.wrap(fn, label))
    return True


def child(job: dict) -> None:
    import importlib

    import torch
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kivi.data import load_text, token_ids
    from kivi.models import converted_cache_path, load_model

    torch.set_num_threads(1)
    path = converted_cache_path("smollm2")
    if not (path / "config.json").exists():
        load_model("smollm2")
    clock = Clock()
    kind = {"prefill": False}
    patch(GPUModelRunner, "_model_forward", clock, "model outside attention")
    if job["kivi"] is None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl

        patch(Impl, "do_kv_cache_update", clock, "attention (vLLM: cache write)")

        def prefill_of(md) -> bool:
            return md.max_query_len > 1
    else:
        from kivi.vllm import backend

        Impl = backend.KiviAttentionImpl
        for mod, name, label in PARTS:
            patch(importlib.import_module(mod), name, clock, label)
        patch(backend, "paged_step", clock, "paged_step: rest")

        def prefill_of(md) -> bool:
            qs = md.query_start
            return any(qs[i + 1] - qs[i] > 1 for i in range(len(qs) - 1))
    forward = Impl.forward

    def attn(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        if attn_metadata is not None:
            kind["prefill"] |= prefill_of(attn_metadata)
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k)

    Impl.forward = clock.wrap(attn, "attention: impl forward (rest)")

    from transformers import AutoTokenizer

    ids = token_ids(AutoTokenizer.from_pretrained(str(path)), load_text()).tolist()
    lo, hi = job["prompt_range"]
    n = job["requests"]
    prompts, at = [], 0
    for length in [lo + round((hi - lo) * i / max(1, n - 1)) for i in range(n)]:
        at = 0 if at + length > len(ids) else at
        prompts.append(ids[at:at + length])
        at += length
    max_len = -(-(hi + job["new_tokens"]) // 128) * 128
    extra = {"kv_cache_dtype": "auto"} if job["kivi"] is None else {"additional_config": {"kivi": job["kivi"]}}
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), dtype="bfloat16", max_model_len=max_len, block_size=128, enforce_eager=True, seed=0,
        enable_prefix_caching=False, kv_cache_memory_bytes=job["budget"],
        max_num_batched_tokens=job["max_batch_tokens"], **extra))
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=job["new_tokens"])

    def serve(batch: list[list[int]], tag: str, record: bool) -> dict:
        steps = {"prefill": defaultdict(float), "decode": defaultdict(float)}
        count = {"prefill": 0, "decode": 0}
        done = {}
        for i, p in enumerate(batch):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, greedy)
        t_all = time.perf_counter()
        while engine.has_unfinished_requests():
            clock.now.clear()
            kind["prefill"] = False
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            done.update((o.request_id, list(o.outputs[0].token_ids)) for o in outs if o.finished)
            k = "prefill" if kind["prefill"] else "decode"
            count[k] += 1
            steps[k]["engine step (total)"] += dt
            for label, s in clock.now.items():
                steps[k][label] += s
        tokens = json.dumps([done[f"{tag}{i}"] for i in range(len(batch))])
        return {"wall_s": time.perf_counter() - t_all, "steps": count,
                "seconds": {k: dict(v) for k, v in steps.items()},
                "tokens_sha1": hashlib.sha1(tokens.encode()).hexdigest()} if record else {}

    serve([prompts[0][:200]], "warmup", False)  # first-call costs (numba kernels load from their cache)
    clock.calls.clear()
    result = serve(prompts, "req", True)
    result["calls"] = dict(clock.calls)
    result["generated_tokens"] = n * job["new_tokens"]
    print("RESULT " + json.dumps(result), flush=True)


def table(variant: str, r: dict) -> str:
    lines = [f"\n{variant}: {r['steps']['prefill']} prefill steps, {r['steps']['decode']} decode steps, "
             f"{r['generated_tokens'] / r['wall_s']:.2f} gen tok/s, wall {r['wall_s']:.1f} s, "
             f"generated tokens sha1 {r['tokens_sha1'][:12]}",
             "| part | prefill ms/step | share | decode ms/step | share |", "|---|---|---|---|---|"]
    sec = r["seconds"]
    model, total = "model outside attention", "engine step (total)"
    inner = sorted({x for k in sec for x in sec[k]} - {model, total}, key=lambda x: -sum(sec[k].get(x, 0) for k in sec))
    rows = {}
    for k in ("prefill", "decode"):
        v = dict(sec[k])
        v["attention (all)"] = sum(v.get(x, 0) for x in inner)
        v["engine outside the model"] = v.get(total, 0) - v.get(model, 0) - v["attention (all)"]
        rows[k] = (v, max(1, r["steps"][k]), v.get(total, 0) or 1)
    for label in [total, "engine outside the model", model, "attention (all)", *inner]:
        cells = []
        for k in ("prefill", "decode"):
            v, n, t = rows[k]
            s = v.get(label, 0.0)
            cells += [f"{1e3 * s / n:.2f}", f"{100 * s / t:.1f}%"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["bf16", "kivi"], choices=["bf16", "kivi"])
    ap.add_argument("--kivi", default='{"k_bits": 2, "v_bits": 2}', help="the plugin's KiviConfig fields (JSON)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[1024, 2048], metavar=("MIN", "MAX"))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=16384,
                    help="vLLM's max_num_batched_tokens (default: every prompt one exact prefill)")
    ap.add_argument("--budget", type=int, default=512 * 2**20, help="KV cache bytes (default holds every request)")
    ap.add_argument("--json", help="write every variant's seconds here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    report = {"command": " ".join(sys.argv), "load_before": os.getloadavg(), "variants": {}}
    for variant in args.variants:
        job = dict(kivi=None if variant == "bf16" else json.loads(args.kivi), requests=args.requests,
                   prompt_range=args.prompt_range, new_tokens=args.new_tokens, budget=args.budget,
                   max_batch_tokens=args.max_batch_tokens)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)], env=env,
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"variant {variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        r = json.loads(lines[-1][7:])
        report["variants"][variant] = r
        print(table(variant, r), flush=True)
    report["load_after"] = os.getloadavg()
    print(f"\nload average before / after: {report['load_before']} / {report['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
