"""Quantizing a loaded model's weights with optimum-quanto, and measuring the bytes its tensors occupy.

What quanto stores per layer, as arithmetic the memory planner uses without a model, lives in
:mod:`kivi.memory.weights` (with the accepted widths, :data:`kivi.memory.weights.WEIGHT_BITS`); this
module changes and measures a real model.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import short_reason

#: Modules left in floating point, as transformers' own quanto integration does (``QuantoConfig``'s
#: ``modules_to_not_convert`` defaults to the output embedding): ``lm_head`` is often tied to the input
#: embedding, and quantizing it would store a second, quantized copy next to the float embedding.
WEIGHT_QUANT_EXCLUDE = ("lm_head",)


class WeightQuantizationUnavailable(ImportError):
    """8- or 4-bit weights were asked for but optimum-quanto cannot be imported; the message says how to fix it."""

    user_facing = True  # the CLI prints it as one line


def quantizable_linears(model: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of every ``torch.nn.Linear`` of ``model`` that :func:`quantize_weights` quantizes.

    All of them but those whose full name matches :data:`WEIGHT_QUANT_EXCLUDE` (``fnmatch``, as quanto's
    ``quantize(exclude=...)`` matches). Works on a meta-device model (the planner counts bytes from it).
    """
    from fnmatch import fnmatch

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(fnmatch(name, pat) for pat in WEIGHT_QUANT_EXCLUDE)]


def quantize_weights(model: Any, bits: int) -> Any:
    """Quantize the weights of ``model``'s linear layers in place with optimum-quanto; returns ``model``.

    ``bits`` (one of :data:`kivi.memory.weights.WEIGHT_BITS`): 16 leaves the model as it is; 8 = ``qint8``
    (one scale per output channel); 4 = ``qint4`` (a scale and a shift per group of up to 128 input
    channels, quanto's choice; what is stored: :mod:`kivi.memory.weights`). Activations stay in the model's dtype. Every
    ``torch.nn.Linear`` except :data:`WEIGHT_QUANT_EXCLUDE` becomes a quanto ``QLinear`` and is frozen
    (the float weights are replaced by the integer codes and scales). Embeddings and norms stay float.

    Use it before :func:`kivi.quantize_model` (the KV cache does not care how the weights are stored).

    Raises:
        ValueError: ``bits`` is not 16, 8 or 4, or the model is already weight-quantized.
        WeightQuantizationUnavailable: optimum-quanto is not installed (``pip install 'kivi[quanto]'``).
    """
    from ..memory.weights import check_weight_bits

    if check_weight_bits(bits) == 16:
        return model
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except ImportError as error:
        raise WeightQuantizationUnavailable(
            f"weight bits={bits} needs optimum-quanto: pip install 'kivi[quanto]' (or pip install optimum-quanto); "
            f"importing it failed: {short_reason(error)}") from None
    if getattr(model, "kivi_weight_bits", 16) != 16:
        raise ValueError(f"the model's weights are already quantized to {model.kivi_weight_bits} bits")
    # Quantized under inference mode: quanto's int4 weight (WeightQBitsTensor) made outside it cannot be
    # transposed inside it ("Cannot set version_counter for inference tensor" in F.linear), and kivi's
    # evaluation and CLI run under torch.inference_mode(). Tensors made in inference mode cannot be saved for
    # backward, so every parameter stops requiring grad: the model is for inference (quanto's frozen weights
    # are not trainable either); forwards under no_grad, inference_mode or plain grad mode all run.
    with torch.inference_mode():
        quantize(model, weights=qint8 if bits == 8 else qint4, include=[n for n, _ in quantizable_linears(model)])
        freeze(model)
    model.requires_grad_(False)
    model.kivi_weight_bits = bits
    return model


def weight_bytes(model: Any) -> int:
    """Bytes the model's parameters and buffers really occupy, each storage counted once.

    Reads ``model.state_dict()``, where quanto flattens a quantized weight into its stored tensors
    (``weight._data`` codes, ``weight._scale``, ``weight._shift``), and adds up the distinct storages (a
    tied ``lm_head`` shares the embedding's storage and counts once).
    """
    storages: dict[int, int] = {}
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            storages[st.data_ptr() if st.nbytes() else id(st)] = st.nbytes()
    return sum(storages.values())


__all__ = ["WEIGHT_QUANT_EXCLUDE", "WeightQuantizationUnavailable", "quantizable_linears", "quantize_weights",
           "weight_bytes"]
