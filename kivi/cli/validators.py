"""The one set of argparse ``type=`` functions of the command line.

Each turns a bad value into one line that names the option, the value and what is allowed
(``kivi demo: error: argument --threads: -1 is not a positive integer``, exit 2), when the arguments
are parsed, before any model loads.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from ..files import check_write_target


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


def shard(text: str) -> tuple[int, int]:
    """``I/N`` (``0 <= I < N``: shard ``I`` of ``N``) -> ``(I, N)``."""
    i, sep, n = str(text).strip().partition("/")
    try:
        pair = (int(i), int(n)) if sep else None
    except ValueError:
        pair = None
    if pair is None or not 0 <= pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard I/N with 0 <= I < N (e.g. 0/2 and 1/2)")
    return pair


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


def text_value(text: str) -> str:
    """The one rule for every string option (a path, a name, a list): UTF-8 (:func:`utf8_text`) and not empty
    or blank. ``--load-prefix "$UNSET"`` is an error naming the option, never the option left off."""
    text = utf8_text(text)
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a value, or leave the option out")
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
    """A file the command will write (:func:`text_value`): kivi's writer would write there
    (:func:`kivi.files.check_write_target`: not a folder, a FIFO, a device, a socket, nor a symlink to one;
    its folder exists), and the folder (or the file) is writable.

    Checked when the arguments are parsed, before any work (a long evaluation must not end in an
    unwritable path); the writer checks again when it writes."""
    text = text_value(text)
    try:
        path = check_write_target(text)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    parent = path.parent
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


#: dtype names the model loader accepts (kivi.models.load.DTYPE_NAMES, without importing torch here).
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")


def model_dtype(text: str) -> str:
    if str(text).lower() not in MODEL_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {list(MODEL_DTYPES)}")
    return str(text).lower()


__all__ = ["MAX_SEED", "MODEL_DTYPES", "byte_size", "finite_float", "fraction_list", "int_list", "json_object",
           "longctx_config", "model_dtype", "non_negative_float", "non_negative_int", "output_path", "port_number",
           "positive_float", "positive_int", "seed", "text_value", "token_count", "utf8_text"]


def longctx_config(text: str):
    """One ``kivi eval longctx --configs`` entry -> ``(label, spec)``: ``fp``, a preset, a quanto or hqq
    baseline (its package installed) or a KiviConfig JSON file (:func:`kivi.eval.longctx.configs.resolve_config`)."""
    from ..eval.longctx.configs import resolve_config

    try:
        return resolve_config(text_value(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
