"""Evaluation text and fixed-length token windows.

The default text is the WikiText-2 raw test split shipped beside this module in ``kivi/data/`` (CC BY-SA 3.0; see
``kivi/data/README.md`` for the attribution).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ..files import DEFAULT_MAX_TEXT_BYTES, read_text

__all__ = ["DATA_DIR", "DEFAULT_TEXT_FILE", "default_text_path", "load_text", "token_ids", "token_windows"]

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_TEXT_FILE = "wikitext-2-raw-test.txt"

_TOKEN_CACHE: OrderedDict[tuple[str, int, str], torch.Tensor] = OrderedDict()
_TOKEN_CACHE_SIZE = 8  # distinct (tokenizer, text) pairs kept in memory; ~2.4 MB each for WikiText-2


def default_text_path() -> Path:
    """Path of the shipped WikiText-2 raw test split."""
    return DATA_DIR / DEFAULT_TEXT_FILE


def load_text(path: str | os.PathLike | None = None, *, option: str = "text file",
              max_bytes: int = DEFAULT_MAX_TEXT_BYTES, raise_bound: str | None = None) -> str:
    """Read a UTF-8 text file, ``-`` (stdin) or a FIFO (``None``: the shipped WikiText-2 test split), with at
    most ``max_bytes`` bytes (:func:`kivi.files.read_text`, the one bounded reader; ``option`` and
    ``raise_bound`` name the input and the option that raises the bound in its errors).

    Line endings are normalised to ``\\n``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a readable UTF-8 text file, is longer than ``max_bytes``, or holds no text.
    """
    file = default_text_path() if path is None else path
    if path is None and not default_text_path().exists():
        raise FileNotFoundError(f"text file not found: {file} (the shipped data file is missing: reinstall kivi)")
    text = read_text(file, option=option, max_bytes=max_bytes, raise_bound=raise_bound)
    if not text.strip():
        raise ValueError(f"{option} {os.fsdecode(file)!r} is empty: it has no text to evaluate on")
    return text


def token_ids(tokenizer: Any, text: str) -> torch.Tensor:
    """All token ids of ``text`` (no special tokens), shape ``[n_tokens]``.

    Tokenizing the whole WikiText-2 split takes seconds, so the result is cached in-process per
    (tokenizer name, vocabulary size, text); the returned tensor is shared with that cache: do not
    modify it in place (:func:`token_windows` returns a copy).
    """
    name = getattr(tokenizer, "name_or_path", "") or f"<unnamed {type(tokenizer).__name__} at {id(tokenizer):#x}>"
    key = (name, len(tokenizer), hashlib.sha1(text.encode("utf-8")).hexdigest())
    ids = _TOKEN_CACHE.get(key)
    if ids is None:
        # verbose=False: the text is far longer than model_max_length on purpose; it is cut into windows.
        encoded = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids = torch.tensor(encoded, dtype=torch.long)
        _TOKEN_CACHE[key] = ids
        while len(_TOKEN_CACHE) > _TOKEN_CACHE_SIZE:
            _TOKEN_CACHE.popitem(last=False)
    else:
        _TOKEN_CACHE.move_to_end(key)
    return ids


def token_windows(
    tokenizer: Any,
    text: str,
    context: int,
    num_windows: int,
    *,
    stride: int | None = None,
    first: int = 0,
) -> torch.LongTensor:
    """Cut ``text`` into ``num_windows`` token windows of length ``context``.

    The text is tokenized once without special tokens (cached in-process per tokenizer name and
    text). Window ``i`` holds tokens ``[(first + i) * stride, (first + i) * stride + context)``: the
    windows after the first ``first`` ones (``first=20`` gives text that a 20-window evaluation never
    saw, e.g. to profile or tune on); ``stride`` defaults to ``context`` (consecutive, non-overlapping
    windows). The result is deterministic.

    Returns:
        ``torch.LongTensor`` of shape ``[num_windows, context]`` (a fresh tensor, safe to modify).

    Raises:
        ValueError: a non-positive argument, or the text has too few tokens for the request.
    """
    for arg, value in (("context", context), ("num_windows", num_windows), ("stride", stride)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"first must be a non-negative integer, got {first!r}")
    stride = context if stride is None else stride

    ids = token_ids(tokenizer, text)
    needed = (first + num_windows - 1) * stride + context
    if ids.numel() < needed:
        skip = f" after skipping {first} window(s)" if first else ""
        raise ValueError(
            f"text too short: it has {ids.numel()} tokens, but {num_windows} window(s) of {context} tokens "
            f"with stride {stride}{skip} need {needed}; use fewer/shorter windows or a longer text"
        )
    return ids.unfold(0, context, stride)[first : first + num_windows].clone()
