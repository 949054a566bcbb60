"""MSE-optimal clipping of a group's range: the asymmetric min/max parameters, shrunk where it pays.

Min/max spends the few code levels of a 2-bit group on its extremes; shrinking the range around
its middle clips those extremes and gives every other element a finer step. For each group this
tries the shrink factors ``r`` of :data:`SHRINKS` (``1.0`` first = plain min/max) and keeps the one
whose stored parameters give the lowest squared error over the group's valid elements::

    mid, half = (lo + hi) / 2, (hi - lo) / 2 * r             # r == 1: exactly lo, hi
    offset    = (mid - half) as stored (param_dtype)
    scale     = ((mid + half) - offset) / (2**bits - 1)   as stored
    err(r)    = sum over the group, in element order, of (code * scale + offset - x)**2   (float32)
    chosen    = the first r with the smallest err          (ties keep min/max)

Codes are then computed against the chosen parameters exactly as without clipping, so the stored
format (codes, scale, offset) is unchanged and every attention backend reads it as before; the cost
is on the write path only (``len(SHRINKS)`` candidate quantizations) and zero bits.

Because min/max is a candidate and the error is measured on the parameters as stored, clipping never
increases a group's squared error over min/max. The error is accumulated element by element in group
order (``G - 1`` vectorised additions over all groups and candidates) so that the compiled
per-token quantizer (:mod:`kivi.quant.numba_quant`) reproduces the choice bit for bit.

Measured on SmolLM2 (results/quality/quality12_screen.md): K2V2 +97.5 % -> +80.9 / +84.1 % perplexity in the
fake-quantization screen; see docs/python.md, "Quality per bit" for the real-cache numbers.
"""

from __future__ import annotations

import torch

#: Shrink factors tried for every group (1.0 = min/max, always first).
SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def shrink_factors() -> torch.Tensor:
    """:data:`SHRINKS` as float32 (the values both the torch and the compiled path use)."""
    return torch.tensor(SHRINKS, dtype=torch.float32)


def clipped_params(
    xg: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    red: int,
    levels: int,
    param_dtype: torch.dtype,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale, offset)`` in ``param_dtype``, chosen over :data:`SHRINKS` by squared error.

    Args:
        xg: float32 grouped tensor ``[..., n_groups, G, ...]``; ``red`` is the within-group dimension.
        lo, hi: float32 min / max of each group's valid elements (``xg`` with ``red`` removed).
        levels: ``2**bits - 1``.
        valid: optional bool mask broadcastable to ``xg``; invalid elements do not count in the error.
    """
    r = shrink_factors().view(-1, *([1] * lo.dim()))  # [R, 1, ...]
    mid = (lo + hi) / 2
    half = (hi - lo) / 2 * r  # [R, ...]
    clo = torch.where(r == 1, lo, mid - half)
    chi = torch.where(r == 1, hi, mid + half)
    offset = clo.to(param_dtype)
    scale = ((chi - offset.float()) / levels).to(param_dtype)
    s, o = scale.float().unsqueeze(red + 1), offset.float().unsqueeze(red + 1)  # [R, ..., 1, ...]
    pos = s > 0
    safe = torch.where(pos, s, torch.ones_like(s))
    q = torch.round((xg - o) / safe).clamp_(0, levels)  # [R, ..., G, ...]
    q = torch.where(pos, q, torch.zeros_like(q))
    d = q * s + o - xg
    dd = d * d
    if valid is not None:
        dd = torch.where(torch.broadcast_to(valid, xg.shape), dd, torch.zeros_like(dd))
    err = dd.select(red + 1, 0)
    for i in range(1, xg.shape[red]):  # summed in element order, as the compiled quantizer sums
        err = err + dd.select(red + 1, i)
    best = err.argmin(dim=0, keepdim=True)  # first minimum: ties keep min/max
    return scale.gather(0, best).squeeze(0), offset.gather(0, best).squeeze(0)


__all__ = ["SHRINKS", "shrink_factors", "clipped_params"]
