"""Scores of a streaming evaluation: running sums per cache spec, token scoring, token agreement."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .caches import CacheSpec, spec_name, spec_to_json


class Accumulator:
    """Running sums of one cache spec's scores (negative log-likelihood, KL and top-1 against full
    precision, bits and bytes per window, seconds); :meth:`result` gives the report row."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.nll = 0.0
        self.tokens = 0
        self.kl = 0.0
        self.top1 = 0
        self.bits: list[float] = []
        self.bytes: list[int] = []
        self.seconds = 0.0
        self.windows = 0
        self.error: str | None = None

    def result(self, fp: "Accumulator | None" = None) -> dict[str, Any]:
        r: dict[str, Any] = {"name": spec_name(self.spec), "config": spec_to_json(self.spec)}
        if self.error:
            r["unavailable"] = self.error
            return r
        nll = self.nll / max(self.tokens, 1)
        r.update(
            ppl=math.exp(nll),
            nll=nll,
            tokens_scored=self.tokens,
            windows=self.windows,
            bits_per_element=sum(self.bits) / len(self.bits) if self.bits else float("nan"),
            cache_bytes=int(sum(self.bytes) / len(self.bytes)) if self.bytes else 0,
            seconds=round(self.seconds, 2),
        )
        if fp is not None:
            r["ppl_fp"] = math.exp(fp.nll / max(fp.tokens, 1))
            r["delta_ppl_pct"] = 100.0 * (r["ppl"] / r["ppl_fp"] - 1.0)
            r["kl"] = self.kl / max(self.tokens, 1)
            r["top1_agreement"] = self.top1 / max(self.tokens, 1)
        return r

    def add(self, part: "Accumulator") -> None:
        """Add ``part``'s token scores (one window's, measured apart so a failure leaves this as it was)."""
        self.nll += part.nll
        self.tokens += part.tokens
        self.kl += part.kl
        self.top1 += part.top1


def score_logits(acc: Accumulator, logits: torch.Tensor, targets: torch.Tensor,
                 ref_logp: torch.Tensor | None) -> torch.Tensor:
    """Score ``logits [B, n, V]`` against ``targets [B, n]`` into ``acc`` (KL and top-1 against ``ref_logp``,
    the full-precision log-probabilities, when given); returns the log-probabilities."""
    logp = torch.log_softmax(logits, dim=-1)
    acc.nll -= float(logp.gather(-1, targets.unsqueeze(-1)).sum())
    acc.tokens += targets.numel()
    if ref_logp is not None:
        # KL(P_fp || P_q) = sum_v p_fp (log p_fp - log p_q)
        acc.kl += float((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0).sum())
        acc.top1 += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    return logp



def token_agreement(tokens: Sequence[int], reference: Sequence[int]) -> dict[str, Any]:
    """How far a generated sequence follows a reference one (e.g. greedy decoding with FP):
    ``{"same_tokens": fraction of positions with the same token, "common_prefix": tokens equal
    before the first difference}``."""
    same = sum(1 for x, y in zip(tokens, reference) if x == y) / max(1, len(reference))
    prefix = 0
    for x, y in zip(tokens, reference):
        if x != y:
            break
        prefix += 1
    return {"same_tokens": same, "common_prefix": prefix}



__all__ = ["Accumulator", "score_logits", "token_agreement"]
