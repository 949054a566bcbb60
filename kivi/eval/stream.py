"""Streaming evaluation: perplexity, KL divergence and top-1 agreement through a real cache.

Protocol, per window of ``L`` tokens: prefill ``prefix`` tokens into a fresh cache, then feed the
remaining tokens ``chunk`` at a time through that cache. Every token after the prefix is scored:
the logit at position ``i`` predicts token ``i + 1`` (the first scored token is predicted by the
prefill's last logit). Each token of a chunk sees the history
exactly as token-by-token generation would: a :class:`~kivi.KiviCache` gives every query of a
multi-token forward the precision one-token decoding gives it (tokens that would have left the
full-precision window by that query's step are read quantized; :func:`kivi.cache.schedule.query_boundaries`),
so ``chunk=16`` equals ``chunk=1`` up to float noise (``chunk=1`` is ~10x slower on CPU). Such
forwards need the ``"kivi"`` attention to read the cache's views; a model not prepared by
:func:`kivi.quantize_model` runs it for the continuation (:func:`kivi.attention.interface.reading_views`),
and a model whose attention ``"kivi"`` does not implement (logit softcapping) needs ``chunk=1``.

:func:`score_continuation` applies the same protocol after a prefill the caller ran itself (``kivi
demo`` times its prefill and decodes from the same cache).

Split by job: :mod:`.protocol` (windows through a cache), :mod:`.metrics` (scores), :mod:`.comparison`
(:func:`compare`, :func:`perplexity`, :func:`kl_divergence`); this module keeps their public names
importable from here.
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
