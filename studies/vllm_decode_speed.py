"""Decode speed of vLLM with kivi's plugin: generated tokens per second at 1 and 4 sequences.

Each variant runs in its own engine process (the same prompts, greedy, ``ignore_eos``): ``bf16`` (vLLM
without the plugin), ``kivi`` (the plugin from this checkout) and, with ``--before-src DIR``, ``before``
(the plugin from an older kivi tree, e.g. ``git archive <commit> kivi | tar -x -C DIR``: the per-request
decode path). Decode rate = ``batch * (max_tokens - 1) / (t(max_tokens) - t(1))``: two timed
``generate`` calls of the same prompts, so the prefill and the first token cancel; each the fastest of
``--repeats``. Every variant is warmed up once; prefix caching is off. Run with .venv-vllm; prints one JSON
line per variant and batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(job: dict) -> None:
    from vllm import LLM, SamplingParams

    from kivi.data import load_text, token_windows
    from kivi.models import converted_cache_path

    path = str(converted_cache_path("smollm2"))
    extra = {} if job["kivi"] is None else {"additional_config": {"kivi": job["kivi"]}}
    # no prefix caching: the timed calls repeat the same prompts (and the plugin's window ring cannot take a
    # prefix hit: docs/vllm.md)
    llm = LLM(path, dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=2048, enable_prefix_caching=False,
              **extra)
    tok = llm.get_tokenizer()
    ids = token_windows(tok, load_text(), job["prompt"], max(job["batches"])).tolist()

    def timed(batch: int, max_tokens: int) -> float:
        """The fastest of ``repeats`` calls (the box is shared: the minimum is the least disturbed)."""
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        best = float("inf")
        for _ in range(job["repeats"]):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": x} for x in ids[:batch]], p, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        return best

    timed(1, 8)  # warm-up (numba's kernels load from their cache on first use)
    import kivi

    for batch in job["batches"]:
        t1, tn = timed(batch, 1), timed(batch, job["max_tokens"])
        rate = batch * (job["max_tokens"] - 1) / (tn - t1)
        print("RESULT " + json.dumps({"variant": job["variant"], "batch": batch, "prompt": job["prompt"],
                                      "max_tokens": job["max_tokens"], "decode_tok_s": round(rate, 2),
                                      "t_first": round(t1, 3), "t_all": round(tn, 3), "kivi_src": kivi.__file__}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kivi", default='{"preset": "extreme"}', help="the plugin's KiviConfig fields as JSON")
    ap.add_argument("--before-src", help="folder holding an older kivi package (the 'before' variant)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--max-tokens", type=int, default=65)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per point (the fastest is kept)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    variants = [("bf16", None, here), ("kivi", json.loads(args.kivi), here)]
    if args.before_src:
        variants.insert(1, ("before", json.loads(args.kivi), os.path.abspath(args.before_src)))
    for name, kivi, src in variants:
        job = dict(variant=name, kivi=kivi, prompt=args.prompt, max_tokens=args.max_tokens, repeats=args.repeats,
                   batches=[int(b) for b in args.batches.split(",")])
        env = dict(os.environ, PYTHONPATH=src, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)], env=env,
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{name} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        for ln in lines:
            print(ln[len("RESULT "):], flush=True)


if __name__ == "__main__":
    main()
