"""Evaluation and tuning: streaming perplexity, KL vs. full precision, passkey retrieval,
per-layer sensitivity, sweeps and budgeted config selection.

Everything here measures a *real* cache (``KiviCache``, transformers' ``DynamicCache`` or a
``QuantizedCache`` baseline) the way generation uses it. One job per module: :mod:`.protocol` (how a window
goes through a cache), :mod:`.metrics` (scores), :mod:`.comparison` (specs against full precision),
:mod:`.sweep` (grids of specs), :mod:`.tuning` (budgeted selection), :mod:`.report` (CSV, Pareto plot);
:mod:`.stream` keeps the names it had. The caches
themselves are built by :func:`make_cache` and measured by :func:`cache_nbytes`, the ones ``kivi
demo`` and the benchmarks use too.
"""

# Names load on first use (PEP 562): importing a light submodule (e.g. ``kivi.eval.caches`` for the CLI's
# list of baselines) must not import the evaluation loop and, with it, the attention stack.
_LAZY = {
    "caches": ("BASELINES", "BaselineUnavailable", "baseline_unavailable_reason", "bits_per_element", "cache_nbytes",
               "make_cache", "spec_kind", "spec_name", "synthetic_bits"),
    "comparison": ("compare", "kl_divergence", "perplexity"),
    "protocol": ("score_continuation",),
    "metrics": ("Accumulator", "token_agreement"),
    "passkey": ("passkey", "passkey_prompt"),
    "profile": ("layer_profile", "recommend_layer_config"),
    "sweep": ("sweep", "default_grid"),
    "tuning": ("select_config", "tune"),
    "report": ("pareto_plot", "write_rows"),
    "candidates": ("candidate_grid",),
}

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


def __getattr__(name):
    import importlib

    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module 'kivi.eval' has no attribute {name!r}")
