"""Options shared by subcommands (model, text, evaluation protocol, output, KiviConfig) and the parser
whose errors are one line.

Each option's value is checked by its type from :mod:`kivi.cli.validators`; the checks across options
(:func:`check_window_args`) and the KIVI options and ``--config`` files (:func:`config_from_args`, through
:class:`kivi.config.KiviConfig`'s validation, the one set of rules the Python API and JSON files use too)
run before any model loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..config import PRESETS, KiviConfig
from ..files import DEFAULT_MAX_TEXT_BYTES
from ..memory.weights import WEIGHT_BITS
from ..quant.rotation import KEY_ROTATIONS
from .errors import CliError
from .validators import byte_size, model_dtype, non_negative_int, output_path, positive_int, text_value


class KiviArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``kivi demo: error: argument --threads: ...``)
    raised as :class:`kivi.cli.CliError`, so that :func:`kivi.cli.main` prints and returns 2."""

    def error(self, message: str):  # type: ignore[override]
        raise CliError(f"{message} (see {self.prog} --help)", prog=self.prog)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", type=text_value,
                   help="model alias (smollm2), local checkpoint folder, .gguf file or hub id (default: smollm2)")
    p.add_argument("--dtype", default=None, type=model_dtype,
                   help="float32 | bfloat16 | float16 (default: as loaded; float32 for GGUF)")
    p.add_argument("--weight-bits", type=int, default=16, choices=WEIGHT_BITS,
                   help="weights of the linear layers: 16 = as loaded, 8 / 4 = optimum-quanto qint8 / qint4 "
                   "(pip install 'kivi[quanto]'); docs/python.md, \"KIVI on weight-quantized models\" (default: 16)")


def add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, type=text_value,
                   help="text file to evaluate on, '-' = stdin (default: the shipped WikiText-2 test split)")
    add_max_text_bytes_arg(p, "--text")


def add_max_text_bytes_arg(p: argparse.ArgumentParser, option: str) -> None:
    """``--max-text-bytes``: the bound of the one text reader (:func:`kivi.files.read_text`) for ``option``."""
    p.add_argument("--max-text-bytes", default=DEFAULT_MAX_TEXT_BYTES, type=byte_size, metavar="SIZE",
                   help=f"read at most this much of {option} (e.g. 256MiB; default 64MiB: more text than any "
                   "model's context holds); an endless file or pipe stops there with one line")


def add_window_args(p: argparse.ArgumentParser, *, windows: int = 20) -> None:
    g = p.add_argument_group("evaluation protocol")
    g.add_argument("--context", type=positive_int, default=1024, help="tokens per window (default: 1024)")
    g.add_argument(
        "--prefix", type=positive_int, default=512, help="tokens prefilled per window, not scored (default: 512)"
    )
    g.add_argument("--chunk", type=positive_int, default=16, help="tokens per forward after the prefix (default: 16)")
    g.add_argument("--windows", type=positive_int, default=windows, help=f"number of windows (default: {windows})")
    g.add_argument("--first-window", type=non_negative_int, default=0,
                   help="skip this many windows of the text first, e.g. 20 to profile or tune on text that the "
                        "20-window evaluation never sees (default: 0)")
    g.add_argument("--batch-size", type=positive_int, default=1, help="windows per forward (same numbers; default: 1)")
    g.add_argument("--reference-eval", action="store_true",
                   help="slow reference protocol: every cache runs its own prefill and --chunk tokens per forward, "
                   "KIVI read through the reference attention (default: shared FP prefill, packed attention, "
                   "512-token forwards for FP/KIVI; same numbers up to float rounding, docs/evaluation.md)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("-o", "--output", default=None, type=output_path,
                   help="also write the JSON result to this file (checked before the work starts)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_config_args(p: argparse.ArgumentParser, *, default_preset: str | None = None) -> None:
    g = p.add_argument_group("KIVI configuration (a preset, individual fields, or a JSON file)")
    g.add_argument("--preset", default=default_preset, type=text_value, help=f"one of {list(PRESETS)}")
    g.add_argument("--config", default=None, type=text_value, help="KiviConfig JSON file (e.g. written by `kivi tune`)")
    # ranges are KiviConfig's (one set of rules for the CLI, the Python API and JSON files)
    g.add_argument("--k-bits", type=int, default=None)
    g.add_argument("--v-bits", type=int, default=None)
    g.add_argument("--group-size", type=int, default=None)
    g.add_argument("--residual-length", type=int, default=None)
    g.add_argument("--residual-bits", type=int, default=None, help="the spec's per-group error compensation (0 = off)")
    g.add_argument("--sink-tokens", type=int, default=None, help="first tokens kept in full precision (0 = off)")
    g.add_argument("--quantize-after", type=int, default=None, metavar="N",
                   help="full precision until the cache holds more than N tokens, then KIVI (0 = off; "
                        "docs/python.md, \"Precision chosen from the request's length\")")
    g.add_argument("--no-quantize-key", action="store_true", help="keep keys in full precision")
    g.add_argument("--no-quantize-value", action="store_true", help="keep values in full precision")
    g.add_argument("--symmetric", action="store_true", help="symmetric quantization (for comparison)")
    g.add_argument("--clip", nargs="?", const="both", default=None, choices=["both", "keys", "values"],
                   help="MSE-optimal clipping of group ranges, both sides (bare --clip) or one; same bytes "
                        "(docs/python.md, \"Quality per bit\")")
    g.add_argument("--key-rotation", default=None, choices=list(KEY_ROTATIONS),
                   help="rotate each head's keys before quantizing them (hadamard: Walsh-Hadamard with fixed signs; "
                        "read by the 'reference' backend; docs/python.md, \"Rotated keys\")")
    g.add_argument("--attention-backend", default=None, type=text_value, help="auto | reference | cpu | triton")


def load_config_file(path: str, flag: str = "--config") -> KiviConfig:
    """A KiviConfig JSON file; any problem (missing, binary, not JSON, bad field) is one line naming ``flag``."""
    try:
        return KiviConfig.from_json(Path(path))
    except (ValueError, TypeError) as e:
        raise CliError(f"{flag} {path!r}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_cli_backend(cfg: KiviConfig) -> None:
    """The command line runs models on the CPU: an explicit backend that cannot run there is refused
    now, before the model loads (``kivi.backends.resolve_attention_backend``, the one rule)."""
    if cfg.attention_backend == "auto":
        return
    from ..backends import resolve_attention_backend

    try:
        resolve_attention_backend(cfg.attention_backend, "cpu", config=cfg)
    except (RuntimeError, ValueError) as e:
        line = _first_line(e)
        hint = "" if "; use '" in line else ": use 'cpu' or 'reference'"  # the backend's own advice stands
        raise CliError(f"--attention-backend {cfg.attention_backend}: {line} "
                       f"(the kivi command line runs models on the CPU{hint})") from None


def config_from_args(args: argparse.Namespace) -> KiviConfig | None:
    """The KiviConfig the options describe, or ``None`` when none was given."""
    fields: dict[str, Any] = {}
    for name in ("k_bits", "v_bits", "group_size", "residual_length", "residual_bits", "sink_tokens",
                 "quantize_after", "key_rotation", "attention_backend"):
        v = getattr(args, name, None)
        if v is not None:
            fields[name] = v
    if getattr(args, "no_quantize_key", False):
        fields["quantize_key"] = False
    if getattr(args, "no_quantize_value", False):
        fields["quantize_value"] = False
    if getattr(args, "symmetric", False):
        fields["symmetric"] = True
    clip = getattr(args, "clip", None)
    if clip:
        fields["clip"] = True if clip == "both" else clip
    preset = getattr(args, "preset", None)
    cfg_file = getattr(args, "config", None)
    if preset and cfg_file:
        raise ValueError("give either --preset or --config, not both")
    if cfg_file:
        base = load_config_file(cfg_file).to_dict()
        cfg = KiviConfig.from_dict({**base, **fields})
    elif preset:
        cfg = KiviConfig.preset(preset, **fields)
    elif fields:
        cfg = KiviConfig(**fields)
    else:
        return None
    check_cli_backend(cfg)
    return cfg


def check_window_args(args: argparse.Namespace) -> None:
    """Checks across the protocol options (each one alone is checked by its argparse type)."""
    if args.prefix >= args.context:
        raise ValueError(
            f"--prefix {args.prefix} must be smaller than --context {args.context} (nothing left to score)"
        )


__all__ = ["KiviArgumentParser", "add_config_args", "add_max_text_bytes_arg", "add_model_args", "add_output_args",
           "add_text_args", "add_window_args", "check_cli_backend", "check_window_args", "config_from_args",
           "load_config_file"]
