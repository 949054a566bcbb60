#!/usr/bin/env python
"""Peak process memory of a long generation vs the cache it leaves behind (Linux).

The budget checked: during an 8K-token generation, peak process memory stays within the model plus
1.15x the steady-state cache plus one storage block's transient. For each configuration this runs
one **fresh child process** (so no allocator state leaks between configurations):

1. load SmolLM2 (float32), run a 64-token warm-up generation (first-call allocations), free it;
2. reset the kernel's peak-RSS watermark (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) and read
   ``VmRSS`` = the baseline (model + interpreter);
3. chunked prefill of ``--context`` random tokens (``kivi.attention.chunked_prefill``, chunks of
   ``--chunk``), then ``--new-tokens`` greedy decode steps;
4. read ``VmHWM`` (peak RSS since the reset) and the cache's exact tensor bytes (``nbytes``).

Reported: ``peak_delta`` = VmHWM - baseline (what the generation added at its worst moment);
``cache`` = the steady-state cache bytes at the end; ``block`` = one storage block's transient
(``block_size`` tokens of every layer, both sides, at the model's precision: an upper bound on what
one block append allocates); ``chunk_activations`` = RSS growth of one forward of ``--chunk``
tokens without any cache, measured in the same child. Check:
``peak_delta <= 1.15 * cache + block + chunk_activations`` (the budget has no term of its own for
prefill activations; with chunked prefill they are those of one chunk, so they are counted).

    python benchmarks/peak_memory.py --context 8192 --new-tokens 16 --configs fp,extreme,high \
        --out results/memory/peak_memory_8k.json

``--path generate`` measures ``model.generate()`` as a user calls it instead (a 2-D attention mask of
ones, greedy, ``--new-tokens`` tokens, the cache generate builds: DynamicCache for ``fp``, the
KiviCache of ``quantize_model`` otherwise), with generate's prefill in chunks of ``--chunk`` tokens
(``generation_config.prefill_chunk_size``; ``--chunk 0``: one shot, transformers' default).
``prefill_seconds`` is the time to the first new token (generate) or of ``chunked_prefill``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from common import proc_status_bytes, run_fresh, set_threads, write_json


def _status(field: str) -> int:
    n = proc_status_bytes(field)
    if n is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return n


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(args: argparse.Namespace) -> dict:
    from kivi import KiviConfig, quantize_model
    from kivi.attention import chunked_prefill
    from kivi.eval import cache_nbytes, make_cache
    from kivi.malloc_pin import reduce_fragmentation
    from kivi.models import load_model

    reduce_fragmentation()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    cfg = None if args.config == "fp" else KiviConfig.preset(args.config, attention_backend=args.backend)
    if cfg is not None:
        quantize_model(model, cfg)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=g)

    if args.path == "generate":
        # generate()'s own prefill: one shot (prefill_chunk_size None, transformers' default) or in
        # chunks of --chunk tokens (what quantize_model sets by default for KIVI models).
        model.generation_config.prefill_chunk_size = args.chunk if args.chunk else None
    prefill_seconds = []

    class _FirstToken:
        """generate() streamer: the time at which the first new token arrives (the prefill's end)."""

        def __init__(self):
            self.calls, self.t0 = 0, time.perf_counter()

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                prefill_seconds.append(time.perf_counter() - self.t0)

        def end(self):
            pass

    def run(n_ctx: int, n_new: int):
        if args.path == "generate":
            x = ids[:, :n_ctx]
            with torch.no_grad():
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new,
                                     do_sample=False, return_dict_in_generate=True, streamer=_FirstToken(),
                                     pad_token_id=0)
            return out.cache
        cache = make_cache(model, cfg)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = chunked_prefill(model, ids[:, :n_ctx], cache, chunk_size=args.chunk)
            prefill_seconds.append(time.perf_counter() - t0)
            for _ in range(n_new):
                nxt = logits.argmax(-1, keepdim=True)
                logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
        return cache

    # warm-up: first-call allocations (numba compilation, thread pools) do not count
    c = run(min(args.context, 2 * (args.chunk or 512)), 4)
    del c
    gc.collect()
    set_threads(args.threads)  # loading the numba kernels can reset torch's thread count to numba's
    # activations of one chunk forward without any cache (what a prefill chunk costs beyond the cache)
    _reset_peak()
    base0 = _status("VmRSS")
    n_chunk = args.chunk or args.context  # one-shot prefill: the chunk is the whole prompt
    with torch.no_grad():
        model(input_ids=ids[:, :n_chunk], attention_mask=torch.ones_like(ids[:, :n_chunk]), use_cache=False,
              logits_to_keep=1)
    chunk_act = _status("VmHWM") - base0
    gc.collect()

    _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    cache = run(args.context, args.new_tokens)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    cache_bytes = cache_nbytes(cache)
    if cfg is None:
        block = 0
    else:
        cfg_layers = model.config.num_hidden_layers
        heads = model.config.num_key_value_heads
        head_dim = (getattr(model.config, "head_dim", None)
                    or model.config.hidden_size // model.config.num_attention_heads)
        block = 2 * cfg_layers * args.batch * heads * head_dim * cfg.block_size * torch.finfo(model.dtype).bits // 8
    return {
        "config": args.config,
        "description": "DynamicCache (fp)" if cfg is None else cfg.describe(),
        "attention_backend": None if cfg is None else model.kivi_attention_backend,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "path": args.path,
        "chunk": args.chunk,
        "prefill_seconds": round(prefill_seconds[-1], 2),
        "baseline_rss": base,
        "peak_rss": peak,
        "peak_delta": peak - base,
        "cache_bytes": cache_bytes,
        "block_transient_bytes": block,
        "chunk_activation_bytes": chunk_act,
        "budget_bytes": int(1.15 * cache_bytes + block + chunk_act),
        "within_budget": bool(peak - base <= 1.15 * cache_bytes + block + chunk_act),
        "peak_over_cache": round((peak - base) / cache_bytes, 3),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (0 with --path generate: one-shot prefill)")
    ap.add_argument("--path", choices=["chunked", "generate"], default="chunked",
                    help="chunked: kivi.attention.chunked_prefill + decode loop; generate: model.generate() as a "
                         "user calls it (its prefill_chunk_size set from --chunk)")
    ap.add_argument("--configs", default="fp,extreme,high", help="fp and/or KIVI preset names, comma-separated")
    ap.add_argument("--backend", default="auto", help="KIVI attention backend")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        ap.error("needs Linux /proc/self/clear_refs to reset the peak-RSS watermark")
    if a.child:
        print(json.dumps(child(a)))
        return 0
    rows = []
    for name in [c.strip() for c in a.configs.split(",") if c.strip()]:
        res = run_fresh([os.path.abspath(__file__), "--child", "--config", name, "--model", a.model,
                         "--context", str(a.context), "--new-tokens", str(a.new_tokens), "--batch", str(a.batch),
                         "--chunk", str(a.chunk), "--backend", a.backend, "--threads", str(a.threads),
                         "--path", a.path])
        if res.returncode or res.result is None:
            print(res.stderr, file=sys.stderr)
            return res.returncode or 1
        row = res.result
        rows.append(row)
        mib = lambda b: b / 2**20  # noqa: E731
        print(f"{row['description']:28s} peak +{mib(row['peak_delta']):8.1f} MiB  "
              f"cache {mib(row['cache_bytes']):8.1f} MiB  budget {mib(row['budget_bytes']):8.1f} MiB  "
              f"within: {row['within_budget']}  prefill {row['prefill_seconds']} s "
              f"({row['seconds']} s)",
              file=sys.stderr, flush=True)
    out = {"command": " ".join(sys.argv), "torch": torch.__version__, "rows": rows}
    if a.out:
        write_json(a.out, out)
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
