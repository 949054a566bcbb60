"""Serving throughput under one fixed cache budget: transformers' continuous batching with its float paged
cache vs KIVI pages (2/2 and ``balanced``), in the same run.

Every row gets the same byte budget (``--cache-memory``, or by default what the float cache needs to hold
``--fp-requests`` requests at once) and the same requests, all submitted at once: ``--requests`` prompts of
``--prompt-len`` tokens (independent, or ``--shared-prefix F``: the first ``F`` of every prompt is one
common prefix) and ``--new-tokens`` greedy tokens each (no EOS). Columns: requests held at once (the most
active requests the scheduler held, sampled every 20 ms), the budget's computed capacity, total tokens/s
(prompt + generated over the wall time, and generated only), p50/p95 time to first token, p50/p95
per-token latency (a request's decode time / its tokens after the first), the largest dequantized
transient of one layer (KIVI rows), prompt tokens served from shared pages.

The capacity table at 4K tokens (``--capacity-at``) is computed from page sizes for float16 pages and the
KIVI configs (``PageLayout.requests_that_fit``).

    OMP_NUM_THREADS=1 python benchmarks/bench_serving.py --model smollm2 --requests 16 --prompt-len 1024 \\
        --new-tokens 64 --fp-requests 4 --threads 1 --out results/serving/serving_smollm2.json
    # full size (not run on the 2-core CI box):
    python benchmarks/bench_serving.py --model smollm2 --requests 16 --prompt-len 4096 --new-tokens 256 --fp-requests 4
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import GenerationConfig  # noqa: E402

from common import write_json  # noqa: E402
from kivi import KiviConfig  # noqa: E402
from kivi.batching import build_layout, fp_block_bytes, generate_batch, init_continuous_batching  # noqa: E402

ROWS = {"float": None, "kivi-2/2": KiviConfig(k_bits=2, v_bits=2), "balanced": KiviConfig.preset("balanced"),
        # the materialized path: pages dequantized one layer at a time, transformers' SDPA (not run by default)
        "kivi-2/2-sdpa": KiviConfig(k_bits=2, v_bits=2, attention_backend="reference")}
DEFAULT_ROWS = ["float", "kivi-2/2", "balanced"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def make_prompts(n: int, length: int, shared: float, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(100, vocab - 1, (int(length * shared),), generator=g).tolist()
    return [common + torch.randint(100, vocab - 1, (length - len(common),), generator=g).tolist() for _ in range(n)]


def run_row(model, cfg, prompts, new_tokens, cache_memory, cb_kwargs) -> dict:
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    manager = init_continuous_batching(model, cfg, cache_memory=cache_memory, generation_config=gen, **cb_kwargs)
    for p in prompts:
        manager.check_request_fits(len(p), new_tokens)
    held, results = 0, {}
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = manager.add_requests(inputs=prompts, max_new_tokens=new_tokens, record_timestamps=True)
        while len(results) < len(ids):
            out = manager.get_result(timeout=0.02)
            bp = manager.batch_processor
            if bp is not None:
                held = max(held, len(bp.scheduler.active_requests))
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("the continuous-batching loop stopped")
        wall = time.perf_counter() - t0
        cache = manager.batch_processor.cache
        transient = getattr(cache, "max_dequantized_bytes", None)
        shared = getattr(cache, "shared_tokens", None)
        blocks = cache.num_blocks
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    ttft = [r.timestamps[0] - t0 for r in results.values()]
    tpot = [(r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1) for r in results.values()
            if len(r.timestamps) > 1]
    gen_tokens = sum(len(r.generated_tokens) for r in results.values())
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "requests_held_at_once": held,
        "capacity_requests": blocks // manager.request_blocks(len(prompts[0]) + new_tokens),
        "cache_blocks": blocks, "block_bytes": manager.block_bytes,
        "wall_s": wall, "total_tokens_per_s": (prompt_tokens + gen_tokens) / wall,
        "generated_tokens_per_s": gen_tokens / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
        "per_token_p50_s": _pct(tpot, 0.5), "per_token_p95_s": _pct(tpot, 0.95),
        "dequantized_transient_bytes": transient, "shared_prompt_tokens": shared,
        "tokens": {rid: r.generated_tokens for rid, r in results.items()},
    }


def check_single(model, prompts, new_tokens, rows, tokens) -> dict:
    """Greedy tokens of the batch engine vs ``quantize_model`` + one ``generate()`` per request, same config."""
    from kivi import dequantize_model, quantize_model

    out = {}
    for name in rows:
        quantize_model(model, ROWS[name])
        try:
            same, first_diff = 0, []
            for i, p in enumerate(prompts):
                ref = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=None)[0, len(p):].tolist()
                got = tokens[name][f"req_{i}"]
                same += got == ref
                first_diff.append(next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None))
        finally:
            dequantize_model(model)
        out[name] = {"requests": len(prompts), "identical": same, "first_differing_token": first_diff}
        print(f"{name}: {same}/{len(prompts)} requests token-identical to one-request generate()", flush=True)
    return out


def capacity_table(model_config, at: int, budget: int, page: int) -> dict:
    fp16 = (budget // fp_block_bytes(model_config, torch.float16, page)) // -(-at // page)
    out = {"float16": fp16}
    for name, cfg in ROWS.items():
        if cfg is not None:
            out[name] = build_layout(model_config, cfg, page, torch.float16).requests_that_fit(budget, at)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (embedded GGUF) or 'tiny' (random, for a smoke run)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--fp-requests", type=int, default=4,
                    help="budget = bytes the float cache needs to hold this many requests at once")
    ap.add_argument("--cache-memory", type=int, default=None, help="budget in bytes (overrides --fp-requests)")
    ap.add_argument("--shared-prefix", type=float, nargs="+", default=[0.0, 0.75],
                    help="fractions of every prompt that are one common prefix; one variant each")
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    ap.add_argument("--check-single", type=int, default=2,
                    help="compare the first N requests of every KIVI row with one-request generate() (same config)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--capacity-at", type=int, default=4096)
    ap.add_argument("--capacity-budget", type=int, default=4 * 1024**3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON here (and a .txt table beside it)")
    args = ap.parse_args(argv)
    for name in ("requests", "prompt_len", "new_tokens", "fp_requests", "page_size", "max_batch_tokens", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if any(not 0 <= f < 1 for f in args.shared_prefix):
        ap.error(f"--shared-prefix={args.shared_prefix} must be fractions in [0, 1)")
    torch.set_num_threads(args.threads)

    if args.model == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.helpers import tiny_model

        model, vocab = tiny_model(num_hidden_layers=4), 128
    else:
        from kivi.models import load_model

        model, tok = load_model(args.model)
        vocab = model.config.vocab_size
    text = model.config.get_text_config()
    total = args.prompt_len + args.new_tokens
    budget = args.cache_memory or args.fp_requests * -(-total // args.page_size) * fp_block_bytes(
        text, model.dtype, args.page_size)
    cb = dict(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens)
    # warm-up: compile kivi's numba kernels, then one full-length request per row (first-call overheads)
    from kivi.attention.fused_cpu import warmup as warm_attention
    from kivi.quant.fused_cpu import warmup as warm_quant

    warm_quant()
    warm_attention()
    for cfg in (ROWS[r] for r in args.rows):
        generate_batch(model, [[101] * args.prompt_len], cfg, cache_memory=budget, max_new_tokens=3, **cb)

    report = {"command": " ".join(sys.argv), "model": args.model, "dtype": str(model.dtype),
              "threads": args.threads, "budget_bytes": budget, "requests": args.requests,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "page_size": args.page_size,
              "max_batch_tokens": args.max_batch_tokens, "machine": platform.processor() or platform.machine(),
              "capacity": {"tokens_per_request": args.capacity_at, "budget_bytes": args.capacity_budget,
                           "requests_that_fit": capacity_table(text, args.capacity_at, args.capacity_budget,
                                                               args.page_size)},
              "variants": {}}
    for shared in args.shared_prefix:
        prompts = make_prompts(args.requests, args.prompt_len, shared, vocab, args.seed)
        rows = {}
        for name in args.rows:
            rows[name] = run_row(model, ROWS[name], prompts, args.new_tokens, budget, cb)
            r = rows[name]
            print(f"shared={shared:.2f} {name:9s} held {r['requests_held_at_once']:3d} "
                  f"(fits {r['capacity_requests']:3d})  {r['total_tokens_per_s']:8.1f} tok/s  "
                  f"ttft p50 {r['ttft_p50_s']:7.2f}s p95 {r['ttft_p95_s']:7.2f}s"
                  f"  per-token p50 {r['per_token_p50_s'] * 1e3:7.1f} ms", flush=True)
        base = rows.get("float")
        tokens = {name: r["tokens"] for name, r in rows.items()}
        for name, r in rows.items():
            toks = r.pop("tokens")
            if base is not None and name != "float":
                ref = base.get("_tokens") or {}
                r["greedy_tokens_equal_float"] = sum(toks[k] == ref.get(k) for k in toks)
            if name == "float":
                r["_tokens"] = toks
        for r in rows.values():
            r.pop("_tokens", None)
        report["variants"][f"shared_prefix_{shared:.2f}"] = rows
        if args.check_single and shared == args.shared_prefix[0]:
            report["single_request_agreement"] = check_single(model, prompts[: args.check_single], args.new_tokens,
                                                              [r for r in args.rows if ROWS[r] is not None], tokens)
    text_out = format_table(report)
    print(text_out)
    if args.out:
        write_json(args.out, report)
        Path(args.out).with_suffix(".txt").write_text(text_out + "\n")
    return 0


def format_table(report: dict) -> str:
    lines = [f"# {report['command']}",
             f"# model {report['model']} ({report['dtype']}), {report['requests']} requests x {report['prompt_len']} "
             f"prompt + {report['new_tokens']} new tokens, budget {report['budget_bytes'] / 2**20:.1f} MiB, "
             f"page {report['page_size']}, max_batch_tokens {report['max_batch_tokens']}, "
             f"{report['threads']} thread(s)"]
    hdr = (f"{'variant':18s} {'cache':9s} {'held':>4s} {'fits':>4s} {'tok/s':>8s} {'gen tok/s':>9s} {'TTFT p50':>9s} "
           f"{'TTFT p95':>9s} {'tok p50':>8s} {'tok p95':>8s} {'transient':>10s} {'shared':>6s}")
    lines.append(hdr)
    for vname, rows in report["variants"].items():
        for name, r in rows.items():
            tr = r["dequantized_transient_bytes"]
            lines.append(
                f"{vname:18s} {name:9s} {r['requests_held_at_once']:4d} {r['capacity_requests']:4d} "
                f"{r['total_tokens_per_s']:8.1f} {r['generated_tokens_per_s']:9.2f} {r['ttft_p50_s']:8.2f}s "
                f"{r['ttft_p95_s']:8.2f}s {r['per_token_p50_s'] * 1e3:6.0f}ms {r['per_token_p95_s'] * 1e3:6.0f}ms "
                f"{'-' if tr is None else f'{tr / 2**20:8.1f}Mi':>10s} {r['shared_prompt_tokens'] or 0:6d}")
    for name, a in report.get("single_request_agreement", {}).items():
        lines.append(f"greedy tokens vs one-request generate() with the same config ({name}): {a['identical']}/"
                     f"{a['requests']} requests identical (first differing token: {a['first_differing_token']})")
    cap = report["capacity"]
    lines.append(f"computed: requests of {cap['tokens_per_request']} tokens held at once in "
                 f"{cap['budget_bytes'] / 2**30:.1f} GiB (fp16 model, from page sizes): "
                 + ", ".join(f"{k} {v}" for k, v in cap["requests_that_fit"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
