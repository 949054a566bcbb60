"""`kivi generate`: generate text with a KIVI-quantized KV cache and report the cache's memory."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import CliError
from .common import (
    add_config_args,
    add_model_args,
    check_context_fits,
    config_from_args,
    load_model_from_args,
    positive_float,
    positive_int,
    print_json,
    seed,
    utf8_text,
)
from .prefix import add_prefix_args, check_prefix_args, prefix_inputs


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
        "  kivi generate --prompt 'Hi' --k-bits 4 --v-bits 2 --residual-length 64 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None, type=utf8_text, help="the prompt text")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file ('-' = stdin)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as plain text (default: wrap it in the tokenizer's chat template if it has one)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=None, help="sampling temperature (with --do-sample)")
    p.add_argument("--seed", type=seed, default=0, help="random seed for sampling, 0 to 2**64-1 (default 0)")
    add_config_args(p, default_preset=None)
    add_prefix_args(p)
    p.add_argument("--json", action="store_true",
                   help="no streaming; print {text, tokens, cache_bytes, fp_cache_bytes, ...} as JSON")
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file == "-":
        data = sys.stdin.buffer.read() if sys.stdin is not None else b""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CliError(f"--prompt-file -: standard input is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                           f"offset {e.start})") from None
    else:
        from pathlib import Path

        path = Path(args.prompt_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CliError(f"--prompt-file {str(path)!r} does not exist") from None
        except IsADirectoryError:
            raise CliError(f"--prompt-file {str(path)!r} is a directory, not a text file") from None
        except UnicodeDecodeError:
            raise CliError(f"--prompt-file {str(path)!r} is not UTF-8 text") from None
        except OSError as e:
            raise CliError(f"cannot read --prompt-file {str(path)!r}: {e.strerror or e}") from None
    if not text.strip():
        raise CliError("the prompt is empty")
    return text


def run(args: argparse.Namespace) -> int:
    from ..config import KiviConfig

    prefix_cfg = check_prefix_args(args)  # --save-prefix's folder, --load-prefix's file: before anything loads
    cfg = config_from_args(args) or prefix_cfg or KiviConfig()  # validate options before loading anything
    prompt = read_prompt(args)

    import torch

    from ..integration import quantize_model
    from ..memory import estimate_kv_memory

    if not args.json:
        print(f"loading {args.model!r} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model_from_args(args)  # --weight-bits 8 / 4: quanto weights
    quantize_model(model, cfg)

    if not args.raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    ids, prefix_kwargs, prefix_info = prefix_inputs(args, model, tokenizer, prompt, ids.to(model.device))
    n_prompt = ids.shape[-1]
    check_context_fits(model, n_prompt + args.max_new_tokens,
                       f"the prompt ({n_prompt} tokens) + --max-new-tokens {args.max_new_tokens}")

    streamer = None
    if not args.json:
        from transformers import TextStreamer

        print(f"[KIVI {cfg.describe()}; prompt {n_prompt} tokens]", file=sys.stderr, flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    gen_kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    if args.do_sample:
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
        "generate_s": elapsed,
        "tokens_per_s": len(new_ids) / elapsed if elapsed > 0 else None,
        **prefix_info,
    }
    if args.json:
        print_json(result)
        return 0
    from ..memory import format_bytes

    print()
    line = (f"cache: {format_bytes(cache_bytes)} ({cache_bytes:,} B) for {cache_tokens} tokens with KIVI {cfg.describe()}; "
            f"full precision ({dtype}) would hold {format_bytes(fp_bytes)} ({fp_bytes:,} B): ratio {ratio:.2f}x. "
            f"{len(new_ids)} tokens in {elapsed:.1f} s")
    if cache_tokens <= cfg.residual_length + cfg.group_size:
        line += (f" (only {cache_tokens} tokens: they are all still in the full-precision window of "
                 f"R={cfg.residual_length}, so nothing is quantized yet; try a longer prompt)")
    print(line, file=sys.stderr)
    return 0
