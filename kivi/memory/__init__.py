"""KV-cache memory planner: what a full-precision cache and a KIVI cache cost for a model and context.

The full-precision (FP) cache of a decoder holds, per token and per sequence,
``2 x layers x kv_heads x head_dim x bytes`` (keys and values). :func:`estimate_kv_memory` computes
that and the exact storage a :class:`~kivi.cache.KiviCache` allocates for the same tokens:

* **codes** — ``bits`` per element, bit-packed (:func:`kivi.quant.packing.packed_size`);
* **scales / zero-points** — one scale and one offset (``scale_dtype``, ``"auto"`` = the cache
  dtype) per group: keys per channel per ``G`` tokens, values per ``G`` channels per token;
* **compensation** — ``residual_bits`` per group when error compensation is on;
* **full-precision window** — the ``R`` most recent values and ``R + ((T - R) mod G)`` most recent
  keys (keys leave the window in whole groups of ``G``), at full precision;
* **block reserve** — storage allocated but not yet written: a prefill of ``P`` tokens becomes
  one exact-size block, later tokens are written into blocks of ``block_size`` tokens.

The model is one prefill of ``prefill`` tokens (default: the whole ``context``) followed by
one-token decode steps up to ``context``; for that sequence of forwards the estimate equals
``KiviCache.nbytes`` byte for byte (no padding). Sliding-window layers (Gemma 2/3, Mistral) are
modelled as the cache does it: blocks entirely older than ``window + R + G`` tokens (cut at a
multiple of ``block_size``) are freed during decoding; after a single prefill nothing is freed yet.
The FP baseline keeps the last ``window - 1`` tokens on such layers (transformers'
``DynamicSlidingWindowLayer``).

Activations, logits and the attention workspace are not included: this is the cache alone.

Modules: :mod:`.units` (dtypes, ``"32k"``, ``"80GB"``), :mod:`.sources` (:class:`ModelSpec`: where a
model's shape comes from), :mod:`.storage` (bytes of one layer, from :mod:`kivi.cache.schedule`),
:mod:`.estimate` (:class:`MemoryEstimate`, :func:`estimate_kv_memory`, what fits). The planner is a
tool: it imports the cache, the formats and the config; only tools (the CLI, and ``kivi.estimate_kv_memory``
lazily) import it.
"""

from .estimate import MemoryEstimate, estimate_kv_memory
from .sources import ModelSpec, model_spec, read_gguf_metadata, spec_from_gguf, spec_from_hf_config
from .units import DEFAULT_DTYPE, DTYPE_BYTES, format_bytes, normalize_dtype, parse_bytes, parse_context

__all__ = [
    "ModelSpec",
    "MemoryEstimate",
    "estimate_kv_memory",
    "model_spec",
    "spec_from_hf_config",
    "spec_from_gguf",
    "read_gguf_metadata",
    "parse_context",
    "parse_bytes",
    "format_bytes",
    "normalize_dtype",
    "DTYPE_BYTES",
    "DEFAULT_DTYPE",
]
