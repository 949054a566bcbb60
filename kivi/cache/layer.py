"""`KiviLayer`: one attention layer's KIVI cache (a transformers ``CacheLayerMixin``).

The layer orchestrates; its parts hold the state. Each side (keys, values) of each head group is a
:class:`~kivi.cache.side.SideState` (window, sink, storage, padding marks); what leaves the window is
:mod:`kivi.cache.schedule`'s rule; one forward's step over a side is :func:`kivi.cache.step.append_side`;
the per-query boundary of a multi-token forward is :mod:`kivi.cache.boundary`. A plain layer has one
head group; :class:`~kivi.cache.heads.HeadSplitLayer` several; :class:`~kivi.cache.sliding.SlidingKiviLayer`
evicts what a sliding window no longer reaches.

Keys leave the window only in whole groups of ``G`` tokens aligned on absolute positions
(``S, S + G, S + 2G, ...``; ``S = 0`` without sink tokens), and only once at least
``residual_length`` newer keys remain, so the key window holds ``R`` to ``R + G - 1`` tokens. A value
leaves the window once it is more than ``residual_length`` tokens old. History is never re-quantized.

An update with ``n`` new tokens first returns what attention must see — the stored history
(quantized, or window) followed by the ``n`` new tokens at full precision — and only then moves
tokens from the window into quantized storage. Each query of a forward of ``n > 1`` tokens into a
layer that already holds tokens sees every earlier token at the precision one-token decoding would
give it at that query's step, so verify forwards of speculative decoding, chunked evaluation and the
chunks after the first of a chunked prefill equal one-token decoding. A forward into an empty layer
(a prefill) is exact attention over full-precision tokens, as KIVI prescribes; when ``prompt_length``
is set and the forward is longer (the prompt and the first speculative candidates in one forward),
only the prompt's queries are.

Crop: tokens still in the full-precision window come back bit-exact. With past recording active
(:meth:`KiviLayer.activate_past_recording`, which transformers' assisted and prompt-lookup decoding
call before their first forward), the move into quantized storage is deferred until the next
``crop`` (or the next forward), so cropping rejected speculative tokens leaves the layer exactly as
one-token decoding of the accepted tokens would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import KiviConfig
from .schedule import layer_sink_tokens, prefill_exact_queries
from .side import SideState
from .step import SharedWindow, append_side, flush_sides
from .support import check_head_dim
from .view import AttentionView, PackedStates, materialize

_SIDES = ("k", "v")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class HeadPart:
    """The keys and values of kv heads ``heads`` (``None``: all of them) of a layer, stored with ``config``."""

    heads: slice | None
    config: KiviConfig
    k: SideState
    v: SideState

    def memory_breakdown(self) -> dict[str, int]:
        out = {"codes": 0, "scales_zero_points": 0, "compensation": 0, "fp_window": 0, "fp_sink": 0,
               "fp_unquantized": 0, "padding_masks": 0}
        self.k.memory_breakdown(out)
        self.v.memory_breakdown(out)
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.memory_breakdown().values())


class KiviLayer(CacheLayerMixin):
    """KIVI cache for one layer. See the module docstring for the semantics."""

    is_compileable = False
    is_croppable = True
    sliding_window: int | None = None  # SlidingKiviLayer sets it

    def __init__(self, config: KiviConfig):
        super().__init__()
        self.config = config
        self.is_sliding = self.sliding_window is not None
        # Sliding layers keep no sink: their first tokens leave the attention window anyway.
        self.sink_tokens = layer_sink_tokens(config.sink_tokens, self.sliding_window)
        self.seen = 0
        self.parts = self._new_parts()
        self._windows = {name: SharedWindow([p.heads for p in self.parts]) for name in _SIDES}
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        # Past recording (transformers' name): the window keeps every token of the last forward at
        # full precision until the next crop / forward moves what is due (`due`), so crop is exact.
        self.record_past = False
        self.due = False
        # Queries of a forward into the empty layer that are the prompt (None: the whole forward); see
        # kivi.cache.schedule.prefill_exact_queries and KiviCache.set_prompt_length.
        self.prompt_length: int | None = None
        # False when the model's attention reads tensors only (it is not "kivi": never quantized, or
        # softcapping, e.g. Gemma2; set by KiviCache.from_model / load): `update` then materialises what the
        # forward's FIRST query sees for every query (approximate for multi-token forwards after the
        # prefill; docs/python.md, "Speculative decoding").
        self.per_query_views = True

    # ------------------------------------------------------------------ parts (HeadSplitLayer: one per head group)
    def _part_specs(self) -> list[tuple[slice | None, KiviConfig]]:
        return [(None, self.config)]

    def _new_parts(self) -> list[HeadPart]:
        return [HeadPart(h, c, SideState(c.side_format("k"), c, self.sink_tokens),
                         SideState(c.side_format("v"), c, self.sink_tokens)) for h, c in self._part_specs()]

    @property
    def k(self) -> SideState:
        return self.parts[0].k

    @property
    def v(self) -> SideState:
        return self.parts[0].v

    def sides(self, name: str) -> list[SideState]:
        """One side (``"k"`` / ``"v"``) of every head group."""
        return [getattr(p, name) for p in self.parts]

    def _result(self, views: list[AttentionView]) -> Any:
        """What :meth:`append` returns for one side (HeadSplitLayer: the groups' views together)."""
        return views[0]

    def _materialize(self, view: Any) -> torch.Tensor:
        return materialize(view, self.dtype)

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_head_dim(self.config, value_states.shape[-1])
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    # ------------------------------------------------------------------ all or nothing
    def checkpoint(self) -> tuple:
        """What :meth:`rollback` needs to put the layer back as it is now (references, no copies)."""
        return (self.seen, self.device, self.dtype, self.is_initialized, self.due, self.prompt_length,
                [(p.k.checkpoint(), p.v.checkpoint()) for p in self.parts])

    def rollback(self, checkpoint: tuple) -> None:
        """Undo every change made since :meth:`checkpoint` (appends, evictions, crops, batch edits)."""
        self.seen, self.device, self.dtype, self.is_initialized, self.due, self.prompt_length, sides = checkpoint
        for p, (k, v) in zip(self.parts, sides):
            p.k.rollback(k)
            p.v.rollback(v)

    @contextlib.contextmanager
    def all_or_nothing(self):
        """Run the body as one change of the layer: if it raises, the layer is put back as it was."""
        checkpoint = self.checkpoint()
        try:
            yield
        except BaseException:
            self.rollback(checkpoint)
            raise

    def activate_past_recording(self, **kwargs) -> None:
        """Defer moving tokens into quantized storage until the next ``crop`` or forward (transformers
        calls this before assisted / prompt-lookup decoding), so that ``crop`` is exact. ``kwargs``: transformers
        5.25 passes ``recurrent_states_to_keep`` (for recurrent states, which a KIVI layer has none of)."""
        self.record_past = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor] | tuple[PackedStates, PackedStates]:
        """Append ``[B, H, n, D]`` keys/values; return the keys/values attention sees (reference path).

        ``valid [B, n]`` marks real (non-padding) tokens; ``None`` means all are real. Plain tensors
        cannot give each query its own precision, so a forward whose views carry a per-query boundary
        returns ``PackedStates(view, "reference")`` instead: the ``"kivi"`` attention reads them with
        :func:`kivi.attention.reference.reference_attention` (:func:`kivi.quantize_model` switches a
        model with a ``"reference"`` cache to it); any other attention raises rather than give the
        later queries full-precision tokens one-token decoding would not give them.
        """
        with self.all_or_nothing():  # a failed dequantization undoes the append too
            kv, vv = self._append(key_states, value_states, valid)
            if (kv.per_query or vv.per_query) and self.per_query_views:
                return PackedStates(kv, "reference"), PackedStates(vv, "reference")
            return self._materialize(kv), self._materialize(vv)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, *,
               valid: torch.Tensor | None = None) -> tuple[Any, Any]:
        """Store new tokens; return the views attention must use for this forward (pre-move state).

        All or nothing: an error at any step (e.g. a non-finite value refused by the quantizer) leaves
        the layer exactly as it was before the call (stores, windows, sinks, evictions, counters).
        """
        with self.all_or_nothing():
            return self._append(key_states, value_states, valid)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None) -> tuple:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if valid is not None and bool(valid.all()):
            valid = None
        if self.due:
            self._flush_due()  # what the last forward left in the window (past recording, no crop came)
        self._before_forward()
        n = key_states.shape[-2]
        exact = prefill_exact_queries(self.seen, n, self.prompt_length)
        views = [self._result(append_side(self.sides(name), self._windows[name], x, valid, n,
                                          record=self.record_past, exact=exact))
                 for name, x in (("k", key_states), ("v", value_states))]
        self.seen += n
        self.due = self.record_past
        return views[0], views[1]

    def _before_forward(self) -> None:
        """What a layer does before building a forward's views (SlidingKiviLayer: evict)."""

    def _flush_due(self) -> None:
        """Move what the window holds beyond the schedule (deferred by past recording)."""
        for name in _SIDES:
            sides = self.sides(name)
            if sides[0].quantize and sides[0].window is not None:
                flush_sides(sides, self._windows[name], self._windows[name].get(sides), sides[0].window_valid,
                            fresh=False)
        self.due = False

    @property
    def kv_offset(self) -> int:
        """First absolute token position attention sees (0 unless sliding-window eviction happened)."""
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self.kv_offset
        return self.seen - kv_offset + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self.parts = self._new_parts()
        self.due = False
        self.is_initialized = False

    def offload(self):  # pragma: no cover - not supported
        raise NotImplementedError("KiviCache does not support offloading; it is already compressed")

    def prefetch(self):  # pragma: no cover - not supported
        raise NotImplementedError("KiviCache does not support offloading; it is already compressed")

    # ------------------------------------------------------------------ batch / beam operations, crop
    def _map(self, fn) -> None:
        with self.all_or_nothing():
            for name in _SIDES:
                for side in self.sides(name):
                    side.map_tensors(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers 5 convention: a negative count).

        Tokens still in the full-precision windows come back bit-exact; then what is due moves into
        storage, so with past recording active a crop into the last forward's tokens leaves the layer
        exactly as one-token decoding of the kept tokens would. Cropping further than the key window
        dequantizes the surviving part of the last key group back into the window (those tokens then
        hold their quantized approximations): exact crops need past recording, or a crop that stays
        within the window.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove (transformers 5 convention)"
            )
        if not self.is_initialized:
            return
        new_seen = self.seen + tokens_to_remove
        if new_seen < 0:
            raise ValueError(
                f"crop({tokens_to_remove}): the cache holds {self.seen} tokens, so at most {self.seen} can be removed"
            )
        if new_seen < self.kv_offset:
            raise ValueError(
                f"cannot crop to {new_seen} tokens: tokens before {self.kv_offset} were dropped by the sliding window"
            )
        with self.all_or_nothing():
            if tokens_to_remove:
                for name in _SIDES:
                    for side in self.sides(name):
                        side.crop(new_seen, self.dtype)
                self.seen = new_seen
            if self.due:
                self._flush_due()

    # ------------------------------------------------------------------ saving, accounting
    def state_dict(self) -> dict[str, Any]:
        """The layer's state as plain values and tensors (:mod:`kivi.cache.persist` writes it as is)."""
        return {"seen": self.seen, "initialized": bool(self.is_initialized), "sliding_window": self.sliding_window,
                "due": bool(self.due),  # past recording: the window still holds tokens due to move
                "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
                "parts": [{"k": p.k.state_dict(), "v": p.v.state_dict()} for p in self.parts]}

    def load_state_dict(self, state: dict[str, Any], device: str | torch.device = "cpu") -> None:
        """Put back a :meth:`state_dict` of a layer built with the same config; ``ValueError`` naming what differs."""
        if state["sliding_window"] != self.sliding_window:
            raise ValueError(f"sliding window {state['sliding_window']} saved, this layer has {self.sliding_window}")
        parts = state["parts"]
        if len(parts) != len(self.parts):
            raise ValueError(f"{len(parts)} head groups saved, this layer's config gives {len(self.parts)}")
        if state["dtype"] is not None and state["dtype"] not in _DTYPES:
            raise ValueError(f"dtype {state['dtype']!r} is not a floating-point dtype kivi caches")
        self.seen, self.due = int(state["seen"]), bool(state["due"])
        self.dtype = None if state["dtype"] is None else _DTYPES[state["dtype"]]
        if state["initialized"]:
            self.device = torch.device(device)
            self.is_initialized = True
        for p, sd in zip(self.parts, parts):
            for name in _SIDES:
                try:
                    getattr(p, name).load_state_dict(sd[name], device)
                except ValueError as e:
                    raise ValueError(f"side {name}: {e}") from None

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held, by kind: codes, scales/zero-points, compensation, windows, unquantized storage."""
        out: dict[str, int] = {}
        for p in self.parts:
            for k, v in p.memory_breakdown().items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.memory_breakdown().values())


__all__ = ["KiviLayer", "HeadPart"]
