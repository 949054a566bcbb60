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


@dataclass
class AttentionView:
    """What one side (keys or values) of a layer shows attention for the current forward.

    ``store`` tokens ``[store.start, split)`` come from storage (quantized unless ``quantized`` is
    False); ``fp [B, H, T_fp, D]`` holds the tokens ``[split, split + T_fp)`` at full precision
    (the old window followed by the new tokens). ``sink [B, H, S, D]`` (or ``None``) holds the
    tokens ``[0, S)`` at full precision; the store then starts at ``S``.

    Per-query precision (a forward of ``n > 1`` tokens into a layer that already holds tokens:
    a speculative verify forward, a chunk of chunked evaluation or prefill): one-token decoding
    would have moved some of the ``fp`` tokens out of the window before the later queries run.
    ``fp_from[i]`` (``n`` non-decreasing absolute positions, or ``None`` for "every query reads
    ``fp``") is the first token query ``i`` reads from ``fp``; it reads the tokens
    ``[split, fp_from[i])`` from ``left [B, H, M, D]``, which holds the tokens
    ``[split, split + M)`` (``M = fp_from[-1] - split``) as they are once they left the window:
    sink tokens exact, stored tokens quantized and dequantized (bit-identical to what the store
    will hold: key groups are fixed aligned groups and values are quantized per token, so a
    token's quantized value does not depend on when it is quantized). The rule is
    :func:`kivi.cache.schedule.query_boundaries`; ``None`` for every decode step (``n = 1``) and
    for a prefill into an empty layer. A side with position tiers also moves stored tokens down the
    tiers at each step: its view carries ``variants`` / ``choice`` (below) instead of ``left``.
    Readers walk either form through :meth:`variant_region`.
    """

    store: "BlockStore"
    split: int
    fp: torch.Tensor
    quantized: bool
    sink: torch.Tensor | None = None
    start: int = 0  # first token position covered, fixed when the view is made (the store moves on)
    fp_from: tuple[int, ...] | None = None  # per query: first token read from ``fp`` (None: all of them)
    left: torch.Tensor | None = None  # [B, H, M, D]: tokens [split, split + M) once out of the window
    # Position tiers (a tiered side's per-query views carry these instead of ``left``): the tokens
    # ``[variant_from, variant_from + L)`` exist in several versions, ``variants[k] [B, H, L, D]``
    # (``[0]``: what the view reads there without per-query precision: the stored tokens at their tier
    # before the forward, then ``fp``; ``[1 + j]``: the tokens at quantized tier ``j``, newest first,
    # dequantized), and query ``i`` reads position ``variant_from + t`` from ``variants[choice[i, t]]``
    # (``choice [n, L]`` uint8). Rule: :func:`kivi.cache.schedule.query_tier_ranges`.
    variant_from: int | None = None
    variants: tuple[torch.Tensor, ...] | None = None
    choice: torch.Tensor | None = None

    @property
    def only_full_precision(self) -> bool:
        """Every query reads every token at full precision from ``fp`` (no sink, nothing stored, no
        token leaving the window during the forward)."""
        return self.quantized and self.sink is None and self.split == self.start and self.fp_from is None

    @property
    def tiered(self) -> bool:
        """Whether the stored tokens come from position tiers of several widths (``store`` is a
        :class:`~kivi.cache.tiers.TierChain`): readers that need one width per side refuse it."""
        return isinstance(self.store, TierChain)

    @property
    def per_query(self) -> bool:
        """Whether queries of this forward read some tokens at different precisions (``fp_from`` set)."""
        return self.fp_from is not None

    def variant_region(self) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor] | None:
        """``(first, versions, choice)`` of a per-query view (see the fields above), ``None`` otherwise: what
        readers walk. A view with ``left`` gives ``(split, (fp[:M], left), choice)`` with ``choice[i, t] = 1``
        where query ``i`` reads position ``split + t`` from ``left``."""
        if self.choice is not None:
            return self.variant_from, self.variants, self.choice
        if self.fp_from is None:
            return None
        m = self.left.shape[-2]
        use = self.query_reads_left(self.split, self.split + m)
        return self.split, (self.fp[:, :, :m], self.left), use.to(torch.uint8)

    def for_queries(self, first: int) -> "AttentionView":
        """The view as the forward's queries from ``first`` on see it (their rows of the per-query boundary)."""
        if self.fp_from is None or not first:
            return self
        return replace(self, fp_from=self.fp_from[first:], choice=None if self.choice is None else self.choice[first:])

    def query_reads_left(self, first: int, end: int, queries: slice = slice(None)) -> torch.Tensor:
        """``[n_q, end - first]`` bool: where query ``i`` (of ``queries``) reads kv position ``first + j``
        from ``left`` rather than from ``fp``/store (the positions ``[split, fp_from[i])``)."""
        if self.fp_from is None:
            raise ValueError("query_reads_left: this view has no per-query boundary (fp_from is None)")
        dev = self.fp.device
        bound = torch.tensor(self.fp_from[queries], dtype=torch.long, device=dev)  # [n_q]
        pos = torch.arange(first, end, device=dev)  # [T]
        return (pos[None, :] >= self.split) & (pos[None, :] < bound[:, None])


def materialize(view: AttentionView, dtype: torch.dtype | None = None, *, left: bool = False) -> torch.Tensor:
    """``[B, H, T, D]``: the view's sink, its stored tokens dequantized, then its full-precision part.

    The reference path (what ``KiviCache.update`` returns for ``attention_backend="reference"``,
    and what every attention backend is tested against). ``dtype`` defaults to ``view.fp``'s.
    ``left=True`` (views with a per-query boundary): the tokens ``[split, split + M)`` come from
    ``view.left`` instead, i.e. what the forward's last query reads; query ``i`` reads this tensor
    where :meth:`AttentionView.query_reads_left` is True and the ``left=False`` one elsewhere.
    """
    dtype = dtype or view.fp.dtype
    parts = [] if view.sink is None else [view.sink.to(dtype)]
    for _, seg in view.store.iter_blocks(view.split):
        parts.append(dequantize_kv(seg, dtype) if view.quantized else seg.data.to(dtype))
    fp = view.fp
    if left:
        if view.left is None:
            raise ValueError("materialize(left=True): this view has no per-query boundary (left is None)")
        fp = torch.cat([view.left.to(fp.dtype), fp[:, :, view.left.shape[-2]:]], dim=-2)
    if fp.shape[-2] or not parts:
        parts.append(fp.to(dtype))
    return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]


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


__all__ = ["AttentionView", "PackedStates", "materialize"]
