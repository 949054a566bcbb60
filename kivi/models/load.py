"""Loading causal language models and their tokenizers.

:func:`load_model` accepts, in this order:

1. an alias from :data:`kivi.models.aliases.KNOWN_ALIASES` (case-insensitive); ``"smollm2"`` is the embedded
   default (:mod:`kivi.models.aliases`);
2. a path to a ``.gguf`` file, loaded from its converted copy when one exists
   (:mod:`kivi.models.conversion_cache`), else converted and the copy kept;
3. a local checkpoint folder holding a ``config.json``;
4. anything else is tried as a Hugging Face hub id.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from .aliases import KNOWN_ALIASES, alias_gguf_path
from .conversion_cache import converted_cache_path, gguf_sha256, reuse_converted, write_converted
from .errors import ModelLoadError, short_reason

logger = logging.getLogger(__name__)

#: Strings accepted for the ``dtype`` argument of :func:`load_model`.
DTYPE_NAMES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"invalid dtype={dtype!r}: expected None, a torch.dtype, or one of {sorted(DTYPE_NAMES)}")


def _require_gguf_support(what: str) -> None:
    """Fail clearly if the packages transformers needs to read GGUF files are missing."""
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ModelLoadError(
            f"loading {what} from GGUF needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)}  (or pip install 'kivi[gguf]')"
        )


def _finish(model: Any, tokenizer: Any, dtype: torch.dtype | str | None, device: str | torch.device) -> tuple[Any, Any]:
    """Cast (if asked), move, set eval mode, and give the tokenizer a pad token."""
    if isinstance(dtype, torch.dtype) and model.dtype != dtype:
        model = model.to(dtype)
    model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        # Batched evaluation needs a pad token; padded positions are masked, so EOS is a safe stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _drop_gguf_quantization(model: Any) -> None:
    """Make a GGUF-loaded model savable with ``save_pretrained``.

    transformers attaches a ``GgufHfQuantizer`` as ``model.hf_quantizer`` (and its ``GgufConfig`` as
    ``model.config.quantization_config``). ``save_pretrained`` refuses any model whose quantizer is
    not serializable, and a saved ``quantization_config`` would make the copy reload as GGUF. The
    weights are already dequantized, so both are dropped with the quantizer's own
    ``remove_quantization_config`` (which also clears ``is_quantized``, ``quantization_method`` and
    the GGUF weight-renaming ops).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _load_gguf(
    gguf: Path,
    dtype: torch.dtype | str | None,
    device: str | torch.device,
    cache_dir: str | os.PathLike | None,
    label: str,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = converted_cache_path(gguf, cache_dir)
    if reuse_converted(gguf, converted):  # its files checked against its manifest
        logger.info("loading %s from its converted copy at %s", label, converted)
        try:
            model = AutoModelForCausalLM.from_pretrained(converted)
            tokenizer = AutoTokenizer.from_pretrained(converted)
        except Exception as error:  # noqa: BLE001 - damage the cheap check cannot see (the weights' bytes): a miss
            logger.warning("the converted copy %s of %s could not be loaded (%s): converting again over it",
                           converted, label, short_reason(error))
        else:
            return _finish(model, tokenizer, dtype, device)

    _require_gguf_support(label)
    logger.info("converting %s from %s (one-time, dequantizes the GGUF weights)", label, gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _drop_gguf_quantization(model)
    from safetensors import SafetensorError

    try:
        write_converted(model, tokenizer, converted, gguf, sha256=gguf_sha256(gguf, cache_dir))
        logger.info("saved the converted copy of %s at %s", label, converted)
    except (OSError, SafetensorError) as error:  # a read-only or full cache must not stop the load itself;
        # SafetensorError: how save_pretrained's weights writer reports a failed write (a full disk). No partial
        # copy is left (write_converted removes its temporary folder); the next load converts again.
        logger.warning("could not save a converted copy of %s at %s (loading without it; the next load converts "
                       "again): %s", label, converted, short_reason(error))
    return _finish(model, tokenizer, dtype, device)


def _load_pretrained(
    source: str | Path, dtype: torch.dtype | str | None, device: str | torch.device
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return _finish(model, tokenizer, dtype, device)


def load_model(
    name_or_path: str | os.PathLike = "smollm2",
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: an alias (``"smollm2"``, see :data:`KNOWN_ALIASES`), a ``.gguf`` file, a local
            checkpoint folder with a ``config.json``, or a Hugging Face hub id.
        dtype: ``None`` keeps what the checkpoint loads as (float32 for GGUF); otherwise a
            ``torch.dtype`` or one of ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``.
        device: where to put the model.
        cache_dir: root of the converted-copy cache for GGUF models (default :func:`kivi_cache_dir`).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode. If the tokenizer has no pad token, its
        EOS token is set as the pad token.

    Raises:
        ValueError: ``dtype`` is not a valid value.
        ModelLoadError: the model could not be found or loaded (the message says what was tried).
    """
    resolved_dtype = _resolve_dtype(dtype)
    name = os.fspath(name_or_path)
    key = name.strip().lower()

    if key in KNOWN_ALIASES:
        return _load_gguf(alias_gguf_path(key), resolved_dtype, device, cache_dir, label=f"model {name!r}")

    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _load_gguf(path.resolve(), resolved_dtype, device, cache_dir, label=f"GGUF file {path.name!r}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {str(path)!r} has no config.json, so it is not a transformers checkpoint"
            )
        try:
            return _load_pretrained(path, resolved_dtype, device)
        except Exception as error:
            reason = short_reason(error)
            raise ModelLoadError(f"could not load the checkpoint folder {str(path)!r}: {reason}") from error

    try:
        return _load_pretrained(name, resolved_dtype, device)
    except Exception as error:
        raise ModelLoadError(
            f"unknown model {name!r}: not an alias (known: {', '.join(KNOWN_ALIASES)}), not a local folder "
            f"or .gguf file, and loading it from the Hugging Face hub failed: {short_reason(error)}"
        ) from error


def model_max_context(model: Any) -> int:
    """The longest context (in tokens) the model was built for: ``config.max_position_embeddings``.

    Accepts a model or its config.
    """
    from ..cache.support import max_position_embeddings

    config = getattr(model, "config", model)
    value = max_position_embeddings(config)
    if value is not None:
        return value
    raise ValueError(f"{type(config).__name__} has no max_position_embeddings; cannot tell the model's context length")


__all__ = ["DTYPE_NAMES", "load_model", "model_max_context"]
