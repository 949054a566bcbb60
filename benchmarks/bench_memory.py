#!/usr/bin/env python
"""Memory: what a process and a cache hold, one subcommand per measurement.

    peak       peak RSS of a long generation against the cache it leaves behind (Linux)
    reachable  tensor bytes reachable from a KiviCache against ``cache.nbytes``
    weights    weights + KV cache for weight widths x caches, planned and measured
    soak       a long generation's RSS against ``cache.nbytes``; threads x numba threading layers

``python benchmarks/bench_memory.py SUBCOMMAND --help`` describes each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from common import ROOT, proc_status_bytes, run_fresh, set_threads, write_json, write_text_file

PEAK_DOC = """Peak process memory of a long generation vs the cache it leaves behind (Linux).

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

    python benchmarks/bench_memory.py peak --context 8192 --new-tokens 16 --configs fp,extreme,high \
        --out results/memory/peak_memory_8k.json

``--path generate`` measures ``model.generate()`` as a user calls it instead (a 2-D attention mask of
ones, greedy, ``--new-tokens`` tokens, the cache generate builds: DynamicCache for ``fp``, the
KiviCache of ``quantize_model`` otherwise), with generate's prefill in chunks of ``--chunk`` tokens
(``generation_config.prefill_chunk_size``; ``--chunk 0``: one shot, transformers' default).
``prefill_seconds`` is the time to the first new token (generate) or of ``chunked_prefill``.
"""

REACHABLE_DOC = """What a KiviCache keeps alive vs what it reports: reachable tensor bytes against ``cache.nbytes``.

For each configuration: prefill ``--context`` random tokens through a quantized model (the
default ``generate``-style path: ``quantize_model`` + ``KiviCache.from_model``, packed attention),
then 64 decode steps, a crop of 100 tokens, a beam reorder of the batch; after each step the bytes
of every tensor storage reachable from the cache object (``kivi.eval.reachable_tensor_bytes``) are
compared with ``cache.nbytes``. Models: the embedded SmolLM2 (full attention), and a random
Mistral of SmolLM2's attention shape with ``sliding_window=1024`` (sliding-window eviction).

    python benchmarks/bench_memory.py reachable --context 4096 --out results/memory/reachable_bytes_4k.json
"""

WEIGHTS_DOC = """Total memory of weights + KV cache for weight widths x caches: planned, and measured where it is cheap.

For every ``--weight-bits`` width the model is loaded and quantized (``kivi.models.quantize_weights``) and
its real tensor bytes are measured (``kivi.models.weight_bytes``: the storages of its ``state_dict``, quanto's
codes and scales included) next to the planner's ``estimate_kv_memory(..., weight_bits=b).weights_bytes``.
The cache at ``--context`` comes from the planner (byte-exact against ``KiviCache.nbytes``, tests/test_memory.py);
with ``--measure-prefill N`` every (width, cache) pair also runs a real prefill of N tokens of WikiText-2 and
records the cache's bytes (``kivi.eval.cache_nbytes``) next to the planner's at N.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py weights --context 8192 --measure-prefill 1024 \\
        --threads 1 --out results/weights/weights_memory_8k.json
"""

SOAK_DOC = """Soak: a long generation's memory against the cache's bytes, and threads x numba threading layers.

**memory** — one fresh child process per model (one numba thread): a random Llama (full attention, memory grows with the
context) and a random Mistral with a sliding window (KIVI's sliding layers evict: memory plateaus),
both at KIVI 2/2 with the ``cpu`` attention backend (the fused numba kernels). Greedy decoding,
one token per forward, for ``--tokens`` tokens after a ``--prompt``-token prefill; every ``--every``
tokens it records RSS (``/proc/self/statm``) and ``cache.nbytes`` (the cache's exact tensor bytes).
Reported: ``RSS - nbytes`` after the warm-up (the first ``--warmup`` tokens): min, max, band (max -
min) and its least-squares slope in bytes per 1,000 tokens. A cache that leaks, or an allocator
that keeps freed temporaries, shows as a slope; a constant band is the model, the interpreter and
the per-step temporaries. The models are small random ones (``--hidden``, ``--layers``, ``--kv-heads``)
so that 20,000 tokens take minutes on 2 cores while the cache still grows to tens of MiB (SmolLM2
decodes ~10 tok/s here at 8K: 20,000 tokens would take over an hour).

**threads** — for numba's threading layers present (``workqueue``, ``omp``, ``tbb`` when installed)
x ``--threads`` (1 and 3): a child process with ``NUMBA_THREADING_LAYER`` set generates ``--thread-tokens``
tokens from a different prompt per thread, one ``KiviCache`` each, the model shared (prompts long
enough that the decode kernel takes numba's thread pool). Reported: the child's exit status, whether
every thread's tokens equal a sequential run of the same prompts in the same child, and tok/s of the
concurrent phase (all threads' tokens / its wall time).

    python benchmarks/bench_memory.py soak --tokens 20000 --every 500 --out results/soak/soak_memory.json \\
        --threads-out results/soak/soak_threads.json --table results/soak/soak.txt

``--skip-memory`` / ``--skip-threads`` run one part.
"""



# -------------------- peak --------------------

def _status(field: str) -> int:
    n = proc_status_bytes(field)
    if n is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return n


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_child(args: argparse.Namespace) -> dict:
    import torch

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


def peak_main(argv: list[str]) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="bench_memory.py peak", description=PEAK_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a = ap.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        ap.error("needs Linux /proc/self/clear_refs to reset the peak-RSS watermark")
    if a.child:
        print(json.dumps(peak_child(a)))
        return 0
    rows = []
    for name in [c.strip() for c in a.configs.split(",") if c.strip()]:
        res = run_fresh([os.path.abspath(__file__), "peak", "--child", "--config", name, "--model", a.model,
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


# -------------------- reachable --------------------

def reachable_measure(model, cfg, context: int, batch: int) -> list[dict]:
    import torch

    from kivi import KiviCache, quantize_model
    from kivi.eval.reachable import reachable_tensor_bytes

    quantize_model(model, cfg)
    cache = KiviCache.from_model(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    rows = []

    def row(when: str) -> None:
        reach, nb = reachable_tensor_bytes(cache), cache.nbytes
        rows.append({"when": when, "tokens": cache.get_seq_length(), "reachable_bytes": reach, "nbytes": nb,
                     "difference": reach - nb})
        print(f"  {when:24s} tokens {cache.get_seq_length():6d}  reachable {reach:12,d}  nbytes {nb:12,d}  "
              f"difference {reach - nb:+,d}", file=sys.stderr, flush=True)

    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        row(f"after {context}-token prefill")
        for _ in range(64):
            logits = model(logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
        row("after 64 decode steps")
        cache.crop(-100)  # transformers 5: a negative count of tokens to remove
        row("after crop(-100)")
        cache.reorder_cache(torch.arange(batch - 1, -1, -1))
        row("after reorder")
    return rows


def reachable_main(argv: list[str]) -> int:
    import torch
    import transformers

    from kivi import KiviConfig
    from kivi.models import load_model

    ap = argparse.ArgumentParser(prog="bench_memory.py reachable", description=REACHABLE_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    smol, _ = load_model("smollm2")
    c = smol.config
    sliding_cfg = transformers.MistralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        sliding_window=1024)
    torch.manual_seed(0)
    sliding = transformers.MistralForCausalLM(sliding_cfg).eval()
    out = {"command": " ".join(sys.argv), "context": a.context, "batch": a.batch, "rows": []}
    for label, model_fn, cfg in (
        ("SmolLM2, KIVI 2/2", lambda: smol, KiviConfig()),
        ("SmolLM2, balanced", lambda: smol, KiviConfig.preset("balanced")),
        ("Mistral (sliding 1024), KIVI 2/2", lambda: sliding, KiviConfig()),
    ):
        print(label, file=sys.stderr)
        for r in reachable_measure(model_fn(), cfg, a.context, a.batch):
            out["rows"].append({"model_config": label, **r})
    if a.out:
        write_json(a.out, out)
    else:
        print(json.dumps(out, indent=2))
    bad = [r for r in out["rows"] if r["difference"]]
    return 1 if bad else 0


# -------------------- weights --------------------

def weights_main(argv: list[str]) -> int:
    import torch

    from kivi import KiviConfig
    from kivi.data import load_text, token_windows
    from kivi.eval import cache_nbytes, make_cache
    from kivi.memory import estimate_kv_memory
    from kivi.models import load_model, quantize_weights, weight_bytes

    caches = {"fp": None, "extreme": KiviConfig.preset("extreme"), "balanced": KiviConfig.preset("balanced")}
    ap = argparse.ArgumentParser(prog="bench_memory.py weights", description=WEIGHTS_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weight-bits", default="16,8,4")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--measure-prefill", type=int, default=0, help="tokens of a real prefill per pair (0 = none)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.threads:
        set_threads(a.threads)
    rows = []
    ids = None
    for bits in (int(x) for x in a.weight_bits.split(",")):
        model, tok = quantize_weights(load_model(a.model)[0], bits), None
        if a.measure_prefill and ids is None:
            tok = load_model(a.model)[1]
            ids = token_windows(tok, load_text(), a.measure_prefill, 1)[:1]
        measured_w = weight_bytes(model)
        for name, cfg in caches.items():
            est = estimate_kv_memory(model, a.context, config=cfg or KiviConfig(), weight_bits=bits)
            cache = est.fp_total_bytes if cfg is None else est.kivi_total_bytes
            row = {"weight_bits": bits, "cache": name, "cache_config": cfg.describe() if cfg else "DynamicCache (fp)",
                   "context": a.context, "weights_bytes_planned": est.weights_bytes,
                   "weights_bytes_measured": measured_w, "weights_breakdown": est.weights_breakdown,
                   "cache_bytes_planned": cache, "total_bytes": measured_w + cache}
            if a.measure_prefill:
                t0 = time.time()
                c = make_cache(model, cfg)
                with torch.inference_mode():
                    model(input_ids=ids, cache=c, use_cache=True, logits_to_keep=1)
                short = estimate_kv_memory(model, a.measure_prefill, config=cfg or KiviConfig(), weight_bits=bits)
                row.update(prefill_tokens=a.measure_prefill, prefill_cache_bytes_measured=cache_nbytes(c),
                           prefill_cache_bytes_planned=short.fp_total_bytes if cfg is None else short.kivi_total_bytes,
                           prefill_seconds=round(time.time() - t0, 1))
                del c
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del model
    out = {"model": a.model, "command": " ".join(["python", *sys.argv]), "torch_threads": torch.get_num_threads(),
           "note": "cache bytes at --context from the planner (byte-exact vs KiviCache.nbytes in the tests); weights "
                   "measured from the loaded quantized model's tensors", "rows": rows}
    write_json(a.out, out)
    print(f"{'weights':>8s} {'cache':>9s} {'weights B':>12s} {'cache B':>12s} {'total MiB':>10s}")
    for r in rows:
        print(f"{r['weight_bits']:>8d} {r['cache']:>9s} {r['weights_bytes_measured']:>12,d} "
              f"{r['cache_bytes_planned']:>12,d} {r['total_bytes'] / 2**20:>10.1f}")
    return 0


# -------------------- soak --------------------

LAYERS = ("workqueue", "omp", "tbb")


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def rss_anon_bytes() -> int | None:
    """Anonymous resident memory (``RssAnon``: heap, tensors), or None where ``/proc`` lacks it.

    Total RSS also counts file-backed pages (torch's shared libraries), which the kernel drops and
    reloads under other processes' memory pressure: measured here, both soak runs' total RSS fell by
    212 MiB at the same moment (between two samples 500 tokens apart, their caches growing as before).
    """
    return proc_status_bytes("RssAnon")


def build_model(kind: str, args):
    """A random decoder (float32, eval) with KIVI 2/2 on the cpu backend; ``kind``: full | sliding."""
    import torch
    import transformers

    from kivi import KiviConfig, quantize_model

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=2 * args.kv_heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=args.prompt + args.tokens + 64, pad_token_id=0)
    if kind == "sliding":
        cfg = transformers.AutoConfig.for_model("mistral", sliding_window=args.sliding_window, **common)
    else:
        cfg = transformers.AutoConfig.for_model("llama", **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    kivi_cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128, attention_backend="cpu")
    return quantize_model(model, kivi_cfg)


# --------------------------------------------------------------------------- memory


def memory_child(kind: str, args) -> dict:
    import torch

    from kivi import KiviCache
    from kivi.malloc_pin import reduce_fragmentation

    reduce_fragmentation()  # as the CLI does: freed temporaries go back to the OS
    torch.set_num_threads(1)
    model = build_model(kind, args)
    cache = KiviCache.from_model(model)
    ids = torch.randint(1, 256, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(1, args.tokens + 1):
            out = model(input_ids=tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            if i % args.every == 0:
                rows.append({"tokens": i, "seq_len": cache.get_seq_length(), "rss": rss_bytes(),
                             "rss_anon": rss_anon_bytes(), "nbytes": cache.nbytes,
                             "seconds": round(time.perf_counter() - t0, 2)})
                if args.progress:  # one JSON line per sample, so a stopped run keeps what it measured
                    with open(f"{args.progress}.{kind}.jsonl", "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    return {"model": kind, "rows": rows}


def summarize(rows: list[dict], warmup: int, key: str = "rss") -> dict:
    """min / max / band and least-squares slope (bytes per 1,000 tokens) of ``key`` - nbytes after ``warmup``
    (``key``: ``"rss"`` total resident memory, ``"rss_anon"`` its anonymous part)."""
    pts = [(r["tokens"], r[key] - r["nbytes"]) for r in rows if r["tokens"] > warmup]
    if not pts:
        raise SystemExit(f"error: no sample after --warmup {warmup}; generate more --tokens or lower --warmup")
    ys = [y for _, y in pts]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return {"samples": n, "rss_minus_nbytes_min": min(ys), "rss_minus_nbytes_max": max(ys),
            "band": max(ys) - min(ys), "slope_bytes_per_1k_tokens": round(slope * 1000, 1),
            "nbytes_first": rows[0]["nbytes"], "nbytes_last": rows[-1]["nbytes"],
            "tok_per_s": round(rows[-1]["tokens"] / rows[-1]["seconds"], 1)}


# --------------------------------------------------------------------------- threads


def threads_child(args) -> dict:
    import threading

    import numba
    import torch

    torch.set_num_threads(1)
    model = build_model("full", args)
    prompts = [torch.randint(1, 256, (1, args.prompt + 13 * i), generator=torch.Generator().manual_seed(i))
               for i in range(args.nthreads)]

    def gen(i: int, out: dict) -> None:  # generate() builds a KiviCache per call: one per thread
        with torch.no_grad():
            out[i] = model.generate(prompts[i], max_new_tokens=args.thread_tokens, do_sample=False,
                                    min_new_tokens=args.thread_tokens)

    seq: dict = {}
    for i in range(args.nthreads):
        gen(i, seq)
    par: dict = {}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=gen, args=(i, par)) for i in range(args.nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    new = sum(par[i].shape[1] - prompts[i].shape[1] for i in par)
    try:
        layer = numba.threading_layer()
    except ValueError:  # no call was large enough for numba's pool (see SERIAL_BELOW)
        layer = "not started"
    return {"layer": layer, "threads": args.nthreads, "finished": len(par),
            "tokens_equal_sequential": len(par) == args.nthreads and all(torch.equal(seq[i], par[i]) for i in seq),
            "tok_per_s": round(new / dt, 1)}


def layer_available(layer: str) -> bool:
    if layer == "tbb":
        import importlib.util

        return importlib.util.find_spec("tbb") is not None
    if layer == "omp":
        return True  # numba ships its OpenMP layer with the wheel (GNU OpenMP)
    return True


def _soak_child(args, extra: list[str], env: dict | None = None) -> tuple[int, dict | None, str]:
    p = run_fresh([Path(__file__).resolve(), "soak", *extra, *_sizes(args)], env=env, cwd=ROOT,
                  timeout=args.child_timeout)
    return p.returncode, p.result, p.stderr[-400:]


def _sizes(args) -> list[str]:
    return ["--tokens", str(args.tokens), "--every", str(args.every), "--prompt", str(args.prompt), "--hidden",
            str(args.hidden), "--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--sliding-window",
            str(args.sliding_window), "--thread-tokens", str(args.thread_tokens),
            *(["--progress", str(args.progress)] if args.progress else [])]


def soak_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_memory.py soak", description=SOAK_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20000, help="tokens generated per memory run")
    ap.add_argument("--every", type=int, default=500, help="sample RSS and nbytes every N tokens")
    ap.add_argument("--warmup", type=int, default=2000, help="tokens before the band is measured")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (threads: + 13 per thread)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--sliding-window", type=int, default=1024)
    ap.add_argument("--thread-tokens", type=int, default=200, help="tokens each thread generates")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--numba-layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    ap.add_argument("--models", nargs="+", default=["full", "sliding"], choices=["full", "sliding"],
                    help="memory runs: full attention (grows) and/or sliding window (plateaus)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-threads", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="memory JSON")
    ap.add_argument("--threads-out", type=Path, default=None, help="threads JSON")
    ap.add_argument("--table", type=Path, default=None, help="text table")
    ap.add_argument("--child-timeout", type=int, default=7200)
    ap.add_argument("--progress", type=Path, default=None,
                    help="memory runs append each sample to PROGRESS.<model>.jsonl as they go")
    ap.add_argument("--child", choices=["full", "sliding", "threads"], help=argparse.SUPPRESS)
    ap.add_argument("--nthreads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("tokens", "every", "prompt", "hidden", "layers", "kv_heads", "sliding_window", "thread_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.every > args.tokens:
        ap.error(f"--every={args.every} is more than --tokens={args.tokens}: no sample would be taken")
    if any(t < 1 for t in args.threads):
        ap.error(f"--threads={args.threads}: thread counts must be at least 1")

    if args.child in ("full", "sliding"):
        print(json.dumps(memory_child(args.child, args)))
        return 0
    if args.child == "threads":
        print(json.dumps(threads_child(args)))
        return 0

    for path in (args.out, args.threads_out, args.table):
        if path is not None and not path.parent.is_dir():
            ap.error(f"output folder {path.parent} does not exist")
    lines = []
    if not args.skip_memory:
        mem = {"args": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}, "runs": []}
        lines.append(f"memory: KIVI 2/2, cpu backend, {args.tokens} tokens after a {args.prompt}-token prompt, "
                     f"RssAnon - nbytes after {args.warmup} tokens (MiB; total RSS in the JSON)")
        lines.append(f"{'model':<10}{'nbytes first->last':>22}{'min':>9}{'max':>9}{'band':>8}{'slope/1k tok':>14}"
                     f"{'tok/s':>8}")
        for kind in args.models:
            # one numba thread: this part measures memory, and numba's spinning pool on busy cores
            # made a token ~5x slower here (the threads part below measures threads)
            rc, res, err = _soak_child(args, ["--child", kind], env={"NUMBA_NUM_THREADS": "1"})
            if rc != 0 or res is None:
                raise SystemExit(f"error: memory child {kind} failed (exit {rc}): {err}")
            res["summary"] = summarize(res["rows"], args.warmup)
            if res["rows"][0].get("rss_anon") is not None:
                res["summary_anon"] = summarize(res["rows"], args.warmup, "rss_anon")
            s = res.get("summary_anon", res["summary"])
            mem["runs"].append(res)
            mib = 2**20
            lines.append(f"{kind:<10}{s['nbytes_first'] / mib:>10.2f} -> {s['nbytes_last'] / mib:>7.2f}"
                         f"{s['rss_minus_nbytes_min'] / mib:>9.2f}{s['rss_minus_nbytes_max'] / mib:>9.2f}"
                         f"{s['band'] / mib:>8.2f}{s['slope_bytes_per_1k_tokens'] / 1024:>11.1f} KiB"
                         f"{s['tok_per_s']:>8}")
            print(lines[-1], flush=True)
        if args.out:
            write_json(args.out, mem, indent=1)
    if not args.skip_threads:
        rows = []
        lines.append(f"threads: {args.thread_tokens} tokens per thread, prompts of ~{args.prompt} tokens, "
                     "one KiviCache per thread, the model shared")
        lines.append(f"{'numba layer':<12}{'threads':>8}{'exit':>6}{'= sequential':>14}{'tok/s':>8}")
        for layer in args.numba_layers:
            if not layer_available(layer):
                lines.append(f"{layer:<12}{'-':>8}  not installed")
                continue
            for n in args.threads:
                rc, res, err = _soak_child(args, ["--child", "threads", "--nthreads", str(n)],
                                      env={"NUMBA_THREADING_LAYER": layer})
                row = {"requested_layer": layer, "threads": n, "exit": rc, **(res or {"error": err})}
                rows.append(row)
                lines.append(f"{layer:<12}{n:>8}{rc:>6}{str(row.get('tokens_equal_sequential', '-')):>14}"
                             f"{row.get('tok_per_s', '-'):>8}")
                print(lines[-1], flush=True)
        if args.threads_out:
            write_json(args.threads_out, {"args": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
                                          "rows": rows}, indent=1)
    if args.table:
        write_text_file(args.table, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


COMMANDS = {"peak": peak_main, "reachable": reachable_main, "weights": weights_main, "soak": soak_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        print(f"error: the first argument is one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
