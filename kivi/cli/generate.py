"""`kivi generate`: generate text with a KIVI-quantized KV cache and report the cache's memory."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import CliError
from .loading import check_context_fits, load_model_from_args
from .options import add_config_args, add_max_text_bytes_arg, add_model_args, config_from_args
from .output import print_json
from .prefix import add_prefix_args, check_prefix_args, prefix_inputs
from .validators import byte_size, positive_float, positive_int, seed, text_value, utf8_text


def register(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with a KIVI cache (streams the text, then prints the cache memory)",
        description="Loads a model, applies quantize_model(model, config) so that model.generate uses a KIVI cache, "
        "streams the generated text, and prints the bytes the cache holds next to what a full-precision cache "
        "would hold for the same tokens.",
        epilog="examples:\n"
        "  kivi generate --prompt 'Explain the KV cache in one paragraph.'\n"
        "  kivi generate --prompt-file article.txt --raw --preset extreme --max-new-tokens 100\n"
        "  kivi generate --prompt 'Hi' --k-bits 4 --v-bits 2 --residual-length 64 --json\n"
        "  kivi generate --prompt-file article.txt --cache-budget 64MiB --max-new-tokens 500",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None, type=utf8_text, help="the prompt text")
    src.add_argument("--prompt-file", default=None, type=text_value,
                     help="read the prompt from this UTF-8 file ('-' = stdin; at most --max-text-bytes)")
    add_max_text_bytes_arg(p, "--prompt-file")
    p.add_argument(
        "--raw",
        action="store_true",
        help="feed the prompt as plain text (default: wrap it in the tokenizer's chat template if it has one)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=None,
                   help="sampling temperature (with --do-sample; below 1e-5: greedy, as in kivi serve)")
    p.add_argument("--seed", type=seed, default=0, help="random seed for sampling, 0 to 2**64-1 (default 0)")
    add_config_args(p, default_preset=None)
    b = p.add_argument_group("precision from a budget (docs/python.md, \"Precision chosen from a byte budget\" and "
                             "\"Precision chosen from the request's length\")")
    b.add_argument("--cache-budget", default=None, type=byte_size,
                   help="bytes for the KV cache alone (e.g. 64MiB): pick the best-quality config whose cache fits the "
                        "prompt + --max-new-tokens (kivi estimate --cache-budget's ladder), say which and why")
    b.add_argument("--full-precision-first", action="store_true",
                   help="with --cache-budget: keep the cache in full precision as long as the budget allows "
                        "(quantize_after = the most tokens it holds at full precision), KIVI after that")
    add_prefix_args(p)
    p.add_argument("--json", action="store_true",
                   help="no streaming; print {text, tokens, cache_bytes, fp_cache_bytes, ...} as JSON")
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:  # the one bounded reader: a file, '-' (stdin) or a FIFO; an endless one stops at --max-text-bytes
        from ..files import read_text

        text = read_text(args.prompt_file, option="--prompt-file", max_bytes=args.max_text_bytes,
                         raise_bound="--max-text-bytes")
    if not text.strip():
        raise CliError("the prompt is empty")
    return text


def budget_pick(model: Any, budget: int, prompt_tokens: int, max_new_tokens: int, fp_first: bool) -> Any:
    """:func:`kivi.memory.budget.config_for_budget` for this request (a cache of prompt + max new tokens, the
    prompt one prefill); nothing fits: one line (exit 2) naming the budget and the smallest need."""
    from ..memory.budget import BudgetError, config_for_budget

    try:
        return config_for_budget(model, budget, prompt_tokens + max_new_tokens, prefill=prompt_tokens,
                                 full_precision_first=fp_first)
    except BudgetError as e:
        raise CliError(f"--cache-budget: {e}; raise the budget or lower --max-new-tokens") from None


def run(args: argparse.Namespace) -> int:
    from ..config import KiviConfig

    prefix_cfg = check_prefix_args(args)  # --save-prefix's folder, --load-prefix's file: before anything loads
    given = config_from_args(args)  # validate options before loading anything
    cfg = given or prefix_cfg or KiviConfig()
    if args.cache_budget is not None and (given is not None or args.load_prefix):
        raise CliError("give either --cache-budget (kivi picks the config) or a config (--preset/--config/--k-bits "
                       "... or --load-prefix's), not both")
    if args.full_precision_first and args.cache_budget is None:
        raise CliError("--full-precision-first goes with --cache-budget (it sets how long the budget allows "
                       "full precision)")
    prompt = read_prompt(args)

    import torch

    from ..integration import quantize_model
    from ..memory import estimate_kv_memory

    if not args.json:
        print(f"loading {args.model!r} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model_from_args(args)  # --weight-bits 8 / 4: quanto weights

    if not args.raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    pick = None
    if args.cache_budget is not None:  # the request's length is known now: prompt + what may be generated
        n = ids.shape[-1]
        check_context_fits(model, n + args.max_new_tokens,
                           f"the prompt ({n} tokens) + --max-new-tokens {args.max_new_tokens}")
        pick = budget_pick(model, args.cache_budget, n, args.max_new_tokens, args.full_precision_first)
        cfg = pick.config
        if not args.json:  # what was chosen and why, on stderr (stdout is the generated text)
            from .estimate import render_pick

            render_pick(pick, file=sys.stderr)
    quantize_model(model, cfg)
    ids, prefix_kwargs, prefix_info, saver = prefix_inputs(args, model, tokenizer, prompt, ids.to(model.device))
    n_prompt = ids.shape[-1]
    check_context_fits(model, n_prompt + args.max_new_tokens,
                       f"the prompt ({n_prompt} tokens) + --max-new-tokens {args.max_new_tokens}")

    streamer = None
    if not args.json:
        from transformers import TextStreamer

        print(f"[KIVI {cfg.describe()}; prompt {n_prompt} tokens]", file=sys.stderr, flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    from ..sampling import is_greedy_temperature

    temperature = args.temperature if args.temperature is not None else model.generation_config.temperature
    sample = args.do_sample and not is_greedy_temperature(temperature)  # a tiny temperature is greedy
    gen_kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": sample}
    if sample:
        torch.manual_seed(args.seed)
        if args.temperature is not None:
            gen_kwargs["temperature"] = args.temperature
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                             return_dict_in_generate=True, pad_token_id=pad, **gen_kwargs, **prefix_kwargs)
    elapsed = time.perf_counter() - t0
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    new_ids = out.sequences[0, n_prompt:].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    cache_tokens = cache.get_seq_length() if cache is not None else n_prompt + len(new_ids) - 1
    cache_bytes = getattr(cache, "nbytes", None)
    dtype = str(model.dtype).replace("torch.", "")
    est = estimate_kv_memory(model, cache_tokens, config=cfg, prefill=n_prompt, dtype=dtype)
    fp_bytes = est.fp_total_bytes
    ratio = fp_bytes / cache_bytes if cache_bytes else None
    result = {
        "model": args.model,
        "config": cfg.to_dict(),
        "config_description": cfg.describe(),
        "prompt_tokens": n_prompt,
        "text": text,
        "tokens": new_ids,
        "new_tokens": len(new_ids),
        "cache_tokens": cache_tokens,
        "cache_bytes": cache_bytes,
        "predicted_cache_bytes": est.kivi_total_bytes,
        "fp_cache_bytes": fp_bytes,
        "weight_bits": args.weight_bits,
        "weights_bytes": est.weights_bytes,  # measured: the tensors of the loaded (maybe quantized) model
        "compression_ratio": ratio,
        "budget_pick": None if pick is None else pick.to_dict(),
        "generate_s": elapsed,
        "tokens_per_s": len(new_ids) / elapsed if elapsed > 0 else None,
        **prefix_info,
    }
    if saver is not None:
        result["prefix_saved"] = saver.error is None
    if args.json:
        print_json(result)
        if saver is not None:
            saver.check()  # a failed --save-prefix: one line after the result, exit 2
        return 0
    from ..memory import format_bytes

    print()
    line = (
        f"cache: {format_bytes(cache_bytes)} ({cache_bytes:,} B) for {cache_tokens} tokens with KIVI {cfg.describe()}; "
        f"full precision ({dtype}) would hold {format_bytes(fp_bytes)} ({fp_bytes:,} B): ratio {ratio:.2f}x. "
        f"{len(new_ids)} tokens in {elapsed:.1f} s"
    )
    if cfg.quantize_after and cache_tokens <= cfg.quantize_after:
        line += (f" (only {cache_tokens} tokens: the cache stays in full precision up to quantize_after="
                 f"{cfg.quantize_after} tokens)")
    elif cache_tokens <= cfg.residual_length + cfg.group_size:
        line += (f" (only {cache_tokens} tokens: they are all still in the full-precision window of "
                 f"R={cfg.residual_length}, so nothing is quantized yet; try a longer prompt)")
    print(line, file=sys.stderr)
    if saver is not None:
        saver.check()  # a failed --save-prefix: one line after the result, exit 2
    return 0
