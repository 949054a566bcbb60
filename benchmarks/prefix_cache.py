#!/usr/bin/env python
"""Saved quantized prefixes on the embedded SmolLM2: file size, load time against prefill time, and
continuation after loading equal to continuation in the saving process.

For each configuration (KIVI 2/2 = ``KiviConfig()``, ``balanced``), two fresh processes:

1. **save**: prefill the first ``--tokens`` tokens of the shipped WikiText-2 test text into a KIVI
   cache (one forward, timed after an untimed 64-token warm-up forward), save it with
   :func:`kivi.prefix.save_prefix` (timed), then, each from a copy of the cache made right after the
   prefill: greedy ``--new-tokens`` continuing the document (the next document token is fed after
   the prefix) and ``--answer-tokens`` after each of three questions. Records the tokens and a
   sha256 of every step's logits. Also the bytes of a float16 ``DynamicCache`` of the same prefix
   (a DynamicCache prefill of the float32 model, its tensors counted at 2 bytes per element).
2. **load** (isolated: a new process, model already loaded when the clock starts): time
   :func:`kivi.prefix.load_prefix` (fingerprint of model + tokenizer, checks, reading, building) and
   its parts, then the same continuation and questions, each from a fresh load of the file.
   Tokens and logits must equal the save process's.

    python benchmarks/prefix_cache.py --tokens 4096 --threads 1 --out results/prefix/prefix_cache_4k.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import run_fresh, set_threads, write_json

QUESTIONS = (
    "\n\nQuestion: What is this text about?\nAnswer:",
    "\n\nQuestion: Which people are named in the text?\nAnswer:",
    "\n\nSummary of the text above:",
)
CONFIGS = {"kivi-2/2": {}, "balanced": {"preset": "balanced"}}


def _config(name: str):
    from kivi import KiviConfig

    spec = CONFIGS[name]
    return KiviConfig.preset(spec["preset"]) if "preset" in spec else KiviConfig()


def _setup(threads: int):
    from kivi.models import load_model

    set_threads(threads)  # compile / load the numba kernels before anything is timed
    return load_model("smollm2")


def _prefix_ids(tok, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, tokens]`` document ids and the next document token ``[1, 1]``."""
    from kivi.data import load_text

    ids = tok(load_text()[: tokens * 8], add_special_tokens=False, return_tensors="pt")["input_ids"]
    if ids.shape[-1] <= tokens:
        raise SystemExit(f"--tokens {tokens}: the text gave only {ids.shape[-1]} tokens")
    return ids[:, :tokens], ids[:, tokens : tokens + 1]


def _generate(model, cache, full: torch.Tensor, n: int) -> dict:
    """Greedy ``n`` tokens after ``full`` (the cache holds all but its last tokens); tokens + sha256 of the logits."""
    out = model.generate(full, attention_mask=torch.ones_like(full), cache=cache, max_new_tokens=n, do_sample=False,
                         temperature=None, top_p=None, top_k=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    h = hashlib.sha256()
    for step in out.logits:
        h.update(step.float().contiguous().numpy().tobytes())
    return {"tokens": out.sequences[0, full.shape[-1]:].tolist(), "logits_sha256": h.hexdigest()}


def _runs(model, tok, ids, nxt, new_tokens, answer_tokens, fresh_cache):
    runs = {"continue": _generate(model, fresh_cache(), torch.cat([ids, nxt], -1), new_tokens)}
    for i, q in enumerate(QUESTIONS):
        q_ids = tok(q, add_special_tokens=False, return_tensors="pt")["input_ids"]
        r = _generate(model, fresh_cache(), torch.cat([ids, q_ids], -1), answer_tokens)
        r["text"] = tok.decode(r["tokens"], skip_special_tokens=True)
        runs[f"question{i}"] = r
    return runs


def phase_save(a) -> dict:
    from transformers import DynamicCache

    import kivi
    from kivi.prefix import prefill, save_prefix

    model, tok = _setup(a.threads)
    ids, nxt = _prefix_ids(tok, a.tokens)
    cfg = _config(a.config)
    kivi.quantize_model(model, cfg)
    with torch.inference_mode():
        prefill(model, ids[:, :64])  # warm-up (not timed)
        t0 = time.perf_counter()
        cache = prefill(model, ids)
        prefill_s = time.perf_counter() - t0
    snapshot = copy.deepcopy(cache)  # the state right after the prefill, for each continuation below
    t0 = time.perf_counter()
    save_prefix(a.file, cache, model, tok, ids)
    save_s = time.perf_counter() - t0
    kivi.dequantize_model(model)
    with torch.inference_mode():
        fp = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True,
                   logits_to_keep=1).past_key_values
    fp16_bytes = sum(2 * (layer.keys.numel() + layer.values.numel()) for layer in fp.layers)
    del fp
    kivi.quantize_model(model, cfg)
    with torch.inference_mode():
        runs = _runs(model, tok, ids, nxt, a.new_tokens, a.answer_tokens, lambda: copy.deepcopy(snapshot))
    return {"prefill_s": prefill_s, "save_s": save_s, "cache_nbytes": cache.nbytes,
            "file_bytes": os.path.getsize(a.file), "fp16_dynamic_cache_bytes": fp16_bytes,
            "prefix_tokens": ids.shape[-1], "runs": runs}


def phase_load(a) -> dict:
    import kivi
    from kivi.cache.cache import KiviCache
    from kivi.prefix import load_prefix, model_fingerprint

    model, tok = _setup(a.threads)
    kivi.quantize_model(model, _config(a.config))
    t0 = time.perf_counter()
    prefix = load_prefix(a.file, model, tok)  # what a user calls: fingerprint, checks, read, build
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fp = model_fingerprint(model, tok)
    fingerprint_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    KiviCache.load(a.file, fingerprint=fp, model=model)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fp_sample = model_fingerprint(model, tok, weights="sample")
    fingerprint_sample_s = time.perf_counter() - t0
    del fp_sample
    ids, nxt = _prefix_ids(tok, a.tokens)
    assert torch.equal(prefix.input_ids, ids)
    with torch.inference_mode():
        runs = _runs(model, tok, ids, nxt, a.new_tokens, a.answer_tokens,
                     lambda: load_prefix(a.file, model, tok).cache)  # each question from a fresh load
    return {"load_s": load_s, "fingerprint_s": fingerprint_s, "read_and_build_s": read_s,
            "fingerprint_sample_s": fingerprint_sample_s, "cache_nbytes": prefix.cache.nbytes, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="prefix length in tokens (default 4096)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens continuing the document (default 64)")
    ap.add_argument("--answer-tokens", type=int, default=24, help="greedy tokens per question (default 24)")
    ap.add_argument("--threads", type=int, default=1, help="torch and numba threads (default 1)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--phase", choices=("save", "load"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--file", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        result = phase_save(a) if a.phase == "save" else phase_load(a)
        print(json.dumps(result))
        return 0

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.configs.split(","):
            if name not in CONFIGS:
                raise SystemExit(f"--configs: {name!r} is not one of {list(CONFIGS)}")
            f = str(Path(d) / f"{name.replace('/', '_')}.kivi")
            child = [__file__, "--tokens", str(a.tokens), "--new-tokens", str(a.new_tokens),
                      "--answer-tokens", str(a.answer_tokens), "--threads", str(a.threads), "--config", name,
                      "--file", f]
            env = {"OMP_NUM_THREADS": str(a.threads)}
            phases = {}
            for phase in ("save", "load"):
                print(f"{name}: {phase} ...", file=sys.stderr, flush=True)
                p = run_fresh(child + ["--phase", phase], env=env)
                if p.returncode or p.result is None:
                    sys.stderr.write(p.stderr)
                    return p.returncode or 1
                phases[phase] = p.result
            s, l_ = phases["save"], phases["load"]
            equal = {k: s["runs"][k] == l_["runs"][k] for k in s["runs"]}
            row = {"config": name, "description": _config(name).describe(),
                   **{k: v for k, v in s.items() if k != "runs"},
                   **{k: v for k, v in l_.items() if k not in ("runs", "cache_nbytes")},
                   "loaded_cache_nbytes": l_["cache_nbytes"],
                   "file_vs_nbytes": s["file_bytes"] / s["cache_nbytes"],
                   "fp16_vs_file": s["fp16_dynamic_cache_bytes"] / s["file_bytes"],
                   "prefill_vs_load": s["prefill_s"] / l_["load_s"],
                   "continuation_equal": equal, "runs_save": s["runs"], "runs_load": l_["runs"]}
            rows.append(row)
            print(f"{name}: prefix {s['prefix_tokens']} tokens, file {s['file_bytes']:,} B, nbytes "
                  f"{s['cache_nbytes']:,} B, fp16 DynamicCache {s['fp16_dynamic_cache_bytes']:,} B "
                  f"({row['fp16_vs_file']:.2f}x the file); prefill {s['prefill_s']:.2f} s, load {l_['load_s']:.3f} s "
                  f"(fingerprint {l_['fingerprint_s']:.3f} s, read+build {l_['read_and_build_s']:.3f} s): "
                  f"{row['prefill_vs_load']:.1f}x; continuation equal: {equal}", file=sys.stderr, flush=True)
    result = {"command": "python " + " ".join(sys.argv), "tokens": a.tokens, "threads": a.threads, "rows": rows}
    if a.out:
        write_json(a.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"} | {
        "rows": [{k: v for k, v in r.items() if not k.startswith("runs")} for r in rows]}, indent=2))
    return 0 if all(all(r["continuation_equal"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
