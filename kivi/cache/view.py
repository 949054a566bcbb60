"""What a KIVI layer hands to attention for one forward: an :class:`AttentionView` per side, wrapped
in :class:`PackedStates` when attention reads the packed storage itself.

The contract with transformers' attention: a model calls ``key, value = cache.update(k, v, idx)``
and passes ``key`` / ``value`` straight to its attention function. A :class:`KiviCache` built for
packed attention (see :meth:`KiviCache.from_model`) returns two :class:`PackedStates` there; the
``"kivi"`` attention function (:mod:`kivi.attention.interface`) takes the views out of them and
runs the backend named in them. A cache built for materialised attention returns plain tensors
(everything dequantized), which any attention function reads. Nothing else travels between the
two: no context variable, no flag, no state left on the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..backends import Backend, backend_named
from ..quant.kv import dequantize_kv
from .tiers import TierChain

if TYPE_CHECKING:
    from .store import BlockStore


@dataclass(frozen=True)
class HeadRange:
    """kv heads ``[start, stop)`` of a layer: what one view of a side covers."""

    start: int
    stop: int

    @property
    def heads(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class QueryRegion:
    """Per-query precision of a forward of ``n > 1`` tokens, the one encoding every reader walks.

    The tokens ``[first, first + L)`` exist in several versions, ``versions[k] [B, H, L, D]``; query ``i``
    reads position ``first + t`` from ``versions[choice[i, t]]`` (``choice [n, L]`` uint8). ``versions[0]``
    is what the view reads there without per-query precision (its stored tokens, then ``fp``). The first
    ``exact`` queries read no token that left the window during the forward (every position from
    ``versions[0]``): the prefill's queries and those before the first exit of the window
    (:func:`kivi.cache.schedule.query_boundaries`).

    One encoding for both causes of per-query precision, because both are "this query reads these
    positions from another version": a plain side's boundary is two versions, ``fp`` and the tokens as
    they are once out of the window (``choice[i, t] = 1`` for ``t < e_i``, query ``i``'s exits), and a
    tiered side's demotions are one version per tier (:func:`kivi.cache.schedule.query_tier_ranges`).
    A list of (query range -> store/fp split) segments would also say the boundary, but not a token
    read at a tier it only reaches during the forward, so tiers would need the versions anyway; and
    the versions are what reference and blocked attention already read. Made by
    :func:`kivi.cache.boundary.set_boundary`.
    """

    first: int
    versions: tuple[torch.Tensor, ...]
    choice: torch.Tensor
    exact: int

    @property
    def queries(self) -> int:
        return self.choice.shape[0]

    def for_queries(self, first: int) -> "QueryRegion":
        """The region as the forward's queries from ``first`` on see it (their rows of ``choice``)."""
        return replace(self, choice=self.choice[first:], exact=max(0, self.exact - first))


@dataclass
class AttentionView:
    """What one side (keys or values) of a layer shows attention for the current forward.

    ``store`` tokens ``[store.start, split)`` come from storage (quantized unless ``quantized`` is
    False); ``fp [B, H, T_fp, D]`` holds the tokens ``[split, split + T_fp)`` at full precision
    (the old window followed by the new tokens). ``sink [B, H, S, D]`` (or ``None``) holds the
    tokens ``[0, S)`` at full precision; the store then starts at ``S``.

    Per-query precision (a forward of ``n > 1`` tokens into a layer that already holds tokens:
    a speculative verify forward, a chunk of chunked evaluation or prefill): one-token decoding
    would have moved some of the ``fp`` tokens out of the window (and, with position tiers, stored
    tokens down the tiers) before the later queries run. ``region`` (a :class:`QueryRegion`, or
    ``None`` when every query reads the view as it is: every decode step, a prefill into an empty
    layer) says what each query reads instead. Tokens out of the window are as storage will hold
    them: sink tokens exact, stored tokens quantized and dequantized (bit-identical: key groups are
    fixed aligned groups and values are quantized per token, so a token's quantized value does not
    depend on when it is quantized).

    A layer's side is read as a sequence of head groups (``groups`` / ``views``): this view is one
    group covering all its heads; a layer with per-head widths gives
    :class:`~kivi.cache.heads.HeadViews`, several. Attention loops over them alike.
    """

    store: "BlockStore"
    split: int
    fp: torch.Tensor
    quantized: bool
    sink: torch.Tensor | None = None
    start: int = 0  # first token position covered, fixed when the view is made (the store moves on)
    region: QueryRegion | None = None  # per-query precision of a multi-token forward

    @property
    def tiered(self) -> bool:
        """Whether the stored tokens come from position tiers of several widths (``store`` is a
        :class:`~kivi.cache.tiers.TierChain`): readers that need one width per side refuse it."""
        return isinstance(self.store, TierChain)

    @property
    def per_query(self) -> bool:
        """Whether queries of this forward read some tokens at different precisions (``region`` set)."""
        return self.region is not None

    @property
    def groups(self) -> tuple[HeadRange]:
        """The side's head groups: one, all of this view's heads."""
        return (HeadRange(0, self.fp.shape[1]),)

    @property
    def views(self) -> tuple["AttentionView"]:
        """The view of each head group: this one."""
        return (self,)

    def for_queries(self, first: int) -> "AttentionView":
        """The view as the forward's queries from ``first`` on see it (their rows of the region)."""
        if self.region is None or not first:
            return self
        return replace(self, region=self.region.for_queries(first))


def exact_queries(n: int, *sides) -> int:
    """How many leading queries of a forward of ``n`` compute exact attention over the tokens ``[0, i]``
    in every view of ``sides`` (``AttentionView`` s or :class:`~kivi.cache.heads.HeadViews`): the one
    prefill predicate of the ``"kivi"`` attentions, which run these queries through SDPA over ``fp``.

    ``n`` when nothing is stored and no token leaves the window (a prefill into an empty layer); with a
    per-query region, its ``exact`` leading queries (the prompt of a prefill that also holds speculative
    candidates) when the forward is into an empty layer; ``0`` otherwise.
    """
    return min((_view_exact(view, n) for side in sides for view in side.views), default=n)


def _view_exact(view: AttentionView, n: int) -> int:
    if not view.quantized or view.sink is not None or view.split != view.start:
        return 0
    if view.region is None:
        return n
    leading = view.region.exact
    if leading < n and view.fp.shape[-2] != n:
        # a split of the forward is for one into an empty layer (query i at position i, what the SDPA
        # call over fp[:exact] assumes); a later chunk's leading queries sit after the tokens held before
        # it and go through the backend with the rest
        return 0
    return leading


def materialize(view: AttentionView, dtype: torch.dtype | None = None, *, query: int | None = None) -> torch.Tensor:
    """``[B, H, T, D]``: the view's sink, its stored tokens dequantized, then its full-precision part.

    The reference path (what ``KiviCache.update`` returns for ``attention_backend="reference"``,
    and what every attention backend is tested against). ``dtype`` defaults to ``view.fp``'s.
    ``query=i`` (views with a per-query region): the tokens as query ``i`` of the forward reads them
    (``-1``: the last query).
    """
    dtype = dtype or view.fp.dtype
    parts = [] if view.sink is None else [view.sink.to(dtype)]
    for _, seg in view.store.iter_blocks(view.split):
        parts.append(dequantize_kv(seg, dtype) if view.quantized else seg.data.to(dtype))
    if view.fp.shape[-2] or not parts:
        parts.append(view.fp.to(dtype))
    full = torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]
    if query is None:
        return full
    r = view.region
    if r is None:
        raise ValueError("materialize(query=...): this view has no per-query region (region is None)")
    off, L = r.first - view.start, r.versions[0].shape[-2]
    full = full.clone()
    region = full[:, :, off:off + L]  # [B, H, L, D], a view into full
    for k in range(1, len(r.versions)):
        use = r.choice[query] == k  # [L]
        region[:, :, use] = r.versions[k][:, :, use].to(dtype)
    return full


@dataclass(frozen=True)
class PackedStates:
    """The keys or values ``KiviCache.update`` returns when attention reads packed storage.

    ``view``: what attention must see of this side; ``backend``: the :class:`~kivi.backends.Backend`
    the cache was built for (``"cpu"`` or ``"triton"``, resolved once when the cache was built), or
    ``"reference"``: a materialising cache returns these instead of tensors for a forward whose
    queries read tokens at different precisions (plain tensors cannot say that). A name given here is
    turned into its backend object once (:func:`kivi.backends.backend_named`). Not a
    tensor: any torch function that receives one, or a tensor attribute read on it (``.shape``:
    the model's attention is not ``"kivi"``), raises a ``TypeError`` saying how to build a cache
    that attention reads, instead of computing over the wrong tokens.
    """

    view: AttentionView
    backend: Backend

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            object.__setattr__(self, "backend", backend_named(self.backend))

    def _refusal(self, what: str) -> TypeError:
        """The error for ``what`` ("<torch function> received", "attention read .<attribute> of") this object."""
        if not self.backend.packed:
            return TypeError(
                f"{what} kivi PackedStates from a 'reference' KiviCache: this forward of several tokens "
                "into a non-empty cache (chunked prefill or evaluation, a speculative verify forward) gives each "
                "query its own precision, which plain tensors cannot express. Run the model with the 'kivi' "
                "attention (kivi.quantize_model does so unless the model's attention needs softcapping or sinks), "
                "or build the cache with KiviCache.from_model(model) for the model as it runs (plain tensors: "
                "every query reads the history as it was before the forward)"
            )
        return TypeError(
            f"{what} kivi PackedStates: this KiviCache was built for the 'kivi' attention "
            "implementation (attention reads the packed cache), but the model's attention is another one "
            "(e.g. after kivi.dequantize_model). Call kivi.quantize_model(model) to read this cache, or build "
            "a new one with KiviCache.from_model(model) for the model as it runs (dequantized tensors)"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        flat = [b for a in (*args, *(kwargs or {}).values()) for b in (a if isinstance(a, (list, tuple)) else (a,))]
        found = [a for a in flat if isinstance(a, PackedStates)]  # (torch.cat takes a list of tensors)
        ref = [a for a in found if not a.backend.packed]
        raise (ref or found)[0]._refusal(f"{name} received")

    def __getattr__(self, name: str):
        # Only reached for attributes a PackedStates does not have: tensor ones (``.shape``, ``.transpose``)
        # mean a non-"kivi" attention got it. Private and dunder names stay AttributeErrors (copy, pickle).
        if name.startswith("_") or name in self.__dataclass_fields__:  # a field not set yet (unpickling)
            raise AttributeError(name)
        raise self._refusal(f"attention read .{name} of")


__all__ = ["AttentionView", "HeadRange", "PackedStates", "QueryRegion", "exact_queries", "materialize"]
