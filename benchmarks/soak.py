#!/usr/bin/env python
"""Soak: a long generation's memory against the cache's bytes, and threads x numba threading layers.

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

    python benchmarks/soak.py --tokens 20000 --every 500 --out results/soak/soak_memory.json \\
        --threads-out results/soak/soak_threads.json --table results/soak/soak.txt

``--skip-memory`` / ``--skip-threads`` run one part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import ROOT, proc_status_bytes, run_fresh, write_json, write_text_file

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
    from kivi.allocator import reduce_fragmentation

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


def _child(args, extra: list[str], env: dict | None = None) -> tuple[int, dict | None, str]:
    p = run_fresh([Path(__file__).resolve(), *extra, *_sizes(args)], env=env, cwd=ROOT, timeout=args.child_timeout)
    return p.returncode, p.result, p.stderr[-400:]


def _sizes(args) -> list[str]:
    return ["--tokens", str(args.tokens), "--every", str(args.every), "--prompt", str(args.prompt), "--hidden",
            str(args.hidden), "--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--sliding-window",
            str(args.sliding_window), "--thread-tokens", str(args.thread_tokens),
            *(["--progress", str(args.progress)] if args.progress else [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
            rc, res, err = _child(args, ["--child", kind], env={"NUMBA_NUM_THREADS": "1"})
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
                rc, res, err = _child(args, ["--child", "threads", "--nthreads", str(n)],
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


if __name__ == "__main__":
    sys.exit(main())
