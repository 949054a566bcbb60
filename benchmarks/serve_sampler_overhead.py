"""What kivi serve's per-request sampler costs: transformers' continuous batching with plain greedy
(argmax, no logits processors) against the server's sampler (temperature + top-k + top-p processors,
greedy as top_k=1), same requests, float paged cache, alternating rounds in one process.

    python benchmarks/serve_sampler_overhead.py --requests 8 --prompt-tokens 128 --new-tokens 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig


def run_round(model, prompts, new_tokens, *, server_sampler: bool) -> tuple[float, list[list[int]]]:
    from kivi.serving.engine import _PROCESSOR_DEFAULTS, Sampling

    if server_sampler:
        gen = GenerationConfig(do_sample=True, eos_token_id=-1, max_new_tokens=new_tokens, **_PROCESSOR_DEFAULTS)
        kwargs = Sampling(new_tokens).processor_kwargs()
    else:
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=new_tokens)
        kwargs = {}
    cb = ContinuousBatchingConfig(max_batch_tokens=512, per_request_processors=server_sampler, num_blocks=8)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=new_tokens, **kwargs)
        out = {}
        while len(out) < len(prompts):
            r = manager.get_result(timeout=300)
            if r is None:
                raise RuntimeError("no result within 300 s")
            out[r.request_id] = r.generated_tokens
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
    return elapsed, [out[f"r{i}"] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kivi.models import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]
    run_round(model, prompts[:2], 4, server_sampler=True)  # warm up both paths
    run_round(model, prompts[:2], 4, server_sampler=False)
    times = {"argmax": [], "server_sampler": []}
    tokens = {}
    for _ in range(args.rounds):
        for name in ("argmax", "server_sampler"):
            t, toks = run_round(model, prompts, args.new_tokens, server_sampler=name == "server_sampler")
            times[name].append(t)
            tokens[name] = toks
    result = {
        "model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "threads": args.threads, "rounds": args.rounds,
        "seconds": times, "best_seconds": {k: min(v) for k, v in times.items()},
        "overhead_ratio": min(times["server_sampler"]) / min(times["argmax"]),
        "same_tokens": tokens["argmax"] == tokens["server_sampler"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
