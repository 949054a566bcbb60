"""Options, validators and helpers shared by subcommands: model, text, evaluation protocol,
KiviConfig, output.

Every argument is checked here, before any model loads:

* argparse ``type=`` validators (:func:`positive_int`, :func:`non_negative_int`,
  :func:`finite_float`, :func:`seed`, :func:`byte_size`, :func:`token_count`, :func:`output_path`,
  :func:`utf8_text`, ...) turn a bad value into one line that names the option, the value and what
  is allowed (``kivi demo: error: argument --threads: -1 is not a positive integer``), exit 2;
* KIVI options and ``--config`` files go through :class:`kivi.config.KiviConfig`'s validation
  (:func:`config_from_args`), the one set of rules the Python API and JSON files use too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..config import PRESETS, KiviConfig
from ..memory.weights import WEIGHT_BITS
from .errors import CliError


# --------------------------------------------------------------------------- the parser
class KiviArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``kivi demo: error: argument --threads: ...``)
    raised as :class:`kivi.cli.CliError`, so that :func:`kivi.cli.main` prints and returns 2."""

    def error(self, message: str):  # type: ignore[override]
        raise CliError(f"{message} (see {self.prog} --help)", prog=self.prog)


# --------------------------------------------------------------------------- argparse validators
def _int(text: str, what: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    v = _int(text, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not a positive integer (1, 2, ...)")
    return v


def non_negative_int(text: str) -> int:
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is not an integer >= 0")
    return v


#: Seeds torch.manual_seed accepts (it overflows above 2**64 - 1; negative seeds are refused here).
MAX_SEED = 2**64 - 1


def seed(text: str) -> int:
    v = _int(text, f"a seed (an integer from 0 to {MAX_SEED})")
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{v} is out of range; a seed is an integer from 0 to 2**64-1 ({MAX_SEED})")
    return v


def finite_float(text: str) -> float:
    try:
        v = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def non_negative_float(text: str) -> float:
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; give a finite number >= 0")
    return v


def positive_float(text: str) -> float:
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return v


def port_number(text: str) -> int:
    v = _int(text, "a port number (0..65535)")
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a port number (0..65535)")
    return v


def token_count(text: str) -> int:
    """``32768``, ``32k``, ``128K``, ``1m`` (k = 1024 tokens) -> a positive int."""
    from ..memory.units import parse_context

    try:
        return parse_context(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive token count; use e.g. 32768, 32k, 128K or 1m") from None


def byte_size(text: str) -> int:
    """``80GB`` (10^9), ``80GiB`` / ``80G`` (2^30), ``512MB``, or a byte count -> a positive int."""
    from ..memory.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size; use e.g. 80GB, 80GiB, 24G, 512MB or a byte count") from None


def utf8_text(text: str) -> str:
    """Command-line text must be UTF-8 (Python hands other bytes over as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(
            f"is not UTF-8 text (byte 0x{raw[0]:02x} at character {e.start})") from None
    return text


def int_list(text: str) -> list[int]:
    """``"1024,2048"`` -> positive ints."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    try:
        values = [positive_int(x) for x in items]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1024,2048")
    return values


def fraction_list(text: str) -> list[float]:
    """``"0.1,0.5"`` -> numbers in [0, 1]."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    try:
        values = [finite_float(x) for x in items]
    except argparse.ArgumentTypeError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated fractions between 0 and 1, e.g. 0.1,0.5,0.9")
    return values


def output_path(text: str) -> str:
    """A file the command will write: its folder exists and is writable, and it is not a folder.

    Checked when the arguments are parsed, before any work (a long evaluation must not end in an
    unwritable path)."""
    text = utf8_text(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty")
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(parent)!r} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(parent)!r} is not writable")
    return text


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg}); e.g. '{{\"k_bits\": 4}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; e.g. '{{\"k_bits\": 4}}'")
    return value


#: dtype names the model loader accepts (kivi.models.DTYPE_NAMES, without importing torch here).
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")


def model_dtype(text: str) -> str:
    if str(text).lower() not in MODEL_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {list(MODEL_DTYPES)}")
    return str(text).lower()


# --------------------------------------------------------------------------- option groups
def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", type=utf8_text,
                   help="model alias (smollm2), local checkpoint folder, .gguf file or hub id (default: smollm2)")
    p.add_argument("--dtype", default=None, type=model_dtype,
                   help="float32 | bfloat16 | float16 (default: as loaded; float32 for GGUF)")
    p.add_argument("--weight-bits", type=int, default=16, choices=WEIGHT_BITS,
                   help="weights of the linear layers: 16 = as loaded, 8 / 4 = optimum-quanto qint8 / qint4 "
                   "(pip install 'kivi[quanto]'); docs/weight-quantization.md (default: 16)")


def add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="text file to evaluate on (default: the shipped WikiText-2 test split)")


def add_window_args(p: argparse.ArgumentParser, *, windows: int = 20) -> None:
    g = p.add_argument_group("evaluation protocol")
    g.add_argument("--context", type=positive_int, default=1024, help="tokens per window (default: 1024)")
    g.add_argument("--prefix", type=positive_int, default=512, help="tokens prefilled per window, not scored (default: 512)")
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
    g.add_argument("--preset", default=default_preset, help=f"one of {list(PRESETS)}")
    g.add_argument("--config", default=None, help="KiviConfig JSON file (e.g. written by `kivi tune`)")
    # ranges are KiviConfig's (one set of rules for the CLI, the Python API and JSON files)
    g.add_argument("--k-bits", type=int, default=None)
    g.add_argument("--v-bits", type=int, default=None)
    g.add_argument("--group-size", type=int, default=None)
    g.add_argument("--residual-length", type=int, default=None)
    g.add_argument("--residual-bits", type=int, default=None, help="the spec's per-group error compensation (0 = off)")
    g.add_argument("--sink-tokens", type=int, default=None, help="first tokens kept in full precision (0 = off)")
    g.add_argument("--quantize-after", type=int, default=None, metavar="N",
                   help="full precision until the cache holds more than N tokens, then KIVI (0 = off; "
                        "docs/length-policy.md)")
    g.add_argument("--no-quantize-key", action="store_true", help="keep keys in full precision")
    g.add_argument("--no-quantize-value", action="store_true", help="keep values in full precision")
    g.add_argument("--symmetric", action="store_true", help="symmetric quantization (for comparison)")
    g.add_argument("--clip", nargs="?", const="both", default=None, choices=["both", "keys", "values"],
                   help="MSE-optimal clipping of group ranges, both sides (bare --clip) or one; same bytes "
                        "(docs/quality.md)")
    g.add_argument("--attention-backend", default=None, help="auto | reference | cpu | triton")


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
        raise CliError(f"--attention-backend {cfg.attention_backend}: {_first_line(e)} "
                       "(the kivi command line runs models on the CPU: use 'cpu' or 'reference')") from None


def config_from_args(args: argparse.Namespace) -> KiviConfig | None:
    """The KiviConfig the options describe, or ``None`` when none was given."""
    fields: dict[str, Any] = {}
    for name in ("k_bits", "v_bits", "group_size", "residual_length", "residual_bits", "sink_tokens",
                 "quantize_after", "attention_backend"):
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


# --------------------------------------------------------------------------- output
def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def print_rich(renderable: Any, *, width: int = 120) -> None:
    """Print a rich renderable through ``sys.stdout``: rich writing to a closed pipe itself would
    exit 1 on its own (``Console.on_broken_pipe``); captured, a broken pipe reaches
    :func:`kivi.cli.main` like any other write (exit 141)."""
    from rich.console import Console

    console = Console(width=max(width, Console().width), file=sys.stdout)
    with console.capture() as cap:
        console.print(renderable)
    sys.stdout.write(cap.get())


def write_json_file(path: str, obj: Any) -> None:
    Path(path).expanduser().write_text(json.dumps(obj, indent=2, default=str) + "\n")


Write = tuple[str, str, Callable[[str], Any]]  # (flag, path, writer(path))


def write_outputs(writes: list[Write]) -> list[str]:
    """Run each ``(flag, path, writer)``; returns one message per write that failed (never raises on OSError)."""
    failed = []
    for flag, path, writer in writes:
        if not path:
            continue
        try:
            writer(path)
        except OSError as e:
            failed.append(f"cannot write {flag} {path!r}: {e.strerror or e}")
    return failed


def emit(args: argparse.Namespace, result: Any, human: str, writes: list[Write] | None = None) -> None:
    """Write ``result`` to ``--output`` (when given) and the ``writes``, then print it as JSON
    (``--json``) or ``human``, followed by a ``wrote PATH`` line per file written. A write that fails
    does not drop the result: it is printed (as JSON too when it was shown as text), then one error
    line names what could not be written (exit 2)."""
    all_writes = [("-o/--output", getattr(args, "output", None), lambda p: write_json_file(p, result))]
    all_writes += list(writes or [])
    failed = write_outputs(all_writes)
    if getattr(args, "json", False):
        print_json(result)
    else:
        print(human)
        for flag, path, _ in writes or []:
            if path and not any(repr(path) in f for f in failed):
                print(f"wrote {path}")
        if failed:
            print_json(result)
    if failed:
        raise CliError("; ".join(failed) + " — the result was printed on stdout instead")


# --------------------------------------------------------------------------- model and text
def load_model_and_windows(args: argparse.Namespace):
    """``(model, tokenizer, windows)`` from the model, text and protocol options (``add_model_args``,
    ``add_text_args``, ``add_window_args``); bad option values fail before anything is loaded."""
    from ..data import load_text, token_windows

    check_window_args(args)
    text = load_text(args.text)  # fail on a bad path before loading the model
    model, tok = load_model_from_args(args)
    check_context_fits(model, args.context, "--context")
    return model, tok, token_windows(tok, text, args.context, args.windows, first=args.first_window)


def check_window_args(args: argparse.Namespace) -> None:
    """Checks across the protocol options (each one alone is checked by its argparse type)."""
    if args.prefix >= args.context:
        raise ValueError(f"--prefix {args.prefix} must be smaller than --context {args.context} (nothing left to score)")


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
