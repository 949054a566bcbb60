"""`KiviLayer`: one attention layer's KIVI cache (a transformers ``CacheLayerMixin``).

State, for keys and for values separately (``seen`` tokens so far):

* ``store`` — a :class:`BlockStore` of quantized tokens ``[store.start, store.length)``
  (or full-precision tokens when that side is not quantized);
* ``window`` — the full-precision tokens ``[store.length, seen)``, bit-exact copies of the inputs;
* ``sink`` — with ``sink_tokens = S > 0``: the first ``S`` tokens ``[0, S)`` in full precision, kept
  forever and left out of every quantization statistic; the store then starts at ``S``.

Keys leave the window only in whole groups of ``G`` tokens aligned on absolute positions
(``S, S + G, S + 2G, ...``; ``S = 0`` without sink tokens), and only once at least
``residual_length`` newer keys remain, so the key window holds ``R`` to ``R + G - 1`` tokens. A value leaves the window once it is more than
``residual_length`` tokens old. History is never re-quantized.

An update with ``n`` new tokens first returns what attention must see — the stored history
(quantized, or window) followed by the ``n`` new tokens at full precision — and only then moves
tokens from the window into quantized storage. Each query of a forward of ``n > 1`` tokens into a
layer that already holds tokens sees every earlier token at the precision one-token decoding would
give it at that query's step (the views' per-query boundary, :func:`~kivi.cache.schedule.query_boundaries`):
so verify forwards of speculative decoding, chunked evaluation and the chunks after the first of a
chunked prefill equal one-token decoding. A forward into an empty layer (a prefill) is exact
attention over full-precision tokens, as KIVI prescribes (its queries' history is the prompt itself);
when ``prompt_length`` is set and the forward is longer (the prompt and the first speculative
candidates in one forward), only the prompt's queries are.

Crop: tokens still in the full-precision window come back bit-exact. With past recording active
(:meth:`KiviLayer.activate_past_recording`, which transformers' assisted and prompt-lookup decoding
call before their first forward), the move into quantized storage is deferred until the next
``crop`` (or the next forward), so cropping rejected speculative tokens leaves the layer exactly as
one-token decoding of the accepted tokens would.

Sliding-window layers (``sliding_window=W``) stop exposing tokens that no future query can reach
(older than ``W + R + G`` tokens, cut at a multiple of ``block_size``) and free the blocks that held
only those; ``get_mask_sizes`` reports the first exposed token as the mask's ``kv_offset``.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import KiviConfig
from ..quant.fused_cpu import quantize_tokens_into, token_quantizer_supported
from ..quant.demote import demote_kv
from ..quant.kv import PackedKV, dequantize_kv, quantize_kv, token_divisor
from .schedule import (flush_count, key_group_start, layer_sink_tokens, prefill_exact_queries, query_boundaries,
                       query_tier_ranges, sliding_cut, tier_keeps, tier_ranges, window_exits)
from .store import BlockStore, FpSegment
from .tiers import TierChain
from .support import check_head_dim
from .view import AttentionView, PackedStates, materialize

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _Side:
    """Storage of keys or of values for one layer."""

    def __init__(self, axis: str, quantize: bool, bits: int, block_size: int, tiers: tuple | None = None):
        self.axis = axis  # "channel" for keys, "token" for values
        self.quantize = quantize
        self.bits = bits
        self.store = BlockStore(block_size)  # the newest quantized tier (what leaves the window goes here)
        # Position tiers (KiviConfig.tiers): the older tiers' stores, oldest first, their widths, and the
        # token count of every tier of the chain but the oldest (`keeps[i]` for chain[i + 1]).
        j = 0 if axis == "channel" else 1
        self.older: list[BlockStore] = [BlockStore(block_size) for _ in (tiers or ())[2:]]
        self.older_bits: list[int] = [b[j] for _, b in reversed((tiers or ())[2:])]
        self.keeps: tuple[int, ...] = tuple(reversed(tier_keeps(tiers))) if tiers else ()
        self.window: torch.Tensor | None = None  # [B, H, W, D]
        self.window_valid: torch.Tensor | None = None  # [B, W] bool, None = all valid
        # [B, P] bool: which stored keys [0, P) were real tokens, kept up to the last padded one only
        # (None: no padding stored); a crop into a key group puts its survivors back in the window
        # with their padding marks, so padding stays out of the group's statistics when re-stored.
        self.stored_valid: torch.Tensor | None = None
        self.sink: torch.Tensor | None = None  # [B, H, S, D], tokens [0, S)

    @property
    def window_len(self) -> int:
        return 0 if self.window is None else self.window.shape[-2]

    @property
    def sink_len(self) -> int:
        return 0 if self.sink is None else self.sink.shape[-2]

    @property
    def chain(self) -> list[BlockStore]:
        """Every store of the side, oldest tier first (just ``[store]`` without tiers)."""
        return [*self.older, self.store]

    def checkpoint(self) -> tuple:
        """The side's state (tensors are replaced, never written in place, so references suffice;
        the store objects too: a crop into the sink replaces them)."""
        return (self.store, self.store.checkpoint(), self.window, self.window_valid, self.sink, self.stored_valid,
                list(self.older), [o.checkpoint() for o in self.older])

    def rollback(self, checkpoint: tuple) -> None:
        self.store, store, self.window, self.window_valid, self.sink, self.stored_valid, older, cps = checkpoint
        self.store.rollback(store)
        self.older = older
        for o, cp in zip(older, cps):
            o.rollback(cp)

    def map_tensors(self, fn) -> None:
        for store in self.chain:
            store.map_tensors(fn)
        if self.sink is not None:
            self.sink = fn(self.sink)
        if self.window is not None:
            self.window = fn(self.window)
        if self.window_valid is not None:
            self.window_valid = fn(self.window_valid)
        if self.stored_valid is not None:
            self.stored_valid = fn(self.stored_valid)


class KiviLayer(CacheLayerMixin):
    """KIVI cache for one layer. See the module docstring for the semantics."""

    is_compileable = False
    is_croppable = True

    def __init__(self, config: KiviConfig, sliding_window: int | None = None):
        super().__init__()
        self.config = config
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # Sliding layers keep no sink: their first tokens leave the attention window anyway.
        self.sink_tokens = layer_sink_tokens(config.sink_tokens, sliding_window)
        self.seen = 0
        if config.tiers and sliding_window is not None:
            raise ValueError(f"tiers={list(config.tiers)} are not supported on sliding-window layers (this layer has "
                             f"sliding_window={sliding_window}); use a config without tiers for this model")
        if config.quantize_after and sliding_window is not None:
            raise ValueError(f"quantize_after={config.quantize_after} is not supported on sliding-window layers (this "
                             f"layer has sliding_window={sliding_window}: its window evicts stored blocks only); set "
                             f"it to 0 for the sliding layers in layer_specific_config")
        self.k, self.v = self._new_sides()
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self._fast: dict[torch.dtype, bool] = {}  # values quantized by the numba pass, per input dtype
        # Past recording (transformers' name): the window keeps every token of the last forward at
        # full precision until the next crop / forward moves what is due (`_due`), so crop is exact.
        self.record_past = False
        self._due = False
        # Queries of a forward into the empty layer that are the prompt (None: the whole forward); see
        # kivi.cache.schedule.prefill_exact_queries and KiviCache.set_prompt_length.
        self.prompt_length: int | None = None
        # False when the model's attention reads tensors only (it is not "kivi": never quantized, or
        # softcapping, e.g. Gemma2; set by KiviCache.from_model / load): `update` then materialises what the
        # forward's FIRST query sees for every query (approximate for multi-token forwards after the
        # prefill; docs/speculative.md).
        self.per_query_views = True

    def _new_sides(self) -> tuple[_Side, _Side]:
        cfg = self.config
        return (_Side("channel", cfg.quantize_key, cfg.k_bits, cfg.block_size, cfg.tiers),
                _Side("token", cfg.quantize_value, cfg.v_bits, cfg.block_size, cfg.tiers))

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_head_dim(self.config, value_states.shape[-1])
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    # ------------------------------------------------------------------ all or nothing
    def checkpoint(self) -> tuple:
        """What :meth:`rollback` needs to put the layer back as it is now (references, no copies)."""
        return (self.seen, self.device, self.dtype, self.is_initialized, dict(self._fast), self._due,
                self.prompt_length, self.k.checkpoint(), self.v.checkpoint())

    def rollback(self, checkpoint: tuple) -> None:
        """Undo every change made since :meth:`checkpoint` (appends, evictions, crops, batch edits)."""
        self.seen, self.device, self.dtype, self.is_initialized, fast, self._due, self.prompt_length, k, v = checkpoint
        self._fast = fast
        self.k.rollback(k)
        self.v.rollback(v)

    @contextlib.contextmanager
    def all_or_nothing(self):
        """Run the body as one change of the layer: if it raises, the layer is put back as it was."""
        checkpoint = self.checkpoint()
        try:
            yield
        except BaseException:
            self.rollback(checkpoint)
            raise

    def activate_past_recording(self) -> None:
        """Defer moving tokens into quantized storage until the next ``crop`` or forward (transformers
        calls this before assisted / prompt-lookup decoding), so that ``crop`` is exact."""
        self.record_past = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[PackedStates, PackedStates]:
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
            return materialize(kv, self.dtype), materialize(vv, self.dtype)

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *, valid: torch.Tensor | None = None
    ) -> tuple[AttentionView, AttentionView]:
        """Store new tokens; return the views attention must use for this forward (pre-move state).

        All or nothing: an error at any step (e.g. a non-finite value refused by the quantizer) leaves
        the layer exactly as it was before the call (stores, windows, sinks, evictions, counters).
        """
        with self.all_or_nothing():
            return self._append(key_states, value_states, valid)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor,
                valid: torch.Tensor | None) -> tuple[AttentionView, AttentionView]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if valid is not None and bool(valid.all()):
            valid = None
        if self._due:
            self._flush_due()  # what the last forward left in the window (past recording, no crop came)
        if self.sliding_window is not None:
            self._evict()  # before building the views: the mask of this forward already excludes them
        n = key_states.shape[-2]
        views = self._append_sides(key_states, value_states, valid, n)
        self.seen += n
        self._due = self.record_past
        return views[0], views[1]

    def _flush_due(self) -> None:
        """Move what the window holds beyond the schedule (deferred by past recording); all or nothing."""
        checkpoints = [(side, side.checkpoint()) for side in (self.k, self.v)]
        try:
            for side in (self.k, self.v):
                if side.quantize and side.window is not None:
                    self._flush(side, side.window, side.window_valid)
        except BaseException:
            for side, cp in checkpoints:
                side.rollback(cp)
            raise
        self._due = False

    def _append_sides(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None,
                      n: int) -> list[AttentionView]:
        views = []
        for side, x in ((self.k, key_states), (self.v, value_states)):
            if not side.quantize:
                side.store.append(FpSegment(x))
                fp = x[:, :, :0]
                # Full-precision storage: attention reads it from the store, nothing pending.
                views.append(AttentionView(side.store, side.store.length, fp, quantized=False, start=side.store.start))
                continue
            pending = x if side.window is None else torch.cat([side.window, x], dim=-2)
            pvalid = self._pending_valid(side, valid, n)
            view = self._view(side, pending)
            if n > 1:  # decode steps (n == 1) never carry a boundary: nothing to compute
                self._set_boundary(view, side, pending, pvalid, n)
            views.append(view)
            if self.record_past:
                # Deferred (see `_flush_due`): the window keeps all pending tokens, exact, until crop.
                side.window = pending if pending is not x else x.clone()
                side.window_valid = None if pvalid is None or bool(pvalid.all()) else pvalid
            else:
                self._flush(side, pending, pvalid)
        return views

    @staticmethod
    def _view(side: _Side, pending: torch.Tensor) -> AttentionView:
        """What attention reads of a quantized side before this forward's moves: the stored history (the sink,
        the store) followed by ``pending`` (the window and the new tokens) at full precision."""
        # Tiers: snapshots of the chain as it is now (this forward's demotions come after the view).
        store = TierChain(tuple(s.frozen() for s in side.chain)) if side.older else side.store
        start = 0 if side.sink is not None else store.start
        return AttentionView(store, side.store.length, pending, quantized=True, sink=side.sink, start=start)

    def _set_boundary(self, view: AttentionView, side: _Side, pending: torch.Tensor, pvalid: torch.Tensor | None,
                      n: int) -> None:
        """Give ``view`` its per-query boundary and the ``left`` copy (see :class:`AttentionView`)."""
        cfg = self.config
        window = pending.shape[-2] - n
        args = (cfg.residual_length, cfg.group_size, side.sink_len, self.sink_tokens)
        # `side.store.length`: tokens that left the window (sink + stored), the held count quantize_after reads
        held = dict(before=side.store.length, quantize_after=cfg.quantize_after)
        exact = prefill_exact_queries(self.seen, n, self.prompt_length)
        bounds = query_boundaries(side.axis, window, n, *args, exact=exact, **held)
        if bounds is None:
            return
        # The last query's exits: its first `take` pending tokens went to the sink (exact), the next
        # `stored` into quantized storage, quantized here exactly as `_flush` will quantize them.
        take, stored = window_exits(side.axis, window + n - 1, *args, **held)
        seg = None
        if stored:
            seg = self._quantize(side, pending[:, :, take : take + stored],
                                 None if pvalid is None else pvalid[:, take : take + stored])
        view.fp_from = tuple(view.split + b for b in bounds)
        if side.older and self._set_tier_variants(view, side, pending, seg, take, window, n, exact):
            return
        parts = [pending[:, :, :take]] if take else []
        if seg is not None:
            parts.append(dequantize_kv(seg, pending.dtype))
        view.left = torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]

    def _set_tier_variants(self, view: AttentionView, side: _Side, pending: torch.Tensor, seg: PackedKV | None,
                           take: int, window: int, n: int, exact: int) -> bool:
        """A tiered side's per-query region (``AttentionView.variants``): each query reads every stored token
        at the tier one-token decoding would give it at that query's step (:func:`query_tier_ranges`),
        including tokens the forward's earlier steps demote and tokens leaving the window that are demoted
        within the same forward. ``seg``: the tokens leaving the window by the last query's step (after
        ``take`` sink tokens), quantized at the first tier's widths. Positions below are relative to ``split``.
        False (nothing set) when no query reads a stored token differently from the view's base: only sink
        tokens left the window, which ``left`` says.
        """
        cfg = self.config
        stored, keeps = view.split - side.sink_len, tuple(reversed(side.keeps))  # keeps: newest tier first
        ranges = query_tier_ranges(side.axis, window, n, cfg.residual_length, cfg.group_size, side.sink_len,
                                   self.sink_tokens, stored, keeps, exact=exact, before=side.store.length,
                                   quantize_after=cfg.quantize_after)
        pre = tier_ranges(side.axis, stored, keeps, cfg.group_size)  # the tiers before the forward
        stores = list(reversed(side.chain))  # newest tier first, as before this forward
        bits = [side.bits] + [side.older_bits[len(side.older) - j] for j in range(1, len(stores))]
        # Per query and tier: the tokens that query reads at that tier but the view's base does not.
        moved = [[(max(lo, pre[j][1]), hi) for j, (lo, hi) in enumerate(r)] for r in ranges]
        spans = [(a, b) for r in moved for a, b in r if a < b]
        if not spans:
            return False
        first, end = min(0, *(a for a, _ in spans)), max(b for _, b in spans)  # from `split` on at least: readers
        # walk the store up to the region, the region, then `fp` after it
        L = end - first
        choice = torch.zeros(n, L, dtype=torch.uint8, device=pending.device)
        for i, r in enumerate(moved):
            for j, (a, b) in enumerate(r):
                if a < b:
                    choice[i, a - first : b - first] = j + 1
        dtype = pending.dtype

        def tier_codes(j: int, a: int, b: int) -> torch.Tensor:
            """Tokens [a, b) (relative) at tier j, dequantized: stored codes or `seg`, demoted tier by tier."""
            parts = []
            for s, (lo, hi) in enumerate(pre[:j + 1]):  # stored before the forward, at a newer tier s <= j
                lo, hi = max(a, lo), min(b, hi, 0)
                if lo < hi:
                    parts.append((s, _store_range(stores[s], view.split + lo, view.split + hi)))
            if b > max(a, 0):
                lo = max(a, 0)
                parts.append((0, _token_slice(seg, lo - take, b - take)))
            out = []
            for s, p in parts:
                for t in range(s + 1, j + 1):
                    p = demote_kv(p, bits[t])
                out.append(dequantize_kv(p, dtype))
            return torch.cat(out, dim=-2) if len(out) > 1 else out[0]

        base = []
        if first < 0:  # stored tokens the forward demotes, at their tier before it
            base = [tier_codes(j, max(first, lo), hi) for j, (lo, hi) in enumerate(pre) if max(first, lo) < min(hi, 0)]
            base.reverse()  # oldest tier first: token order
        base.append(pending[:, :, max(first, 0):end])
        versions = [torch.cat(base, dim=-2) if len(base) > 1 else base[0]]
        for j in range(len(stores)):
            x = torch.zeros_like(versions[0])
            tj = [(a, b) for r in moved for a, b in [r[j]] if a < b]
            if tj:
                a, b = min(a for a, _ in tj), max(b for _, b in tj)
                x[:, :, a - first : b - first] = tier_codes(j, a, b)
            versions.append(x)
        view.variant_from = view.split + first
        view.variants = tuple(versions)
        view.choice = choice
        return True

    def _pending_valid(self, side: _Side, valid: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if valid is None and side.window_valid is None:
            return None
        b = valid.shape[0] if valid is not None else side.window_valid.shape[0]
        dev = valid.device if valid is not None else side.window_valid.device
        old = side.window_valid
        if old is None:
            old = torch.ones(b, side.window_len, dtype=torch.bool, device=dev)
        new = valid if valid is not None else torch.ones(b, n, dtype=torch.bool, device=dev)
        return torch.cat([old, new.to(torch.bool)], dim=-1)

    def _exits(self, side: _Side, pending: int) -> tuple[int, int]:
        """``(to_sink, to_store)`` of a flush of ``pending`` tokens (the window and the new ones) from ``side``."""
        cfg = self.config
        # `side.store.length` tokens already left the window (sink + stored): the held count quantize_after reads
        return window_exits(side.axis, pending, cfg.residual_length, cfg.group_size, side.sink_len, self.sink_tokens,
                            side.store.length, cfg.quantize_after)

    def _flush(self, side: _Side, pending: torch.Tensor, pvalid: torch.Tensor | None) -> None:
        """Move what is due from ``pending`` (old window + new tokens) into quantized storage."""
        total = pending.shape[-2]
        s, move = self._exits(side, total)
        if s:
            # The first tokens to leave the window become sink tokens (kept exact, no statistics).
            part = pending[:, :, :s].clone()
            side.sink = part if side.sink is None else torch.cat([side.sink, part], dim=-2)
            for store in side.chain:  # nothing is stored before the sink is full
                store.start = store.length = side.sink_len
            pending = pending[:, :, s:]
            pvalid = None if pvalid is None else pvalid[:, s:]
            total -= s
        if move:
            self._store_moved(side, pending[:, :, :move], None if pvalid is None else pvalid[:, :move])
        # The window keeps exact copies of what it was given (clone: do not pin `pending`).
        side.window = pending[:, :, move:].clone() if move < total else None
        side.window_valid = None
        if pvalid is not None and side.window is not None and not bool(pvalid[:, move:].all()):
            side.window_valid = pvalid[:, move:].clone()

    def _store_moved(self, side: _Side, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Quantize ``x [B, H, m, D]``, the next tokens leaving the window (``valid [B, m]``: their padding
        marks), into the side's storage: the newest position tier, or the store (values of a decode step
        in one compiled pass where it applies)."""
        cfg = self.config
        if side.older:
            self._store_valid(side, valid, x.shape[-2])
            self._push(side, len(side.older), self._quantize(side, x, valid))
        elif side.axis == "token" and side.store.template is not None and self._fast_tokens(side, x.dtype):
            # One compiled pass, written straight into the block storage (decode: one token per step).
            def write(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
                quantize_tokens_into(x[:, :, lo:hi], side.bits, cfg.group_size, views["packed"], views["scale"],
                                     views["offset"], clip=cfg.clips(side.axis))

            side.store.append_in_place(x.shape[-2], write)
        else:
            self._store_valid(side, valid, x.shape[-2])
            side.store.append(self._quantize(side, x, valid))

    @staticmethod
    def _store_valid(side: _Side, pvalid: torch.Tensor | None, move: int) -> None:
        """Record the padding marks of keys about to be stored (see ``_Side.stored_valid``)."""
        if side.axis == "channel" and pvalid is not None and not bool(pvalid[:, :move].all()):
            first = side.store.length  # absolute position of the first key stored now
            old = side.stored_valid if side.stored_valid is not None else pvalid[:, :0]
            gap = torch.ones(pvalid.shape[0], first - old.shape[1], dtype=torch.bool, device=pvalid.device)
            side.stored_valid = torch.cat([old, gap, pvalid[:, :move]], dim=-1)

    def _push(self, side: _Side, i: int, seg: PackedKV) -> None:
        """Append ``seg`` (the next tokens in age order) to tier store ``side.chain[i]``, first demoting
        into tier ``i - 1`` what ages out of tier ``i`` (:func:`~kivi.cache.schedule.flush_count` with the
        tier's token count: the window's own rule). Tokens of ``seg`` that would age out at once go
        straight on, demoted, and never occupy tier ``i``."""
        store = side.chain[i]
        if i > 0:
            held = store.length - store.start
            due = flush_count(side.axis, held + seg.num_tokens, side.keeps[i - 1], self.config.group_size)
            from_store = min(due, held)
            from_seg = due - from_store
            to_bits = side.older_bits[i - 1]
            if from_store:
                self._push(side, i - 1, demote_kv(store.read(store.start + from_store), to_bits))
                store.evict(store.start + from_store)
            if from_seg:
                self._push(side, i - 1, demote_kv(_token_slice(seg, 0, from_seg), to_bits))
                store.skip(from_seg)
            seg = _token_slice(seg, from_seg, seg.num_tokens)
        if seg.num_tokens:
            store.append(seg)

    def _quantize(self, side: _Side, x: torch.Tensor, valid: torch.Tensor | None) -> PackedKV:
        """``x [B, H, T, D]`` (tokens leaving the window, T a multiple of G for keys) quantized as stored."""
        cfg = self.config
        return quantize_kv(
            x,
            side.axis,
            side.bits,
            cfg.group_size,
            symmetric=cfg.symmetric,
            residual_bits=cfg.residual_bits,
            valid=None if valid is None or side.axis == "token" else valid,
            param_dtype=self._param_dtype(x.dtype),
            check_finite=cfg.check_finite,
            clip=cfg.clips(side.axis),
        )

    def _fast_tokens(self, side: _Side, dtype: torch.dtype) -> bool:
        """Whether values leave the window through :func:`kivi.quant.fused_cpu.quantize_tokens_into`.

        It reproduces :func:`quantize_kv` bit for bit where it applies (CPU, float32, asymmetric, no
        compensation, finiteness checked, numba installed); everything else takes the torch path.
        """
        fast = self._fast.get(dtype)  # decided once per dtype (the config and device do not change)
        if fast is None:
            cfg = self.config
            fast = self._fast[dtype] = self.device.type == "cpu" and token_quantizer_supported(
                dtype, side.bits, symmetric=cfg.symmetric, residual_bits=cfg.residual_bits,
                param_dtype=self._param_dtype(dtype), check_finite=cfg.check_finite,
            )
        return fast

    def _param_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.config.scale_dtype == "auto" else _SCALE_DTYPES[self.config.scale_dtype]

    def _cut(self) -> int:
        """Tokens before this position are out of reach of every future query of a sliding layer.

        Depends only on (seen, W, R, G, block_size), so every sliding layer reports the same offset.
        """
        if self.sliding_window is None:
            return 0
        cfg = self.config
        return sliding_cut(self.seen, self.sliding_window, cfg.residual_length, cfg.group_size, cfg.block_size)

    def _evict(self) -> None:
        cut = self._cut()
        if cut > self.k.store.start:
            self.k.store.evict(cut)
            self.v.store.evict(cut)

    @property
    def kv_offset(self) -> int:
        """First absolute token position attention sees (0 unless sliding-window eviction happened)."""
        if self.sliding_window is None:
            return 0
        return max(self.k.store.start, self._cut())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self.kv_offset
        return self.seen - kv_offset + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self.seen = 0
        self.k, self.v = self._new_sides()
        self._due = False
        self.is_initialized = False

    def offload(self):  # pragma: no cover - not supported
        raise NotImplementedError("KiviCache does not support offloading; it is already compressed")

    def prefetch(self):  # pragma: no cover - not supported
        raise NotImplementedError("KiviCache does not support offloading; it is already compressed")

    # ------------------------------------------------------------------ batch / beam operations
    def _map(self, fn) -> None:
        with self.all_or_nothing():
            self.k.map_tensors(fn)
            self.v.map_tensors(fn)

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
        if tokens_to_remove == 0:
            if self._due:
                self._flush_due()
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
            for side in (self.k, self.v):
                self._crop_side(side, new_seen)
            self.seen = new_seen
            if self._due:
                self._flush_due()

    def _crop_side(self, side: _Side, new_seen: int) -> None:
        store = side.store
        if new_seen < side.sink_len or (side.sink_len and new_seen == side.sink_len):
            # Back into (or to the end of) the sink: everything after it goes.
            side.sink = side.sink[:, :, :new_seen].clone() if new_seen else None
            side.store = BlockStore(self.config.block_size)
            side.older = [BlockStore(self.config.block_size) for _ in side.older]
            for s in side.chain:
                s.start = s.length = side.sink_len
            side.window = side.window_valid = side.stored_valid = None
            return
        if new_seen >= store.length:  # only the window shrinks
            keep = new_seen - store.length
            if side.window is not None:
                side.window = side.window[:, :, :keep].clone() if keep else None
                if side.window_valid is not None:
                    side.window_valid = side.window_valid[:, :keep].clone() if keep else None
            return
        if side.older and new_seen < store.start:
            raise ValueError(f"cannot crop to {new_seen} tokens: tokens before {store.start} were demoted to a narrower "
                             f"position tier (tiers={list(self.config.tiers)}), which cannot restore their wider "
                             f"codes; crop at most {self.seen - store.start} tokens")
        side.window = side.window_valid = None
        if not side.quantize or side.axis == "token":
            store.truncate(new_seen)
            return
        G = self.config.group_size
        g0 = key_group_start(new_seen, side.sink_len, G)  # key groups start after the sink
        tail = None
        if g0 < new_seen:
            seg = store.read(min(store.length, g0 + self.config.group_size))
            tail = dequantize_kv(_token_slice(seg, seg.num_tokens - self.config.group_size, seg.num_tokens), self.dtype)
            tail = tail[:, :, : new_seen - g0].clone()
        store.truncate(g0)
        side.window = tail
        if side.stored_valid is not None:  # the survivors keep their padding marks
            marks = side.stored_valid[:, g0:new_seen]
            if tail is not None and not bool(marks.all()):
                side.window_valid = torch.cat(
                    [marks, marks.new_ones(marks.shape[0], new_seen - g0 - marks.shape[1])], dim=-1)
            if g0 < side.stored_valid.shape[1]:
                side.stored_valid = side.stored_valid[:, :g0].clone()

    # ------------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held, by kind: codes, scales/zero-points, compensation, windows, unquantized storage."""
        out = {"codes": 0, "scales_zero_points": 0, "compensation": 0, "fp_window": 0, "fp_sink": 0,
               "fp_unquantized": 0, "padding_masks": 0}
        for side in (self.k, self.v):
            for store in side.chain:
                for name, nb in store.nbytes_by_field().items():
                    key = {"packed": "codes", "scale": "scales_zero_points", "offset": "scales_zero_points",
                           "comp": "compensation", "data": "fp_unquantized"}[name]
                    out[key] += nb
            if side.window is not None:
                out["fp_window"] += side.window.numel() * side.window.element_size()
            if side.sink is not None:
                out["fp_sink"] += side.sink.numel() * side.sink.element_size()
            for mask in (side.window_valid, side.stored_valid):
                if mask is not None:
                    out["padding_masks"] += mask.numel()
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.memory_breakdown().values())


def _store_range(store: BlockStore, a: int, b: int) -> PackedKV:
    """Tokens ``[a, b)`` of a store as one segment (key bounds on group boundaries)."""
    parts = [_token_slice(seg, max(a, t0) - t0, min(b, t0 + seg.num_tokens) - t0)
             for t0, seg in store.iter_blocks(b) if t0 + seg.num_tokens > a]
    if len(parts) == 1:
        return parts[0]
    return parts[0].with_tensors(**{k: torch.cat([p.tensors()[k] for p in parts], dim=2) for k in parts[0].tensors()})


def _token_slice(seg: PackedKV, a: int, b: int) -> PackedKV:
    """Tokens ``[a, b)`` of a segment (views; key bounds on group boundaries)."""
    if a == 0 and b == seg.num_tokens:
        return seg
    return seg.with_tensors(**{k: v[:, :, a // token_divisor(seg.axis, seg.group_size, k):
                                      b // token_divisor(seg.axis, seg.group_size, k)]
                               for k, v in seg.tensors().items()})
