"""`kivi generate --save-prefix FILE / --load-prefix FILE`: the options and their calls into :mod:`kivi.prefix`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..config import KiviConfig
from . import CliError
from .validators import output_path, text_value


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("saved prefixes (docs/python.md, \"Saved quantized prefixes\")")
    g = g.add_mutually_exclusive_group()
    g.add_argument("--save-prefix", metavar="FILE", default=None, type=output_path,
                   help="after the prompt's prefill, save its KIVI cache (packed, with the config and a fingerprint "
                        "of the model and tokenizer) to FILE, then generate as usual")
    g.add_argument("--load-prefix", metavar="FILE", default=None, type=text_value,
                   help="start from the cache saved in FILE (for this model and tokenizer); --prompt / --prompt-file "
                        "is appended after its tokens as plain text (no chat template); the KIVI configuration is "
                        "the file's (options given must match it)")


def check_prefix_args(args: argparse.Namespace) -> KiviConfig | None:
    """Before anything loads: --load-prefix's file must be a complete, intact kivi prefix file (--save-prefix's
    path is checked by its argparse type, :func:`kivi.cli.validators.output_path`). Returns the file's
    KiviConfig for --load-prefix, else ``None``."""
    if args.load_prefix:
        from ..cache.persist import read_header

        return read_header(Path(args.load_prefix).expanduser()).config
    return None


class PrefixSaver:
    """Saves the cache right after the prefill (``--save-prefix``); a failed write (a full disk, a folder
    removed meanwhile) is kept in :attr:`error` instead of stopping the generation, so the generated text
    is still printed and the command ends with that one line (exit 2)."""

    def __init__(self, path: Path, option: str, model: Any, tokenizer: Any, ids: Any):
        self.path, self.option, self.model, self.tokenizer, self.ids = path, option, model, tokenizer, ids
        self.error: str | None = None

    def __call__(self, cache: Any) -> None:
        from ..prefix import save_prefix

        try:
            save_prefix(self.path, cache, self.model, self.tokenizer, self.ids)
        except OSError as e:  # save_cache reports every failed write as an OSError (no partial file is left)
            reason = e.strerror or (str(e).splitlines() or [type(e).__name__])[0]
            self.error = f"--save-prefix {self.option!r} was not saved: {reason} (the generated text above is complete)"

    def check(self) -> None:
        """After the result is printed: raise the one-line error of a failed save."""
        if self.error is not None:
            raise CliError(self.error)


def prefix_inputs(args: argparse.Namespace, model: Any, tokenizer: Any, prompt: str, ids: Any
                  ) -> tuple[Any, dict[str, Any], dict[str, Any], PrefixSaver | None]:
    """``(input ids, extra generate() arguments, extra result fields, the --save-prefix saver or None)`` for
    the prefix options (none: unchanged). Call the saver's ``check()`` once the result is printed."""
    from ..cache.kivi_cache import KiviCache
    from ..prefix import SaveAfterPrefill, load_prefix

    if args.load_prefix:
        prefix = load_prefix(Path(args.load_prefix).expanduser(), model, tokenizer)
        if prefix.input_ids is None:
            raise CliError(f"--load-prefix {args.load_prefix!r} holds no token ids (saved without input_ids)")
        new = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        full = prefix.continuation_ids(new.to(prefix.input_ids.device))
        return full, {"cache": prefix.cache}, {"prefix_file": args.load_prefix,
                                               "prefix_tokens": prefix.input_ids.shape[-1]}, None
    if args.save_prefix:
        from transformers import LogitsProcessorList

        cache = KiviCache.from_model(model)
        saver = PrefixSaver(Path(args.save_prefix).expanduser(), args.save_prefix, model, tokenizer, ids)
        after = SaveAfterPrefill(cache, saver)
        return ids, {"cache": cache, "logits_processor": LogitsProcessorList([after])}, {
            "prefix_file": args.save_prefix, "prefix_tokens": ids.shape[-1]}, saver
    return ids, {}, {}, None
