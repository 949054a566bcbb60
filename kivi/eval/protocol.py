"""The streaming protocol: how a window goes through a real cache and is scored.

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
from typing import Any, Callable, Iterator

import torch

from ..attention.interface import reading_views
from ..cache.replay import replay_prefill
from .caches import bits_per_element, cache_nbytes, make_cache, spec_name
from .metrics import Accumulator, score_logits


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

    from ..cache.kivi_cache import KiviCache  # noqa: PLC0415

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
            replay_prefill(cache, prefill.states)  # clones: no cache may alias the shared prefix
            yield prefill.logits, ids[:, prefix : prefix + 1]
        else:
            out = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
            yield out.logits[:, -1:].float(), ids[:, prefix : prefix + 1]
    yield from stream_continuation(model, ids[:, prefix:], cache, chunk)


def stream_continuation(
    model: Any, ids: torch.Tensor, cache: Any, chunk: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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



FAST_CHUNK = 512


def chunk_neutral(cache: Any) -> bool:
    """Whether feeding ``cache`` ``n`` tokens per forward gives the same numbers for every ``n`` (up to
    float rounding): a ``DynamicCache`` (exact attention) and a ``KiviCache`` whose layers give each
    query of a multi-token forward its own precision (``KiviCache.reads_views``; not on models whose
    attention ``"kivi"`` does not implement). A quanto baseline is not: the queries of one forward read
    each other's tokens at full precision, so it keeps the protocol's ``chunk``."""
    from transformers import DynamicCache  # noqa: PLC0415

    from ..cache.kivi_cache import KiviCache  # noqa: PLC0415

    if type(cache) is DynamicCache:
        return True
    return isinstance(cache, KiviCache) and cache.reads_views


def measure_window(
    model: Any,
    ids: torch.Tensor,
    acc: Accumulator,
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
    part = Accumulator(acc.spec)
    kept: list[torch.Tensor] = []
    done = 0
    try:
        for logits, targets in stream_window(model, ids, cache, prefix, step, prefill):
            m = targets.shape[1]
            logp = score_logits(part, logits, targets, ref[:, done : done + m] if ref is not None else None)
            if keep:
                kept.append(logp)
            done += m
            if bar is not None:
                bar.update(m * nb)
    except BaseException:
        if bar is not None:
            bar.update(nb * (ids.shape[1] - prefix - done))
        raise
    acc.add(part)
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
    acc = Accumulator(None)
    kept: list[torch.Tensor] = []
    first = (last_logits.reshape(continuation.shape[0], 1, -1).float(), continuation[:, :1])
    pos = 0
    for i, (logits, targets) in enumerate(
        itertools.chain([first], stream_continuation(model, continuation, cache, chunk))
    ):
        m = targets.shape[1]
        logp = score_logits(acc, logits, targets, None if reference is None else reference[:, pos : pos + m])
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

