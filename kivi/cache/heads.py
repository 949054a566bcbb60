"""Per-head widths: one layer whose kv heads hold different ``(k_bits, v_bits)``.

:class:`HeadSplitLayer` is a composition of ordinary :class:`~kivi.cache.layer.KiviLayer` s, one per
*head group*: a contiguous run of kv heads that share one width (:func:`head_groups`). Every
update splits the new keys/values along the head axis, appends each slice to its group's layer and
returns the groups' views in head order (:class:`HeadViews`). KIVI quantizes each head on its own
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
from transformers.cache_utils import CacheLayerMixin

from ..config import KiviConfig
from .layer import KiviLayer
from .view import AttentionView, PackedStates, materialize


@dataclass(frozen=True)
class HeadGroup:
    """kv heads ``[start, stop)`` of a layer, stored with ``k_bits`` / ``v_bits``."""

    start: int
    stop: int
    k_bits: int
    v_bits: int

    @property
    def heads(self) -> int:
        return self.stop - self.start


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
    """One side of a :class:`HeadSplitLayer` for one forward: ``views[i]`` covers kv heads ``groups[i]``."""

    groups: tuple[HeadGroup, ...]
    views: tuple[AttentionView, ...]

    @property
    def only_full_precision(self) -> bool:
        return all(v.only_full_precision for v in self.views)

    @property
    def per_query(self) -> bool:
        return any(v.per_query for v in self.views)

    @property
    def fp(self) -> torch.Tensor:
        """``[B, H, T_fp, D]``: the groups' full-precision parts in head order."""
        return torch.cat([v.fp for v in self.views], dim=1)


def materialize_heads(views: HeadViews | AttentionView, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, H, T, D]``: :func:`~kivi.cache.view.materialize` of every group, concatenated over heads."""
    if isinstance(views, AttentionView):
        return materialize(views, dtype)
    return torch.cat([materialize(v, dtype) for v in views.views], dim=1)


class HeadSplitLayer(CacheLayerMixin):
    """A layer whose kv heads hold different widths: one :class:`KiviLayer` per :class:`HeadGroup`."""

    is_compileable = False
    is_croppable = True

    def __init__(self, config: KiviConfig, k_bits: Sequence[int], v_bits: Sequence[int],
                 sliding_window: int | None = None, *, groups: Sequence[HeadGroup] | None = None):
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
        self.config = config
        self.num_kv_heads = len(k_bits)
        self.parts = [KiviLayer(dataclasses.replace(config, k_bits=g.k_bits, v_bits=g.v_bits), sliding_window)
                      for g in self.groups]
        super().__init__()
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    # ------------------------------------------------------------------ state shared by the groups
    @property
    def is_initialized(self) -> bool:
        return bool(getattr(self, "parts", None)) and self.parts[0].is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # CacheLayerMixin.__init__ sets it; the parts own it
        for p in getattr(self, "parts", ()):
            p.is_initialized = value

    def _shared(name: str):  # noqa: N805 - a property factory used in the class body
        def get(self):
            return getattr(self.parts[0], name)

        def set_(self, value):
            for p in self.parts:
                setattr(p, name, value)

        return property(get, set_, doc=f"``{name}`` of every group's layer (they share it)")

    record_past = _shared("record_past")
    prompt_length = _shared("prompt_length")
    per_query_views = _shared("per_query_views")
    del _shared

    @property
    def seen(self) -> int:
        return self.parts[0].seen

    @property
    def dtype(self) -> torch.dtype | None:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device | None:
        return self.parts[0].device

    @property
    def kv_offset(self) -> int:
        return self.parts[0].kv_offset

    # ------------------------------------------------------------------ all or nothing
    def checkpoint(self) -> tuple:
        return tuple(p.checkpoint() for p in self.parts)

    def rollback(self, checkpoint: tuple) -> None:
        for p, cp in zip(self.parts, checkpoint):
            p.rollback(cp)

    all_or_nothing = KiviLayer.all_or_nothing  # the same rule over this layer's checkpoint / rollback

    def _each(self, fn) -> None:
        with self.all_or_nothing():
            for p in self.parts:
                fn(p)

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_heads(key_states, value_states)

    def _check_heads(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if x.dim() != 4 or x.shape[1] != self.num_kv_heads:
                raise ValueError(
                    f"{name} of shape {tuple(x.shape)}: this layer's head_bits give {self.num_kv_heads} kv heads "
                    f"(one width per kv head), the model gives {x.shape[1] if x.dim() == 4 else '?'}")

    def activate_past_recording(self) -> None:
        self.record_past = True

    #: Decode steps write every group in one pass (:meth:`_joint_append`). False: every step goes through
    #: each group's own :meth:`KiviLayer.append` (the reference the tests compare the joint pass with).
    joint_decode = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, *,
               valid: torch.Tensor | None = None) -> tuple[HeadViews, HeadViews]:
        """Store new ``[B, H, n, D]`` tokens in every group; the groups' views (all groups or none change)."""
        with self.all_or_nothing():
            return self._append(key_states, value_states, valid)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor,
                valid: torch.Tensor | None) -> tuple[HeadViews, HeadViews]:
        """:meth:`append` without its checkpoint (the caller's covers every group: a group's own append
        needs none of its own)."""
        self._check_heads(key_states, value_states)
        if self.joint_decode and self._joint_ready(key_states, valid):
            k_views, v_views = self._joint_append(key_states, value_states)
        else:
            views = [p._append(key_states[:, g.start:g.stop].contiguous(), value_states[:, g.start:g.stop].contiguous(),
                               valid) for g, p in zip(self.groups, self.parts)]
            k_views, v_views = [k for k, _ in views], [v for _, v in views]
        return HeadViews(self.groups, tuple(k_views)), HeadViews(self.groups, tuple(v_views))

    def _joint_ready(self, key_states: torch.Tensor, valid: torch.Tensor | None) -> bool:
        """Whether this append is a plain decode step :meth:`_joint_append` writes: one token, no padding,
        no past recording, no sliding window or position tiers, both sides quantized, nothing moving into
        the sink. Every group then moves the same tokens (they share the schedule)."""
        p0 = self.parts[0]
        if (key_states.shape[-2] != 1 or not p0.is_initialized or p0.record_past or self.sliding_window is not None
                or self.config.tiers or not (p0.k.quantize and p0.v.quantize)
                or (valid is not None and not bool(valid.all()))):
            return False
        if any(p._due or p.k.window_valid is not None or p.v.window_valid is not None for p in self.parts):
            return False
        return not (p0._exits(p0.k, p0.k.window_len + 1)[0] or p0._exits(p0.v, p0.v.window_len + 1)[0])

    def _joint_append(self, key_states: torch.Tensor,
                      value_states: torch.Tensor) -> tuple[list[AttentionView], list[AttentionView]]:
        """:meth:`KiviLayer.append` of one decode step for every group at once, with the same result.

        Per side: the groups' windows are slices of one ``[B, H, W, D]`` tensor (:meth:`_window`), so the
        new token joins the window in one ``cat`` for the whole layer and the window after the step is one
        tensor again; only the tokens leaving the window are quantized group by group, each at its width
        (:meth:`KiviLayer._store_moved`, the groups' own rule).
        """
        out = []
        for name, x in (("k", key_states), ("v", value_states)):
            sides = [getattr(p, name) for p in self.parts]
            window = self._window(sides)
            pending = x if window is None else torch.cat([window, x], dim=-2)
            out.append([p._view(side, pending[:, g.start:g.stop]) for g, p, side in zip(self.groups, self.parts, sides)])
            total = pending.shape[-2]
            move = self.parts[0]._exits(sides[0], total)[1]
            if move:
                for g, p, side in zip(self.groups, self.parts, sides):
                    p._store_moved(side, pending[:, g.start:g.stop, :move], None)
            if move == total:
                window = None
            elif move or pending is x:  # exact copies that pin neither the caller's tensor nor what left
                window = pending[:, :, move:].clone()
            else:  # the fresh concatenation is exactly the new window
                window = pending
            for g, side in zip(self.groups, sides):
                side.window = None if window is None else window[:, g.start:g.stop]
        for p in self.parts:
            p.seen += 1
        return out[0], out[1]

    def _window(self, sides: list) -> torch.Tensor | None:
        """``[B, H, W, D]``: the groups' windows of one side as one tensor (``None`` when empty). The tensor
        they are slices of when :meth:`_joint_append` wrote them (no copy), else their concatenation."""
        windows = [side.window for side in sides]
        if windows[0] is None:
            return None
        base = windows[0]._base
        if (base is not None and base.shape[1] == self.num_kv_heads and base.shape[-2] == windows[0].shape[-2]
                and all(w._base is base and w.storage_offset() == base.storage_offset() + g.start * base.stride(1)
                        for w, g in zip(windows, self.groups))):
            return base
        return torch.cat(windows, dim=1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor] | tuple[PackedStates, PackedStates]:
        """The reference path (see :meth:`KiviLayer.update`): dequantized keys/values concatenated over heads."""
        with self.all_or_nothing():
            kv, vv = self._append(key_states, value_states, valid)
            if (kv.per_query or vv.per_query) and self.per_query_views:
                return PackedStates(kv, "reference"), PackedStates(vv, "reference")
            return materialize_heads(kv, self.dtype), materialize_heads(vv, self.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.parts[0].get_seq_length()

    def get_max_length(self) -> int:
        return self.parts[0].get_max_length()

    def reset(self) -> None:
        for p in self.parts:
            p.reset()

    def offload(self):  # pragma: no cover - not supported
        raise NotImplementedError("KiviCache does not support offloading; it is already compressed")

    def prefetch(self):  # pragma: no cover - not supported
        raise NotImplementedError("KiviCache does not support offloading; it is already compressed")

    def crop(self, tokens_to_remove: int) -> None:
        self._each(lambda p: p.crop(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each(lambda p: p.reorder_cache(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each(lambda p: p.batch_select_indices(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each(lambda p: p.batch_repeat_interleave(repeats))

    # ------------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            for k, v in p.memory_breakdown().items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.memory_breakdown().values())


#: The layer classes a KiviCache builds (checkpointed, counted, saved or refused by kind).
KIVI_LAYERS = (KiviLayer, HeadSplitLayer)


def build_layer(config: KiviConfig, layer_idx: int, sliding_window: int | None = None) -> KiviLayer | HeadSplitLayer:
    """Layer ``layer_idx`` of a cache with ``config``: a :class:`HeadSplitLayer` where ``head_bits`` names it."""
    widths = config.layer_head_bits(layer_idx)
    lcfg = config.for_layer(layer_idx)
    if widths is None:
        return KiviLayer(lcfg, sliding_window=sliding_window)
    return HeadSplitLayer(lcfg, widths[0], widths[1], sliding_window)


def kv_heads_of(model_config: Any) -> int | None:
    """The model's number of kv heads (``None`` if its config does not say)."""
    from .support import text_config

    text = text_config(model_config)
    n = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    return int(n) if n else None


__all__ = ["HeadGroup", "HeadViews", "HeadSplitLayer", "KIVI_LAYERS", "build_layer", "head_groups",
           "materialize_heads", "kv_heads_of"]
