"""Options and helpers shared by subcommands: model, text, evaluation protocol, KiviConfig, output."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import PRESETS, KiviConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="model alias (smollm2), local checkpoint folder, .gguf file or hub id (default: smollm2)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as loaded; float32 for GGUF)")
    p.add_argument("--weight-bits", type=int, default=16, choices=(16, 8, 4),
                   help="weights of the linear layers: 16 = as loaded, 8 / 4 = optimum-quanto qint8 / qint4 "
                   "(pip install 'kivi[quanto]'); docs/weight-quantization.md (default: 16)")


def add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="text file to evaluate on (default: the shipped WikiText-2 test split)")


def add_window_args(p: argparse.ArgumentParser, *, windows: int = 20) -> None:
    g = p.add_argument_group("evaluation protocol")
    g.add_argument("--context", type=int, default=1024, help="tokens per window (default: 1024)")
    g.add_argument("--prefix", type=int, default=512, help="tokens prefilled per window, not scored (default: 512)")
    g.add_argument("--chunk", type=int, default=16, help="tokens per forward after the prefix (default: 16)")
    g.add_argument("--windows", type=int, default=windows, help=f"number of windows (default: {windows})")
    g.add_argument("--batch-size", type=int, default=1, help="windows per forward (same numbers; default: 1)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("-o", "--output", default=None, help="also write the JSON result to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_config_args(p: argparse.ArgumentParser, *, default_preset: str | None = None) -> None:
    g = p.add_argument_group("KIVI configuration (a preset, individual fields, or a JSON file)")
    g.add_argument("--preset", default=default_preset, help=f"one of {list(PRESETS)}")
    g.add_argument("--config", default=None, help="KiviConfig JSON file (e.g. written by `kivi tune`)")
    g.add_argument("--k-bits", type=int, default=None)
    g.add_argument("--v-bits", type=int, default=None)
    g.add_argument("--group-size", type=int, default=None)
    g.add_argument("--residual-length", type=int, default=None)
    g.add_argument("--residual-bits", type=int, default=None, help="the spec's per-group error compensation (0 = off)")
    g.add_argument("--sink-tokens", type=int, default=None, help="first tokens kept in full precision (0 = off)")
    g.add_argument("--no-quantize-key", action="store_true", help="keep keys in full precision")
    g.add_argument("--no-quantize-value", action="store_true", help="keep values in full precision")
    g.add_argument("--symmetric", action="store_true", help="symmetric quantization (for comparison)")
    g.add_argument("--attention-backend", default=None, help="auto | reference | cpu | triton")


def config_from_args(args: argparse.Namespace) -> KiviConfig | None:
    """The KiviConfig the options describe, or ``None`` when none was given."""
    fields: dict[str, Any] = {}
    for name in ("k_bits", "v_bits", "group_size", "residual_length", "residual_bits", "sink_tokens",
                 "attention_backend"):
        v = getattr(args, name, None)
        if v is not None:
            fields[name] = v
    if getattr(args, "no_quantize_key", False):
        fields["quantize_key"] = False
    if getattr(args, "no_quantize_value", False):
        fields["quantize_value"] = False
    if getattr(args, "symmetric", False):
        fields["symmetric"] = True
    preset = getattr(args, "preset", None)
    cfg_file = getattr(args, "config", None)
    if preset and cfg_file:
        raise ValueError("give either --preset or --config, not both")
    if cfg_file:
        base = KiviConfig.from_json(cfg_file).to_dict()
        return KiviConfig.from_dict({**base, **fields})
    if preset:
        return KiviConfig.preset(preset, **fields)
    if fields:
        return KiviConfig(**fields)
    return None


def set_cpu_threads(n: int) -> None:
    """``n`` CPU threads for torch and, when numba is loaded, for kivi's numba kernels.

    Call it after the kernels are compiled / loaded (``kivi.attention.fused_cpu.warmup()``): loading
    numba's OpenMP threading layer can reset torch's thread count to numba's (measured: after
    ``torch.set_num_threads(1)`` and the kernel load, ``torch.get_num_threads()`` was 2), and
    oversubscribed CPU threads make decoding several times slower.
    """
    import torch

    if "numba" in sys.modules:
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    torch.set_num_threads(n)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def emit(args: argparse.Namespace, result: Any, human: str) -> None:
    """Write ``result`` to ``--output`` (when given), then print it as JSON (``--json``) or ``human``."""
    if getattr(args, "output", None):
        Path(args.output).write_text(json.dumps(result, indent=2, default=str) + "\n")
    if getattr(args, "json", False):
        print_json(result)
    else:
        print(human)


def load_model_and_windows(args: argparse.Namespace):
    """``(model, tokenizer, windows)`` from the model, text and protocol options (``add_model_args``,
    ``add_text_args``, ``add_window_args``); bad option values fail before anything is loaded."""
    from ..data import load_text, token_windows

    for name in ("context", "prefix", "chunk", "windows", "batch_size"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if args.prefix >= args.context:
        raise ValueError(f"--prefix {args.prefix} must be smaller than --context {args.context} (nothing left to score)")
    text = load_text(args.text)  # fail on a bad path before loading the model
    model, tok = load_model_from_args(args)
    check_context_fits(model, args.context, "--context")
    return model, tok, token_windows(tok, text, args.context, args.windows)


def load_model_from_args(args: argparse.Namespace):
    """``(model, tokenizer)`` of the model options (``add_model_args``), weights quantized to ``--weight-bits``."""
    from ..models import load_model, quantize_weights

    model, tok = load_model(args.model, dtype=args.dtype)
    return quantize_weights(model, getattr(args, "weight_bits", 16)), tok


def check_context_fits(model: Any, tokens: int, what: str) -> None:
    """Raise ``ValueError`` when ``tokens`` (described by ``what``) exceed the model's context length."""
    from ..models import model_max_context

    max_ctx = model_max_context(model)
    if tokens > max_ctx:
        raise ValueError(f"{what} needs {tokens:,} tokens, longer than the model supports ({max_ctx:,} tokens, "
                         "max_position_embeddings)")
