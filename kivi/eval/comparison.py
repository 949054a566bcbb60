"""Comparing cache specs on the streaming protocol (:mod:`.protocol`): :func:`compare` (every spec against
full precision), :func:`perplexity` and :func:`kl_divergence` for one config."""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from .caches import CacheSpec, check_spec
from .metrics import Accumulator
from .progress import progress_bar
from .protocol import check_windows, measure_window, run_prefill


def compare(
    model: Any,
    windows: torch.Tensor,
    specs: Sequence[CacheSpec],
    *,
    prefix: int = 512,
    chunk: int = 16,
    reference: bool = True,
    progress: bool = True,
    on_window: Any = None,
    batch_size: int = 1,
    fast: bool = True,
) -> dict[str, Any]:
    """Evaluate several cache specs on the same windows in one streaming pass.

    Per window, the full-precision ``DynamicCache`` runs first (when ``reference``) and its
    log-probabilities of the scored tokens are kept for that window only; each spec then runs on
    the same window and is scored against them (KL(P_fp || P_spec), top-1 agreement).

    A baseline that cannot be built (e.g. optimum-quanto missing) is reported as
    ``{"unavailable": reason}`` instead of failing the run.

    ``on_window(results_so_far)`` is called after each batch of windows (for incremental writing).
    ``batch_size`` windows go through the model together (same numbers, better CPU throughput:
    quantization groups never span batch rows).

    ``fast`` (default): the prefix of each window runs through the model once, at full precision
    (:class:`Prefill`), and is replayed into every ``DynamicCache`` / ``KiviCache``; KIVI configs
    with ``attention_backend="auto"`` read the packed cache (the ``"cpu"`` backend on CPU: blocked
    torch for multi-token forwards) instead of the reference attention; and the caches whose numbers
    do not depend on the chunk (:func:`chunk_neutral`: FP, KIVI with per-query precision) get
    :data:`FAST_CHUNK` tokens per forward instead of ``chunk`` (quanto baselines keep ``chunk``).
    ``fast=False`` is the reference protocol: every cache runs its own prefill and ``chunk`` tokens
    per forward, and an unprepared model reads a KIVI cache through the reference attention. Both
    give the same numbers up to float rounding, amplified where a rounding flips a 2-bit code
    (tests/eval/test_fast.py states the tolerance).

    Returns ``{"fp": {...} or None, "results": [{...} per spec], "protocol": {...}}``.
    """
    windows = check_windows(windows, prefix, chunk)
    specs = [check_spec(s) for s in specs]
    fp = Accumulator(None) if reference else None
    accs = [Accumulator(s) for s in specs]
    from ..config import KiviConfig  # noqa: PLC0415
    from .caches import synthetic_bits  # noqa: PLC0415

    for acc in accs:  # a config this model cannot use (e.g. group_size vs head_dim) fails fast
        if isinstance(acc.spec, KiviConfig):
            try:
                synthetic_bits(model, acc.spec, 2 * max(acc.spec.group_size, 1), prefix=acc.spec.group_size)
            except ValueError as e:
                if len(accs) == 1:
                    raise
                acc.error = f"invalid for this model: {e}"
    n_tok = windows.shape[1]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    W = windows.shape[0]
    bar = progress_bar(W * (len(specs) + (1 if reference else 0)) * (n_tok - prefix), "eval", progress, unit="tok")
    t_start = time.time()

    def snapshot() -> dict[str, Any]:
        return {
            "protocol": {"windows": int(fp.windows if fp else (accs[0].windows if accs else 0)),
                         "windows_requested": int(W), "context": int(n_tok), "prefix": prefix,
                         "chunk": chunk, "seconds": round(time.time() - t_start, 1), "fast": fast},
            "fp": fp.result() if fp else None,
            "results": [a.result(fp) for a in accs],
        }

    try:
        for w in range(0, W, batch_size):
            ids = windows[w : w + batch_size]
            nb = ids.shape[0]
            where = f"window {w + 1}/{W}" if nb == 1 else f"windows {w + 1}-{w + nb}/{W}"
            t0 = time.time()
            pre = run_prefill(model, ids, prefix) if fast else None
            ref: torch.Tensor | None = None
            if fp is not None:
                fp.seconds += time.time() - t0  # the shared prefill is counted once, on the FP row
                ref = measure_window(model, ids, fp, prefix=prefix, chunk=chunk, prefill=pre, keep=True, fast=fast,
                                     bar=bar, where=where)
            for acc in accs:
                if acc.error:
                    bar.update(nb * (n_tok - prefix))
                    continue
                try:
                    measure_window(model, ids, acc, prefix=prefix, chunk=chunk, prefill=pre, ref=ref, fast=fast,
                                   bar=bar, where=where)
                except Exception as e:  # noqa: BLE001
                    if isinstance(acc.spec, str):  # a baseline: report, do not crash the sweep
                        acc.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                        continue
                    raise
            del pre
            if fp is not None and accs:
                bar.set_postfix_str(f"fp ppl {math.exp(fp.nll / fp.tokens):.3f}")
            if on_window is not None:
                on_window(snapshot())
    finally:
        bar.close()
    return snapshot()


#: Tokens per forward :func:`measure_window` uses in fast mode for caches whose numbers do not depend on
#: the chunk (:func:`chunk_neutral`): one forward for the whole continuation of a 1024-token window


def perplexity(
    model: Any,
    tokenizer: Any,
    windows: torch.Tensor,
    config: CacheSpec = None,
    *,
    prefix: int = 512,
    chunk: int = 16,
    progress: bool = True,
    batch_size: int = 1,
    fast: bool = True,
) -> dict[str, Any]:
    """Streaming perplexity of ``model`` with the cache ``config`` describes.

    Args:
        model: a transformers causal LM.
        tokenizer: unused (kept for a uniform signature; may be ``None``).
        windows: ``LongTensor [num_windows, context]`` (e.g. :func:`kivi.data.token_windows`).
        config: a :class:`KiviConfig`, ``None`` / ``"fp"`` for transformers' ``DynamicCache``, or a
            baseline name from :data:`kivi.eval.BASELINES`.
        prefix: tokens prefilled into a fresh cache per window (not scored, except that the
            prefill's last logit scores the first token after it).
        chunk: tokens per forward after the prefix.
        fast: share the prefill and read KIVI caches through the packed attention (:func:`compare`).

    Returns:
        ``{"ppl", "nll" (mean per token), "tokens_scored", "windows", "bits_per_element",
        "cache_bytes" (at the end of a window, averaged over windows), "seconds", "name", "config",
        "context", "prefix", "chunk"}``.
    """
    return _single(model, windows, config, prefix, chunk, progress, batch_size, reference=False, fast=fast)


def kl_divergence(
    model: Any,
    tokenizer: Any,
    windows: torch.Tensor,
    config: CacheSpec,
    *,
    prefix: int = 512,
    chunk: int = 16,
    progress: bool = True,
    batch_size: int = 1,
    fast: bool = True,
) -> dict[str, Any]:
    """KL(P_fp || P_config) and top-1 agreement of next-token distributions vs. the FP cache.

    FP (``DynamicCache``) and ``config`` run side by side on each window (only one window's FP
    log-probabilities are held at a time). Returns the :func:`perplexity` fields for ``config`` plus
    ``kl`` (nats per scored token), ``top1_agreement`` (fraction), ``ppl_fp`` and ``delta_ppl_pct``.
    """
    return _single(model, windows, config, prefix, chunk, progress, batch_size, reference=True, fast=fast)


def _single(model, windows, config, prefix, chunk, progress, batch_size, *, reference: bool,
            fast: bool) -> dict[str, Any]:
    """:func:`compare` for one config; an unavailable baseline raises ``BaselineUnavailable``."""
    spec = check_spec(config)
    out = compare(model, windows, [spec], prefix=prefix, chunk=chunk, reference=reference, progress=progress,
                  batch_size=batch_size, fast=fast)
    r = out["results"][0]
    if "unavailable" in r:
        from .caches import BaselineUnavailable  # noqa: PLC0415

        raise BaselineUnavailable(f"{r['name']} unavailable: {r['unavailable']}")
    r.update(context=out["protocol"]["context"], prefix=prefix, chunk=chunk)
    return r
