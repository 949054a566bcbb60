"""`kivi demo`: one long prompt through a full-precision cache and KIVI presets, side by side.

For each cache (FP ``DynamicCache`` first, then every preset) on the same prompt:

* prefill the prompt (tokens/s);
* greedy-decode ``--max-new-tokens`` tokens one forward at a time (tokens/s), then measure the bytes
  the cache really holds (:func:`kivi.eval.cache_nbytes`) and compare the continuation with the FP
  one (:func:`kivi.eval.token_agreement`: identical tokens, longest common prefix);
* from a copy of the post-prompt cache, feed the next ``--eval-tokens`` tokens of the text in chunks
  of ``--chunk`` (teacher forcing) and score them (:func:`kivi.eval.score_continuation`: perplexity,
  mean KL divergence ``KL(FP || cache)`` of the next-token distributions, top-1 agreement).

Caches come from :func:`kivi.eval.make_cache`. The numba kernels of KIVI's CPU attention are
compiled (or loaded from numba's on-disk cache) before anything is timed; that time is reported on
its own (``fused_compile_or_load_s``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

from . import CliError
from .loading import check_context_fits, load_model_from_args, read_text_arg
from .options import add_model_args, add_text_args, check_cli_backend, load_config_file
from .output import print_json, print_rich, write_json_file, write_outputs
from .threads import machine_cores, set_cpu_threads
from .validators import non_negative_int, output_path, positive_int, text_value

DEFAULT_PRESETS = "high,balanced,extreme"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the main demo: FP vs KIVI presets on a long prompt (speed, memory, agreement, perplexity)",
        description="Runs one long prompt of the shipped WikiText-2 text through SmolLM2-135M (or --model) with a "
        "full-precision cache and with the KIVI presets, and prints one table: prefill and decode tokens/s, "
        "cache bytes measured, compression vs FP, agreement of the greedy continuation with FP, and "
        "teacher-forced perplexity / KL vs FP on the text that follows the prompt.",
        epilog="example: kivi demo --context 4000 --presets balanced,extreme --max-new-tokens 64 --json-out demo.json",
    )
    add_model_args(p)
    add_text_args(p)
    p.add_argument("--context", type=positive_int, default=2000, help="prompt tokens (default 2000)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy continuation tokens (default 32)")
    p.add_argument("--eval-tokens", type=non_negative_int, default=256,
                   help="held-back text tokens after the prompt scored by teacher forcing (default 256; 0 = skip)")
    p.add_argument(
        "--chunk", type=positive_int, default=16, help="tokens per forward when scoring the held-back text (default 16)"
    )
    p.add_argument("--presets", default=DEFAULT_PRESETS, type=text_value,
                   help=f"comma-separated KIVI presets, or KiviConfig JSON files (default {DEFAULT_PRESETS})")
    p.add_argument("--no-fp", action="store_true", help="skip the FP reference (no agreement / KL columns)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads of torch and of the numba kernels (default: every core this process may run on)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    p.add_argument("--json-out", default=None, type=output_path,
                   help="also write the JSON results to this file (checked before the work starts)")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- helpers


def parse_presets(text: str) -> list[tuple[str, Any]]:
    """``"high,balanced"`` -> ``[("high", KiviConfig), ...]``; JSON files are named by their stem."""
    from pathlib import Path

    from ..config import KiviConfig

    out = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item.lower().endswith(".json"):
            out.append((Path(item).stem, load_config_file(item, "--presets")))
        else:
            out.append((item.lower(), KiviConfig.preset(item)))
    if not out:
        raise CliError("--presets is empty; give e.g. high,balanced,extreme")
    for _, cfg in out:
        check_cli_backend(cfg)
    return out




def _status(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_one(model: Any, cfg: Any, prompt: Any, cont: Any, max_new: int, chunk: int, bar: Any, label: str,
            reference: Any = None) -> dict[str, Any]:
    """Prefill, greedy decode and teacher-forced scoring with one cache. Returns numbers + tokens
    (+ the scored log-probabilities for the FP row, the reference of the others)."""
    import torch

    from ..eval.caches import cache_nbytes, make_cache
    from ..eval.protocol import score_continuation

    res: dict[str, Any] = {}
    cache = make_cache(model, cfg)
    bar.set_description(f"{label}: prefill {prompt.shape[-1]} tokens")
    t0 = time.perf_counter()
    # only the last position's logits: the LM head over 2000 positions would cost a third of the prefill
    out = model(prompt, cache=cache, use_cache=True, logits_to_keep=1)
    res["prefill_s"] = time.perf_counter() - t0
    bar.update()
    last_logits = out.logits[:, -1, :].float()
    del out
    # the post-prompt state, for teacher forcing after the greedy decode
    scoring_cache = copy.deepcopy(cache) if cont is not None else None

    # ---- greedy decode
    bar.set_description(f"{label}: decode {max_new} tokens")
    tokens = [int(last_logits.argmax(-1))]
    t0 = time.perf_counter()
    for _ in range(max_new - 1):
        nxt = torch.tensor([[tokens[-1]]], device=prompt.device)
        logits = model(nxt, cache=cache, use_cache=True).logits[:, -1, :]
        tokens.append(int(logits.argmax(-1)))
        bar.update()
    res["decode_s"] = time.perf_counter() - t0
    bar.update()
    res["tokens"] = tokens
    res["cache_tokens"] = cache.get_seq_length()
    res["cache_bytes"] = cache_nbytes(cache)
    if hasattr(cache, "memory_breakdown"):
        res["cache_breakdown"] = cache.memory_breakdown()
    del cache

    # ---- teacher-forced scoring of the held-back continuation
    if cont is not None:
        bar.set_description(f"{label}: score {cont.shape[-1]} held-back tokens")
        res["score"] = score_continuation(model, scoring_cache, last_logits, cont, chunk=chunk, reference=reference,
                                          keep_logprobs=cfg is None, on_chunk=bar.update)
        del scoring_cache
    return res


def warm_up(model: Any, kivi_rows: bool, threads: int, kv_lens: tuple[int, int]) -> float | None:
    """Untimed first-call work before any row is timed: one short forward (the first forward of a
    process allocates lasting buffers) and, for KIVI rows on CPU, compiling / loading the numba
    kernels of the fused decode attention (the single-sequence entries that one sequence decoding at kv lengths
    ``kv_lens[0] .. kv_lens[1]`` runs: :func:`kivi.attention.fused_cpu.dispatch.decode_entries`) and the
    value quantizer; then ``threads`` CPU threads
    for torch and numba (loading the kernels can change torch's count). Returns the kernels'
    seconds (``None`` when they are not used)."""
    import torch

    with torch.inference_mode():
        model(torch.ones(1, 8, dtype=torch.long, device=model.device), use_cache=False, logits_to_keep=1)
    seconds = None
    if kivi_rows and model.device.type == "cpu":
        from ..attention.fused_cpu import fused_decode_available, warmup
        from ..attention.fused_cpu.dispatch import decode_entries
        from ..cache.heads import kv_heads_of

        if fused_decode_available():
            seconds = warmup(decode_entries(1, kv_heads_of(model.config) or 1, kv_lens))
    set_cpu_threads(threads)
    return seconds


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    presets = parse_presets(args.presets)  # fail on a bad preset before loading anything
    wall0 = time.perf_counter()

    import torch

    from ..eval.metrics import token_agreement
    from ..eval.progress import progress_bar

    threads = args.threads or machine_cores()
    torch.set_num_threads(threads)
    text = read_text_arg(args)  # raises a one-line error for a missing/unreadable/endless file

    _status(f"loading model {args.model!r} (the first run converts the GGUF once, ~30 s) ...")
    t0 = time.perf_counter()
    model, tokenizer = load_model_from_args(args)  # --weight-bits 8 / 4: quanto weights
    load_s = time.perf_counter() - t0
    from ..integration import check_model_supported, dequantize_model, quantize_model

    for _, cfg in presets:
        check_model_supported(model)
        cfg.validate(num_layers=model.config.get_text_config(decoder=True).num_hidden_layers)

    extra = max(args.max_new_tokens, args.eval_tokens)
    check_context_fits(model, args.context + extra, f"--context {args.context} + {extra} generated/scored tokens")
    from ..data import token_ids

    ids = token_ids(tokenizer, text)
    if ids.numel() < args.context + args.eval_tokens:
        raise CliError(
            f"the text has {ids.numel()} tokens; --context {args.context} + --eval-tokens {args.eval_tokens} need "
            f"{args.context + args.eval_tokens}"
        )
    prompt = ids[None, : args.context].to(model.device)
    cont = ids[None, args.context : args.context + args.eval_tokens].to(model.device) if args.eval_tokens else None

    runs: list[tuple[str, Any]] = ([] if args.no_fp else [("fp", None)]) + presets
    # before any timing: timed inside the first KIVI row, compiling the numba kernels made its decode
    # column several times slower than the others
    _status("warming up (first forward; numba kernels of the CPU attention: compiled once, then loaded) ...")
    # decode steps (and scoring, when --chunk 1) attend over up to context + extra positions
    compile_s = warm_up(model, kivi_rows=bool(presets), threads=threads,
                        kv_lens=(args.context + 1, args.context + extra))
    n_chunks = 0 if cont is None else len(range(0, args.eval_tokens - 1, args.chunk))
    bar = progress_bar(len(runs) * (1 + args.max_new_tokens + n_chunks), "demo")
    results: list[dict[str, Any]] = []
    fp = None
    try:
        with torch.inference_mode():
            for label, cfg in runs:
                # KIVI rows run through kivi's attention (quantize_model): a KiviCache on an unquantized
                # model would be read by the model's own attention after a full dequantization per layer
                # and step (the "reference" path), which is what the decode column must not time.
                if cfg is not None:
                    quantize_model(model, cfg)
                try:
                    reference = fp["score"]["logprobs"] if fp is not None and cont is not None else None
                    r = run_one(model, cfg, prompt, cont, args.max_new_tokens, args.chunk, bar, label, reference)
                    r["attention_backend"] = getattr(model, "kivi_attention_backend", None)
                finally:
                    if cfg is not None:
                        dequantize_model(model)
                r["name"] = label
                r["cfg"] = cfg
                r["config"] = None if cfg is None else cfg.to_dict()
                r["config_description"] = "DynamicCache (full precision)" if cfg is None else cfg.describe()
                if cfg is None:
                    fp = r
                results.append(r)
    finally:
        bar.close()

    from ..memory import estimate_kv_memory

    rows = []
    dtype = str(model.dtype).replace("torch.", "")
    for r in results:
        row: dict[str, Any] = {
            "name": r["name"],
            "config": r["config"],
            "config_description": r["config_description"],
            "attention_backend": r["attention_backend"],
            "prefill_tokens_per_s": args.context / r["prefill_s"],
            "decode_tokens_per_s": (args.max_new_tokens - 1) / r["decode_s"] if args.max_new_tokens > 1 else None,
            "prefill_s": r["prefill_s"],
            "decode_s": r["decode_s"],
            "cache_tokens": r["cache_tokens"],
            "cache_bytes": r["cache_bytes"],
            "continuation": tokenizer.decode(r["tokens"]),
            "continuation_ids": r["tokens"],
        }
        if r["cfg"] is not None:
            est = estimate_kv_memory(model, r["cache_tokens"], config=r["cfg"], prefill=args.context, dtype=dtype)
            row["predicted_cache_bytes"] = est.kivi_total_bytes
            row["cache_breakdown"] = r.get("cache_breakdown")
        fp_bytes = fp["cache_bytes"] if fp else estimate_kv_memory(model, r["cache_tokens"], dtype=dtype).fp_total_bytes
        row["fp_cache_bytes"] = fp_bytes
        row["compression_ratio"] = fp_bytes / r["cache_bytes"] if r["cache_bytes"] else None
        if fp is not None:
            agree = token_agreement(r["tokens"], fp["tokens"])
            row["same_tokens_vs_fp"] = agree["same_tokens"]
            row["common_prefix_vs_fp"] = agree["common_prefix"]
        if cont is not None:
            score = r["score"]
            row["ppl"] = score["ppl"]
            row["nll"] = score["nll"]
            if fp is not None:
                # the FP row is the reference: KL 0 and full agreement by definition
                row["kl_vs_fp"] = score.get("kl", 0.0)
                row["top1_agreement_vs_fp"] = score.get("top1_agreement", 1.0)
                row["ppl_delta_vs_fp"] = score["ppl"] - fp["score"]["ppl"]
        rows.append(row)

    result = {
        "model": args.model,
        "model_dtype": dtype,
        "text": args.text or "WikiText-2 raw test (shipped)",
        "context": args.context,
        "max_new_tokens": args.max_new_tokens,
        "eval_tokens": args.eval_tokens,
        "chunk": args.chunk,
        "torch_threads": torch.get_num_threads(),
        "model_load_s": load_s,
        "fused_compile_or_load_s": compile_s,
        "wall_s": time.perf_counter() - wall0,
        "rows": rows,
    }
    failed = write_outputs([("--json-out", args.json_out, lambda p: write_json_file(p, result))])
    if args.json:
        print_json(result)
    else:
        render(result)
        if failed:
            print_json(result)
    if failed:  # the result is on stdout: nothing computed is lost
        raise CliError("; ".join(failed) + " — the result was printed on stdout instead")
    return 0


def render(result: dict[str, Any]) -> None:
    from ..memory import format_bytes

    rows = result["rows"]
    header = ["cache", "config", "prefill tok/s", "decode tok/s", "cache bytes", "vs FP", "same tokens",
              "common prefix", "PPL", "KL vs FP"]
    table = []
    for r in rows:
        table.append([
            r["name"],
            r["config_description"].replace("DynamicCache (full precision)", "full precision"),
            f"{r['prefill_tokens_per_s']:,.0f}",
            "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}",
            format_bytes(r["cache_bytes"]),
            f"{r['compression_ratio']:.2f}x" if r.get("compression_ratio") else "-",
            f"{r['same_tokens_vs_fp']:.0%}" if "same_tokens_vs_fp" in r else "-",
            f"{r['common_prefix_vs_fp']}/{result['max_new_tokens']}" if "common_prefix_vs_fp" in r else "-",
            f"{r['ppl']:.3f}" if "ppl" in r else "-",
            f"{r['kl_vs_fp']:.4f}" if "kl_vs_fp" in r else "-",
        ])
    title = (f"KIVI demo — {result['model']} ({result['model_dtype']}), prompt {result['context']} tokens of "
             f"{result['text']}, {result['max_new_tokens']} greedy tokens, PPL/KL on the next "
             f"{result['eval_tokens']} tokens (chunks of {result['chunk']})")
    try:
        from rich.table import Table

        t = Table(*header, title=title)
        for c in t.columns[2:]:
            c.justify = "right"
        for row in table:
            t.add_row(*row)
        print_rich(t, width=140)
    except ImportError:
        print(title)
        widths = [max(len(str(x[i])) for x in [header, *table]) for i in range(len(header))]
        for row in [header, *table]:
            print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    fp = next((r for r in rows if r["name"] == "fp"), None)
    if fp is not None:
        print(f"FP continuation: {fp['continuation']!r}")
    for r in rows:
        if fp is not None and r is not fp and r.get("common_prefix_vs_fp", 0) < result["max_new_tokens"]:
            print(f"{r['name']} continuation: {r['continuation']!r}")
    print(f"cache bytes measured after {rows[0]['cache_tokens']} tokens (prompt + continuation); model load "
          f"{result['model_load_s']:.1f} s, total {result['wall_s']:.1f} s, {result['torch_threads']} threads")
    if result.get("fused_compile_or_load_s") is not None:
        print(f"numba kernels of the CPU attention compiled/loaded in {result['fused_compile_or_load_s']:.1f} s "
              "before timing (not in the speed columns)")
