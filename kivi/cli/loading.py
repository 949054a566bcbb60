"""The model (and evaluation windows) a subcommand runs on, loaded from its options."""

from __future__ import annotations

import argparse
from typing import Any

from .options import check_window_args


def load_model_and_windows(args: argparse.Namespace):
    """``(model, tokenizer, windows)`` from the model, text and protocol options (``add_model_args``,
    ``add_text_args``, ``add_window_args``); bad option values fail before anything is loaded."""
    from ..data import token_windows

    check_window_args(args)
    text = read_text_arg(args)  # fail on a bad path before loading the model
    model, tok = load_model_from_args(args)
    check_context_fits(model, args.context, "--context")
    return model, tok, token_windows(tok, text, args.context, args.windows, first=args.first_window)


def read_text_arg(args: argparse.Namespace) -> str:
    """The evaluation text of ``--text`` (``add_text_args``): the shipped WikiText-2 split by default, read
    with at most ``--max-text-bytes`` (:func:`kivi.data.load_text`, the one bounded reader)."""
    from ..data import load_text

    return load_text(args.text, option="--text", max_bytes=args.max_text_bytes, raise_bound="--max-text-bytes")


def load_model_from_args(args: argparse.Namespace):
    """``(model, tokenizer)`` of the model options (``add_model_args``), weights quantized to ``--weight-bits``."""
    from ..models.load import load_model
    from ..models.weights import quantize_weights

    model, tok = load_model(args.model, dtype=args.dtype)
    return quantize_weights(model, getattr(args, "weight_bits", 16)), tok


def check_context_fits(model: Any, tokens: int, what: str) -> None:
    """Raise ``ValueError`` when ``tokens`` (described by ``what``) exceed the model's context length."""
    from ..models.load import model_max_context

    max_ctx = model_max_context(model)
    if tokens > max_ctx:
        raise ValueError(f"{what} needs {tokens:,} tokens, longer than the model supports ({max_ctx:,} tokens, "
                         "max_position_embeddings)")


__all__ = ["check_context_fits", "load_model_and_windows", "load_model_from_args"]
