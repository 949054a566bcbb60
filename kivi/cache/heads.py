"""Per-head widths: one layer whose kv heads hold different ``(k_bits, v_bits)``.

:class:`HeadSplitLayer` is a :class:`~kivi.cache.layer.KiviLayer` with one pair of
:class:`~kivi.cache.side.SideState` s per *head group*: a contiguous run of kv heads that share one
width (:func:`head_groups`). Every step runs the layer's one code path (:func:`kivi.cache.step.append_side`):
the window and the new tokens are joined once for all heads, each group gets the view of its head
slice and stores what leaves the window at its width, and the window that stays is one tensor whose
head slices are the groups' windows; it returns the groups' views in head order (:class:`HeadViews`). KIVI quantizes
each head on its own
(key groups run over tokens within one channel of one head, value groups over channels within one
token of one head), so a head stored in a group holds exactly the bits it would hold in a layer of
that width: a split layer whose groups all have the same width is bit-identical to a plain layer.

All groups share the layer's schedule (residual length, group size, sink, sliding window; only the
widths differ), so they agree on every token count, mask size and per-query boundary. Every change
is all or nothing across the groups: a failure in any group's append, crop or batch edit puts every
group back as it was.

Attention (:mod:`kivi.attention.interface`) runs each group's views with that group's query heads:
with ``g = num_heads // num_kv_heads`` query heads per kv head (GQA), kv heads ``[lo, hi)`` are read
by query heads ``[lo * g, hi * g)``, and the outputs are concatenated in head order; a decode step on the
``"cpu"`` backend reads every group in one fused kernel call (:func:`kivi.attention.fused_cpu.fused_decode_heads`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..config import KiviConfig
from .layer import KiviLayer
from .sliding import SlidingKiviLayer, new_layer
from .view import AttentionView, HeadRange, materialize


@dataclass(frozen=True)
class HeadGroup(HeadRange):
    """kv heads ``[start, stop)`` of a layer, stored with ``k_bits`` / ``v_bits``."""

    k_bits: int
    v_bits: int


def head_groups(k_bits: Sequence[int], v_bits: Sequence[int]) -> list[HeadGroup]:
    """Contiguous runs of kv heads with equal ``(k_bits, v_bits)``, in head order (the one grouping rule)."""
    if len(k_bits) != len(v_bits) or not k_bits:
        raise ValueError(f"head widths: {len(k_bits)} key widths and {len(v_bits)} value widths; "
                         "expected one of each per kv head")
    groups: list[HeadGroup] = []
    for h, (kb, vb) in enumerate(zip(k_bits, v_bits)):
        if groups and (groups[-1].k_bits, groups[-1].v_bits) == (kb, vb):
            groups[-1] = dataclasses.replace(groups[-1], stop=h + 1)
        else:
            groups.append(HeadGroup(h, h + 1, int(kb), int(vb)))
    return groups


@dataclass
class HeadViews:
    """One side of a :class:`HeadSplitLayer` for one forward: ``views[i]`` covers kv heads ``groups[i]``.

    Read like an :class:`~kivi.cache.view.AttentionView` (one group): ``groups`` / ``views``, ``fp``,
    ``per_query``, ``for_queries``; attention loops over the groups without asking which it holds.
    """

    groups: tuple[HeadGroup, ...]
    views: tuple[AttentionView, ...]

    @property
    def per_query(self) -> bool:
        return any(v.per_query for v in self.views)

    @property
    def fp(self) -> torch.Tensor:
        """``[B, H, T_fp, D]``: the groups' full-precision parts in head order."""
        return torch.cat([v.fp for v in self.views], dim=1)

    def for_queries(self, first: int) -> "HeadViews":
        """Every group's view as the forward's queries from ``first`` on see it."""
        return HeadViews(self.groups, tuple(v.for_queries(first) for v in self.views))


def materialize_heads(views: HeadViews | AttentionView, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, H, T, D]``: :func:`~kivi.cache.view.materialize` of every head group, concatenated over heads."""
    parts = [materialize(v, dtype) for v in views.views]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


class HeadSplitLayer(KiviLayer):
    """A layer whose kv heads hold different widths: one pair of side states per :class:`HeadGroup`."""

    def __init__(self, config: KiviConfig, k_bits: Sequence[int], v_bits: Sequence[int], *,
                 groups: Sequence[HeadGroup] | None = None):
        """``config``: the layer's config (``for_layer``); ``k_bits`` / ``v_bits``: one width per kv head.

        ``groups`` (tests): an explicit split into contiguous groups covering the heads in order; the
        default is :func:`head_groups`.
        """
        self.groups = tuple(groups) if groups is not None else tuple(head_groups(k_bits, v_bits))
        if (self.groups[0].start != 0 or any(a.stop != b.start for a, b in zip(self.groups, self.groups[1:]))
                or self.groups[-1].stop != len(k_bits)):
            raise ValueError(f"head groups {self.groups} must cover kv heads 0..{len(k_bits) - 1} in order")
        if config.tiers and len(self.groups) > 1:
            raise ValueError(f"head_bits with different widths per head (k_bits={list(k_bits)}, v_bits={list(v_bits)}) "
                             f"cannot be combined with tiers={[list(t) for t in config.tiers]}: a tier has one width "
                             "per side; use one of the two for this layer")
        self.num_kv_heads = len(k_bits)
        super().__init__(config)

    def _part_specs(self) -> list:
        return [(slice(g.start, g.stop), dataclasses.replace(self.config, k_bits=g.k_bits, v_bits=g.v_bits))
                for g in self.groups]

    @property
    def k(self):
        raise AttributeError("a HeadSplitLayer holds one key side per head group: read layer.parts[i].k")

    @property
    def v(self):
        raise AttributeError("a HeadSplitLayer holds one value side per head group: read layer.parts[i].v")

    def window(self, name: str) -> torch.Tensor | None:
        """``[B, H, W, D]``: side ``name``'s window over every head (the groups' windows are its head slices
        after a step, :class:`~kivi.cache.step.SharedWindow`)."""
        return self._windows[name].get(self.sides(name))

    def _result(self, views: list[AttentionView]) -> "HeadViews":
        return HeadViews(self.groups, tuple(views))

    def _materialize(self, views: "HeadViews") -> torch.Tensor:
        return materialize_heads(views, self.dtype)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_heads(key_states, value_states)
        super().lazy_initialization(key_states, value_states)

    def _check_heads(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if x.dim() != 4 or x.shape[1] != self.num_kv_heads:
                raise ValueError(
                    f"{name} of shape {tuple(x.shape)}: this layer's head_bits give {self.num_kv_heads} kv heads "
                    f"(one width per kv head), the model gives {x.shape[1] if x.dim() == 4 else '?'}")

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None) -> tuple:
        self._check_heads(key_states, value_states)
        return super()._append(key_states, value_states, valid)


class SlidingHeadSplitLayer(SlidingKiviLayer, HeadSplitLayer):
    """A :class:`HeadSplitLayer` of a sliding-window attention layer (:class:`SlidingKiviLayer`'s eviction)."""

    def __init__(self, config: KiviConfig, k_bits: Sequence[int], v_bits: Sequence[int], sliding_window: int, *,
                 groups: Sequence[HeadGroup] | None = None):
        super().__init__(config, sliding_window, k_bits, v_bits, groups=groups)


#: The layer classes a KiviCache builds (checkpointed, counted, saved or refused by kind).
KIVI_LAYERS = (KiviLayer,)


def build_layer(config: KiviConfig, layer_idx: int, sliding_window: int | None = None) -> KiviLayer | HeadSplitLayer:
    """Layer ``layer_idx`` of a cache with ``config``: a :class:`HeadSplitLayer` where ``head_bits`` names it."""
    widths = config.layer_head_bits(layer_idx)
    lcfg = config.for_layer(layer_idx)
    if widths is None:
        return new_layer(lcfg, sliding_window)
    if sliding_window is None:
        return HeadSplitLayer(lcfg, widths[0], widths[1])
    return SlidingHeadSplitLayer(lcfg, widths[0], widths[1], sliding_window)


def kv_heads_of(model_config: Any) -> int | None:
    """The model's number of kv heads (``None`` if its config does not say)."""
    from .support import text_config

    text = text_config(model_config)
    n = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    return int(n) if n else None


__all__ = ["HeadGroup", "HeadViews", "HeadSplitLayer", "SlidingHeadSplitLayer", "KIVI_LAYERS", "build_layer",
           "head_groups", "materialize_heads", "kv_heads_of"]
