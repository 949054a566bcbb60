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
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..attention.interface import reading_views
from .caches import CacheSpec, bits_per_element, cache_nbytes, check_spec, make_cache, spec_name, spec_to_json
from .progress import progress_bar


def check_windows(windows: torch.Tensor, prefix: int, chunk: int) -> torch.Tensor:
    if not isinstance(windows, torch.Tensor) or windows.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
        raise ValueError("windows must be an integer tensor of token ids, shape [num_windows, context]")
    if windows.dim() == 1:
        windows = windows.unsqueeze(0)
    if windows.dim() != 2 or windows.shape[0] == 0:
        raise ValueError(f"windows must have shape [num_windows, context], got {tuple(windows.shape)}")
    for name, v in (("prefix", prefix), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if prefix >= windows.shape[1]:
        raise ValueError(
            f"prefix={prefix} leaves nothing to score in windows of {windows.shape[1]} tokens; "
            "use a prefix shorter than the context"
        )
    return windows.long()


@dataclass
class Prefill:
    """The full-precision prefill of one batch of windows, shared by every cache evaluated on them.

    A forward into an empty cache is exact attention for every cache :func:`stream_window` replays
    into (``DynamicCache``: nothing is quantized; ``KiviCache``: the prompt's queries read every
    token at full precision, ``kivi.cache.schedule.prefill_exact_queries``), so the keys/values each
    layer hands its cache, and the last logit, do not depend on the cache: computed once, they are
    replayed into each cache (``cache.update`` per layer, as the model's forward calls it) instead of
    running the prefix through the model again per cache. Same numbers (tests compare the two).

    Fields:
        ids: ``LongTensor [B, L]``, the windows.
        prefix: tokens prefilled.
        states: per layer ``(keys, values)``, each ``[B, H_kv, prefix, D]`` in the model's dtype, as the
            layer handed them to the cache (keys after RoPE).
        logits: ``[B, 1, V]`` float32, the prefill's last logit (it predicts ``ids[:, prefix]``).
    """

    ids: torch.Tensor
    prefix: int
    states: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor


def run_prefill(model: Any, ids: torch.Tensor, prefix: int) -> Prefill | None:
    """The shared :class:`Prefill` of ``ids [B, L]``, or ``None`` when the model's cache layers do not
    keep the whole prefix (sliding-window layers keep only their window, so it could not be replayed)."""
    from transformers import DynamicCache  # noqa: PLC0415

    dev = next(model.parameters()).device
    ids = ids.to(dev)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
    states = [(layer.keys, layer.values) for layer in cache.layers]
    if any(k is None or k.shape[-2] != prefix or v.shape[-2] != prefix for k, v in states):
        return None
    return Prefill(ids, prefix, states, out.logits[:, -1:].float())


def replays_prefill(cache: Any) -> bool:
    """Whether :func:`stream_window` replays a :class:`Prefill` into ``cache`` (a ``DynamicCache`` or a
    ``KiviCache``, empty); any other cache (a quanto baseline) runs its own prefill."""
    from transformers import DynamicCache  # noqa: PLC0415

    from ..cache.cache import KiviCache  # noqa: PLC0415

    return type(cache) is DynamicCache or isinstance(cache, KiviCache)


def stream_window(model: Any, ids: torch.Tensor, cache: Any, prefix: int, chunk: int,
                  prefill: Prefill | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(logits [B, n, V] float32, targets [B, n])`` for every scored token of ``ids [B, L]``.

    With ``prefill`` (of the same ``ids`` and ``prefix``) and a cache :func:`replays_prefill` accepts,
    the prefix is replayed into ``cache`` instead of run through the model. Every forward runs under
    :func:`~kivi.attention.interface.reading_views` (a cache from ``make_cache(..., read_packed=True)``
    needs the ``"kivi"`` attention from the prefill on)."""
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    if prefill is not None and (prefill.prefix != prefix or not torch.equal(prefill.ids.to(dev), ids)):
        raise ValueError("prefill was computed for other windows or another prefix")
    with torch.inference_mode(), reading_views(model, cache):
        if prefill is not None and replays_prefill(cache):
            for i, (k, v) in enumerate(prefill.states):
                cache.update(k.clone(), v.clone(), i)  # clones: no cache may alias the shared prefix
            yield prefill.logits, ids[:, prefix : prefix + 1]
        else:
            out = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
            yield out.logits[:, -1:].float(), ids[:, prefix : prefix + 1]
    yield from stream_continuation(model, ids[:, prefix:], cache, chunk)


def stream_continuation(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Feed ``ids [B, n]`` through ``cache`` (which already holds what precedes them), ``chunk`` tokens
    per forward, and yield ``(logits [B, m, V] float32, targets [B, m])`` per forward: the logit at
    position ``i`` predicts ``ids[:, i + 1]``. The last token predicts nothing here but is fed all the
    same (the cache ends up holding every token, as after generation)."""
    L = ids.shape[1]
    with torch.inference_mode(), reading_views(model, cache):
        for s in range(0, L, chunk):
            e = min(s + chunk, L)
            out = model(input_ids=ids[:, s:e], cache=cache, use_cache=True)
            n = min(e, L - 1) - s  # the last token predicts nothing
            if n > 0:
                yield out.logits[:, :n].float(), ids[:, s + 1 : s + 1 + n]


class _Acc:
    """Running sums for one cache spec."""

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

    def result(self, fp: "_Acc | None" = None) -> dict[str, Any]:
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


def _score(acc: _Acc, logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    acc.nll -= float(logp.gather(-1, targets.unsqueeze(-1)).sum())
    acc.tokens += targets.numel()
    if ref_logp is not None:
        # KL(P_fp || P_q) = sum_v p_fp (log p_fp - log p_q)
        acc.kl += float((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0).sum())
        acc.top1 += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    return logp


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
    fp = _Acc(None) if reference else None
    accs = [_Acc(s) for s in specs]
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
#: after a 512-token prefix, capped so that long windows do not hold [B, n, vocab] logits for all of it.
FAST_CHUNK = 512


def chunk_neutral(cache: Any) -> bool:
    """Whether feeding ``cache`` ``n`` tokens per forward gives the same numbers for every ``n`` (up to
    float rounding): a ``DynamicCache`` (exact attention) and a ``KiviCache`` whose layers give each
    query of a multi-token forward its own precision (``KiviCache.reads_views``; not on models whose
    attention ``"kivi"`` does not implement). A quanto baseline is not: the queries of one forward read
    each other's tokens at full precision, so it keeps the protocol's ``chunk``."""
    from transformers import DynamicCache  # noqa: PLC0415

    from ..cache.cache import KiviCache  # noqa: PLC0415

    if type(cache) is DynamicCache:
        return True
    return isinstance(cache, KiviCache) and cache.reads_views


def measure_window(
    model: Any,
    ids: torch.Tensor,
    acc: _Acc,
    *,
    prefix: int,
    chunk: int,
    prefill: Prefill | None = None,
    ref: torch.Tensor | None = None,
    keep: bool = False,
    fast: bool = True,
    bar: Any = None,
    where: str = "",
) -> torch.Tensor | None:
    """Run ``acc.spec``'s cache over the windows ``ids [B, L]`` and add the scores to ``acc``.

    ``ref``: the FP log-probabilities ``[B, L - prefix, V]`` of the same windows (as ``keep`` returns
    them) for KL and top-1; ``prefill``: the shared :class:`Prefill`. ``fast``: build KIVI caches that
    read the packed storage (``make_cache(..., read_packed=True)``) and feed a :func:`chunk_neutral`
    cache ``max(chunk, FAST_CHUNK)`` tokens per forward. ``bar`` advances by the tokens scored and
    names the cache and ``where`` (the window). A spec that fails leaves ``acc`` as it was.
    """
    nb = ids.shape[0]
    name = spec_name(acc.spec)
    if bar is not None:
        bar.set_description(f"{name} · {where}" if where else name)
    t0 = time.time()
    cache = make_cache(model, acc.spec, read_packed=fast)
    step = max(chunk, FAST_CHUNK) if fast and chunk_neutral(cache) else chunk
    part = _Acc(acc.spec)
    kept: list[torch.Tensor] = []
    done = 0
    try:
        for logits, targets in stream_window(model, ids, cache, prefix, step, prefill):
            m = targets.shape[1]
            logp = _score(part, logits, targets, ref[:, done : done + m] if ref is not None else None)
            if keep:
                kept.append(logp)
            done += m
            if bar is not None:
                bar.update(m * nb)
    except BaseException:
        if bar is not None:
            bar.update(nb * (ids.shape[1] - prefix - done))
        raise
    acc.nll += part.nll
    acc.tokens += part.tokens
    acc.kl += part.kl
    acc.top1 += part.top1
    acc.bits.append(bits_per_element(model, cache, ids.shape[1], nb))
    acc.bytes.append(cache_nbytes(cache) // nb)
    acc.windows += nb
    acc.seconds += time.time() - t0
    return torch.cat(kept, dim=1) if keep else None


def score_continuation(
    model: Any,
    cache: Any,
    last_logits: torch.Tensor,
    continuation: torch.Tensor,
    *,
    chunk: int = 16,
    reference: torch.Tensor | None = None,
    keep_logprobs: bool = False,
    on_chunk: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Teacher-forced scoring of ``continuation`` after the prompt ``cache`` already holds.

    The protocol of :func:`compare` after its prefix, for a caller that ran the prefill itself (``kivi
    demo`` times it): the prompt's last logits predict ``continuation[:, 0]``, then the continuation
    goes through ``cache`` ``chunk`` tokens per forward (:func:`stream_continuation`) and every token
    of it is scored. With the log-probabilities of a reference run on the same tokens (``keep_logprobs``
    of an earlier call, e.g. with the FP ``DynamicCache``), also KL(P_ref || P) and top-1 agreement.

    Args:
        cache: any cache holding the prompt (e.g. from :func:`make_cache`); it is extended in place.
        last_logits: ``[B, V]`` logits of the prompt's last position.
        continuation: ``LongTensor [B, n]`` (or ``[n]``) of the tokens that follow the prompt.
        reference: ``[B, n, V]`` log-probabilities of the reference run.
        keep_logprobs: also return this run's ``[B, n, V]`` float32 log-probabilities.
        on_chunk: called after every forward that scores tokens (for a progress bar).

    Returns:
        ``{"ppl", "nll" (mean per token), "tokens_scored"}``; with ``reference`` also ``"kl"`` (nats per
        token) and ``"top1_agreement"``; with ``keep_logprobs`` also ``"logprobs"``.
    """
    if continuation.dim() == 1:
        continuation = continuation.unsqueeze(0)
    if continuation.dim() != 2 or continuation.shape[1] == 0:
        raise ValueError(f"continuation must have shape [batch, n] with n >= 1, got {tuple(continuation.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    continuation = continuation.to(last_logits.device)
    if reference is not None and reference.shape[:2] != continuation.shape:
        raise ValueError(f"reference log-probabilities {tuple(reference.shape)} do not match the continuation "
                         f"{tuple(continuation.shape)}")
    acc = _Acc(None)
    kept: list[torch.Tensor] = []
    first = (last_logits.reshape(continuation.shape[0], 1, -1).float(), continuation[:, :1])
    pos = 0
    for i, (logits, targets) in enumerate(itertools.chain([first], stream_continuation(model, continuation, cache, chunk))):
        m = targets.shape[1]
        logp = _score(acc, logits, targets, None if reference is None else reference[:, pos : pos + m])
        if keep_logprobs:
            kept.append(logp)
        pos += m
        if on_chunk is not None and i > 0:  # i = 0: the prompt's logits, no forward here
            on_chunk()
    nll = acc.nll / max(acc.tokens, 1)
    r: dict[str, Any] = {"ppl": math.exp(nll), "nll": nll, "tokens_scored": acc.tokens}
    if reference is not None:
        r["kl"] = acc.kl / max(acc.tokens, 1)
        r["top1_agreement"] = acc.top1 / max(acc.tokens, 1)
    if keep_logprobs:
        r["logprobs"] = torch.cat(kept, dim=1)
    return r


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
