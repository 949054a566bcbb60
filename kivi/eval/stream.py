"""Streaming evaluation (perplexity, KL divergence, top-1 agreement through a real cache), by its old module name.

The protocol is documented in :mod:`.protocol` (windows through a cache); :mod:`.metrics` (scores) and
:mod:`.comparison` (:func:`compare`, :func:`perplexity`, :func:`kl_divergence`) hold the rest. This module keeps
their public names importable from here.
"""

from __future__ import annotations

from .comparison import compare, kl_divergence, perplexity
from .metrics import Accumulator, score_logits, token_agreement
from .protocol import (
    FAST_CHUNK,
    Prefill,
    check_windows,
    chunk_neutral,
    measure_window,
    replays_prefill,
    run_prefill,
    score_continuation,
    stream_continuation,
    stream_window,
)

__all__ = ["compare", "kl_divergence", "perplexity", "Accumulator", "score_logits", "token_agreement", "FAST_CHUNK",
           "Prefill", "check_windows", "chunk_neutral", "measure_window", "replays_prefill", "run_prefill",
           "score_continuation", "stream_continuation", "stream_window"]
