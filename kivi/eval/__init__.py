"""Evaluation and tuning: streaming perplexity, KL vs. full precision, passkey retrieval,
per-layer sensitivity, sweeps and budgeted config selection.

Everything here measures a *real* cache (``KiviCache``, transformers' ``DynamicCache`` or a
``QuantizedCache`` baseline) the way generation uses it; see :mod:`kivi.eval.stream`. The caches
themselves are built by :func:`make_cache` and measured by :func:`cache_nbytes`, the ones ``kivi
demo`` and the benchmarks use too.
"""

from .caches import (
    BASELINES,
    BaselineUnavailable,
    baseline_unavailable_reason,
    bits_per_element,
    cache_nbytes,
    make_cache,
    spec_kind,
    spec_name,
    synthetic_bits,
)
from .stream import compare, kl_divergence, perplexity, score_continuation, token_agreement

__all__ = [
    "BASELINES",
    "BaselineUnavailable",
    "baseline_unavailable_reason",
    "bits_per_element",
    "cache_nbytes",
    "compare",
    "kl_divergence",
    "make_cache",
    "perplexity",
    "score_continuation",
    "spec_kind",
    "spec_name",
    "synthetic_bits",
    "token_agreement",
]


def __getattr__(name):  # lazy: passkey / profile / sweep pull in more
    if name in ("passkey", "passkey_prompt"):
        from . import passkey as _m

        return getattr(_m, name)
    if name in ("layer_profile", "recommend_layer_config"):
        from . import profile as _m

        return getattr(_m, name)
    if name in ("sweep", "select_config", "tune", "default_grid", "candidate_grid", "pareto_plot", "write_rows"):
        from . import sweep as _m

        return getattr(_m, name)
    raise AttributeError(f"module 'kivi.eval' has no attribute {name!r}")
