"""Where the time of a continuous-batching step with KIVI pages goes: decode steps and mixed prefill + decode steps.

Runs ``kivi.batching.generate_batch`` on ``--requests`` WikiText-2 prompts of ``--prompt-len`` tokens (room for all
of them in the budget) and times, per step, the pieces below with wall-clock timers wrapped around library
functions (inclusive times; a piece's children are indented under it). The step kind is read from the batch the
cache ran: ``decode`` (every request one query token) or ``mixed`` (some request prefills a chunk). Then one-request
``quantize_model`` + ``generate()`` for the per-token comparison. Timers that name a function the library does not
have (another version) are skipped. The box may be shared: compare shares of a step, not absolute times.

    PYTHONPATH=$PWD python benchmarks/profile_serving.py --model smollm2 --requests 8 --prompt-len 512 \\
        --new-tokens 32 --threads 2 [--cprofile 25] [--out results/serving/profile_serving.json]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import inspect
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# KIVI_ROOT=<checkout>: profile that checkout's kivi (e.g. the main branch, for a before/after comparison)
sys.path.insert(0, os.environ.get("KIVI_ROOT", str(Path(__file__).resolve().parent.parent)))

from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor  # noqa: E402

import kivi.attention.fused_cpu.dispatch as dispatch  # noqa: E402
import kivi.batching.attention as battn  # noqa: E402
import kivi.batching.cache as bcache  # noqa: E402
from kivi import KiviConfig, dequantize_model, load_model, quantize_model  # noqa: E402
from kivi.batching import build_layout, generate_batch  # noqa: E402
from kivi.batching.manager import KiviBatchingManager  # noqa: E402
from kivi.data import load_text, token_windows  # noqa: E402

# (label, owner, attribute, depth): what is timed, in the order printed; depth = indentation under its parent
TIMED = [
    ("scheduler + batch assembly (prepare_next_batch)", ContinuousBatchProcessor, "prepare_next_batch", 0),
    ("forward + sampling (_generation_step)", ContinuousBatchProcessor, "_generation_step", 0),
    ("cache.update (all layers)", bcache.KiviPagedCache, "update", 1),
    ("batch decode inputs (block table, windows)", bcache.KiviPagedCache, "_decode_batch", 2),
    ("per-request page views (page_store)", bcache, "page_store", 2),
    ("per-query boundary (chunks)", bcache.KiviPagedCache, "_set_boundary", 2),
    ("quantize tokens leaving windows", bcache, "_quantize", 2),
    ("write pages (scatter_tokens)", bcache, "scatter_tokens", 2),
    ("attention (kivi_paged, all layers)", battn, "paged_attention_forward", 1),
    ("batched decode kernel call", battn, "paged_decode_attention", 2),
    ("full-precision prefill (SDPA)", battn, "fp_attention", 2),
    ("per-request backend (run_backend)", battn, "run_backend", 2),
    ("descriptor tables (side_table)", dispatch, "side_table", 3),
    ("linear layers (nn.Linear)", None, "linear", 1),
    ("update_batch (tokens to requests)", ContinuousBatchProcessor, "update_batch", 0),
]
KERNEL_ENTRIES = ("decode_serial", "decode_threaded", "paged_decode_serial", "paged_decode_threaded",
                  "paged_ring_decode_serial", "paged_ring_decode_threaded")


class TokenTimes:
    """A ``generate()`` streamer that records when the prompt (first ``put``) and each new token arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class StepTimers:
    """Seconds per label for each step; ``steps`` = ``[(kind, requests, {label: s})]`` once a step's update ends."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[str, int, dict[str, float]]] = []
        self.kind = ("?", 0)

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[label] += time.perf_counter() - t0
        return timed


def install(timers: StepTimers, model) -> None:
    """Wrap the library functions of :data:`TIMED` (test-free: only this process's benchmark run)."""
    from transformers import AttentionInterface

    for label, owner, attr, _ in TIMED:
        if owner is None or not hasattr(owner, attr):
            continue
        wrapped = timers.wrap(label, getattr(owner, attr))
        static = isinstance(inspect.getattr_static(owner, attr), staticmethod)
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)
        if attr == "paged_attention_forward":  # transformers calls the registered function object
            AttentionInterface.register(battn.PAGED_ATTN_IMPLEMENTATION, wrapped)
    kernel = dispatch._kernel()
    for name in KERNEL_ENTRIES:
        if hasattr(kernel, name):
            setattr(kernel, name, timers.wrap("numba kernel", getattr(kernel, name)))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, a: setattr(mod, "_t0", time.perf_counter()))
            m.register_forward_hook(
                lambda mod, a, o: timers.current.__setitem__(
                    "linear layers (nn.Linear)",
                    timers.current["linear layers (nn.Linear)"] + time.perf_counter() - mod._t0,
                )
            )
    step, update = ContinuousBatchProcessor._generation_step, ContinuousBatchProcessor.update_batch

    def step_and_kind(self, model):
        out = step(self, model)
        batch = getattr(self.cache, "_batch", [])
        timers.kind = ("decode" if batch and all(q == 1 for _, _, q in batch) else "mixed", len(batch))
        return out

    def update_and_record(self):
        out = update(self)
        timers.steps.append((*timers.kind, dict(timers.current)))
        timers.current = defaultdict(float)
        return out

    ContinuousBatchProcessor._generation_step = step_and_kind
    ContinuousBatchProcessor.update_batch = update_and_record


def summarize(steps, kind: str, skip: int, requests: int | None = None) -> dict | None:
    """Mean seconds per label over the steps of ``kind`` (of ``requests`` requests when given; the first ``skip``
    of them dropped: warm-up)."""
    rows = [(n, t) for k, n, t in steps if k == kind and requests in (None, n)][skip:]
    if not rows:
        return None
    labels = [lab for lab, *_ in TIMED] + ["numba kernel"]
    mean = {lab: sum(t.get(lab, 0.0) for _, t in rows) / len(rows) for lab in labels}
    total = sum(mean[lab] for lab, _, _, depth in TIMED if depth == 0)
    return {"steps": len(rows), "requests": sorted({n for n, _ in rows}), "step_s": total, "mean_s": mean}


def print_summary(name: str, s: dict | None) -> None:
    if s is None:
        print(f"{name}: no such steps")
        return
    print(f"\n{name}: {s['steps']} steps of {s['requests']} requests, {s['step_s'] * 1e3:.1f} ms per step")
    depth = {lab: d for lab, _, _, d in TIMED} | {"numba kernel": 3}
    order = [lab for lab, *_ in TIMED]
    order.insert(order.index("linear layers (nn.Linear)"), "numba kernel")
    for lab in order:
        v = s["mean_s"][lab]
        if v:
            print(f"  {'  ' * depth[lab]}{lab:<52} {v * 1e3:8.1f} ms  {100 * v / s['step_s']:5.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mixed-batch-tokens", type=int, default=1024,
                    help="max_batch_tokens of the second run (below requests x prompt: mixed steps occur)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cprofile", type=int, default=0, help="print this many functions of cProfile (the engine's thread)"
    )
    ap.add_argument("--skip-single", action="store_true", help="no one-request generate() comparison")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    prompts = token_windows(tok, load_text(), args.prompt_len, args.requests).tolist()
    cfg = KiviConfig()
    layout = build_layout(model.config, cfg, 256, model.dtype)
    budget = layout.request_blocks(args.prompt_len + args.new_tokens) * args.requests * layout.block_bytes
    timers = StepTimers()
    install(timers, model)
    prof = cProfile.Profile() if args.cprofile else None
    if prof is not None:
        loop = KiviBatchingManager._run_generation_loop

        def profiled(self, *a, **kw):
            prof.enable()
            try:
                return loop(self, *a, **kw)
            finally:
                prof.disable()
        KiviBatchingManager._run_generation_loop = profiled
    # run 1: every prompt prefilled in one step, then decode steps of all requests
    t0 = time.perf_counter()
    out = generate_batch(model, prompts, cfg, cache_memory=budget, max_new_tokens=args.new_tokens,
                         max_batch_tokens=args.requests * args.prompt_len)
    wall = time.perf_counter() - t0
    decode_steps, timers.steps = timers.steps, []
    # run 2: a smaller token budget per step, so prompts are prefilled while other requests decode
    generate_batch(model, prompts, cfg, cache_memory=budget, max_new_tokens=4, max_batch_tokens=args.mixed_batch_tokens)
    report = {
        "args": vars(args),
        "batch_wall_s": wall,
        "generated_tokens": sum(len(r.generated_tokens) for r in out.values()),
        "decode": summarize(decode_steps, "decode", 2, args.requests),
        "mixed": summarize(timers.steps, "mixed", 1),
        "mixed_step_kinds": sorted({(k, n) for k, n, _ in timers.steps}),
    }
    print(f"generate_batch: {wall:.1f} s for {report['generated_tokens']} generated tokens")
    print_summary(f"decode steps of all {args.requests} requests", report["decode"])
    print_summary("mixed prefill + decode steps (the first, a prefill only, dropped)", report["mixed"])
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    if not args.skip_single:
        quantize_model(model, cfg)
        try:
            ids = torch.tensor([prompts[0]])
            model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up (kernel load, allocations)
            stamps = TokenTimes()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           streamer=stamps)
        finally:
            dequantize_model(model)
        gaps = sorted(b - a for a, b in zip(stamps.times[1:], stamps.times[2:]))  # decode steps (after the prefill)
        per_token = gaps[len(gaps) // 2]
        report["single_generate"] = {"prefill_s": stamps.times[1] - stamps.times[0], "decode_s_per_token": per_token}
        if report["decode"]:
            batch_per_token = report["decode"]["step_s"] / max(report["decode"]["requests"])
            report["single_generate"]["batch_decode_s_per_token"] = batch_per_token
            print(
                f"\none-request generate(): prefill {report['single_generate']['prefill_s']:.2f} s, "
                f"decode {per_token * 1e3:.1f} ms/token (median); "
                f"batched decode step: {batch_per_token * 1e3:.1f} ms per request-token "
                f"({per_token / batch_per_token:.2f}x)"
            )
    if args.out:
        from kivi.files import write_text

        write_text(args.out, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
