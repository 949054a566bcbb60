"""The one rule for a sampling temperature: below :data:`GREEDY_BELOW` sampling is greedy decoding.

Used by every path that samples: ``kivi generate --do-sample --temperature`` (:mod:`kivi.cli.generate`),
continuous batching's ``generate_batch`` / ``init_continuous_batching`` (:mod:`kivi.batching.manager`) and
``kivi serve`` (:mod:`kivi.serving.engine`, :mod:`kivi.serving.sampler`, :mod:`kivi.serving.params`).
"""

from __future__ import annotations

from typing import Any

#: Temperatures below this are greedy (vLLM's threshold, ``_SAMPLING_EPS``): at ``t = 1e-5`` a logit gap of
#: 0.001 is already a probability ratio of e^100, and float32 logits divided by a much smaller ``t``
#: overflow (``1e-40``) or by one that rounds to 0 in float32 (``1e-300``) give ``inf``/``nan`` probabilities
#: that the multinomial draw refuses.
GREEDY_BELOW = 1e-5


def is_greedy_temperature(temperature: Any) -> Any:
    """Whether sampling at ``temperature`` is greedy decoding (the argmax): a number below :data:`GREEDY_BELOW`,
    0 included. ``None`` (no temperature given) is ``False``: what it means is the caller's default. A tensor of
    temperatures gives a boolean tensor (element by element)."""
    return temperature is not None and temperature < GREEDY_BELOW


__all__ = ["GREEDY_BELOW", "is_greedy_temperature"]
