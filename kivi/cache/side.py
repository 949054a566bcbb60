"""`SideState`: the keys or the values of one layer (or of one head group of a layer).

State (``seen`` tokens so far, the layer's count):

* ``store`` — a :class:`~kivi.cache.store.Storage` of quantized tokens ``[store.start, store.length)``
  (a :class:`~kivi.cache.store.BlockStore`, or a :class:`~kivi.cache.tiers.TieredStore` with position
  tiers; full-precision tokens when the side is not quantized);
* ``window`` — the full-precision tokens ``[store.length, seen)``, bit-exact copies of the inputs, and
  ``window_valid``, their padding marks;
* ``sink`` — with ``sink_tokens = S > 0``: the first ``S`` tokens ``[0, S)`` in full precision, kept
  forever and left out of every quantization statistic; the store then starts at ``S``;
* ``stored_valid`` — the padding marks of stored keys (see below).

What leaves the window, and when, is :mod:`kivi.cache.schedule`'s rule (:meth:`exits`); this class
moves the tensors. A forward's step over a side is :func:`kivi.cache.step.append_side`: build the
views (:meth:`view`), then :meth:`flush` what is due and :meth:`set_window` to what stays.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import KiviConfig
from ..quant.kv import PackedKV, dequantize_kv, quantize_side
from ..quant.numba_quant import quantize_tokens_into, token_quantizer_supported
from ..quant.side_format import KEY_AXIS, VALUE_AXIS, SideFormat
from .boundary import SideCounts, TierLayout, set_boundary
from .schedule import key_group_start, window_exits
from .store import FpSegment
from .tiers import TieredStore, new_storage
from .view import AttentionView

_TENSORS = ("window", "window_valid", "sink", "stored_valid")


class SideState:
    """Storage of keys (``axis="channel"``) or values (``axis="token"``) of one layer or head group."""

    def __init__(self, fmt: SideFormat, config: KiviConfig, sink_tokens: int):
        self.format = fmt  # what tokens leaving the window are quantized to
        self.axis = fmt.axis  # "channel" for keys, "token" for values
        self.config = config
        self.quantize = config.quantize_key if fmt.axis == KEY_AXIS else config.quantize_value
        self.bits = fmt.bits
        self.sink_tokens = sink_tokens
        self.store = new_storage(config.block_size, fmt.axis, config.tiers, config.group_size)
        self.window: torch.Tensor | None = None  # [B, H, W, D]
        self.window_valid: torch.Tensor | None = None  # [B, W] bool, None = all valid
        # [B, P] bool: which stored keys [0, P) were real tokens, kept up to the last padded one only
        # (None: no padding stored); a crop into a key group puts its survivors back in the window
        # with their padding marks, so padding stays out of the group's statistics when re-stored.
        self.stored_valid: torch.Tensor | None = None
        self.sink: torch.Tensor | None = None  # [B, H, S, D], tokens [0, S)
        self._fast: dict[torch.dtype, bool] = {}  # values quantized by the numba pass, per input dtype

    @property
    def window_len(self) -> int:
        return 0 if self.window is None else self.window.shape[-2]

    @property
    def sink_len(self) -> int:
        return 0 if self.sink is None else self.sink.shape[-2]

    @property
    def chain(self) -> list:
        """Every block store of the side, oldest tier first (just ``[store]`` without tiers)."""
        return list(self.store.tier_stores())

    # ------------------------------------------------------------------ the schedule
    def counts(self) -> SideCounts:
        cfg = self.config
        # `store.length` tokens already left the window (sink + stored): the held count quantize_after reads
        return SideCounts(self.axis, cfg.residual_length, cfg.group_size, self.sink_len, self.sink_tokens,
                          self.store.length, cfg.quantize_after)

    def exits(self, pending: int) -> tuple[int, int]:
        """``(to_sink, to_store)`` of a flush of ``pending`` tokens (the window and the new ones)."""
        cfg = self.config
        return window_exits(self.axis, pending, cfg.residual_length, cfg.group_size, self.sink_len, self.sink_tokens,
                            self.store.length, cfg.quantize_after)

    def pending_valid(self, valid: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """``[B, W + n]`` padding marks of the window followed by ``n`` new tokens (``None``: all real)."""
        if valid is None and self.window_valid is None:
            return None
        ref = valid if valid is not None else self.window_valid
        old = self.window_valid
        if old is None:
            old = torch.ones(ref.shape[0], self.window_len, dtype=torch.bool, device=ref.device)
        new = valid if valid is not None else torch.ones(ref.shape[0], n, dtype=torch.bool, device=ref.device)
        return torch.cat([old, new.to(torch.bool)], dim=-1)

    # ------------------------------------------------------------------ a forward
    def append_unquantized(self, x: torch.Tensor) -> AttentionView:
        """Full-precision storage: attention reads it from the store, nothing pending."""
        self.store.append(FpSegment(x))
        return AttentionView(self.store, self.store.length, x[:, :, :0], quantized=False, start=self.store.start)

    def view(self, pending: torch.Tensor, n: int, pvalid: torch.Tensor | None, exact: int) -> AttentionView:
        """What attention reads before this forward's moves: the stored history (the sink, the store)
        followed by ``pending`` (the window and ``n`` new tokens) at full precision, with the per-query
        boundary of a forward of ``n > 1`` tokens (:func:`kivi.cache.boundary.set_boundary`)."""
        store = self.store.snapshot()
        start = 0 if self.sink is not None else store.start
        view = AttentionView(store, self.store.length, pending, quantized=True, sink=self.sink, start=start)
        if n > 1:  # decode steps (n == 1) never carry a boundary: nothing to compute
            def quantize(lo: int, hi: int) -> PackedKV:
                return self.quantize_tokens(pending[:, :, lo:hi], None if pvalid is None else pvalid[:, lo:hi])

            set_boundary(view, self.counts(), pending, n, exact, quantize, self._tier_layout())
        return view

    def _tier_layout(self) -> TierLayout | None:
        if not isinstance(self.store, TieredStore):
            return None
        return TierLayout(tuple(reversed(self.store.keeps)), (self.bits, *reversed(self.store.bits)))

    def flush(self, pending: torch.Tensor, pvalid: torch.Tensor | None, take: int, move: int) -> None:
        """Move the first ``take`` pending tokens into the sink and the next ``move`` into storage
        (``(take, move)``: :meth:`exits`); the window is set apart (:meth:`set_window`)."""
        if take:
            # The first tokens to leave the window become sink tokens (kept exact, no statistics).
            part = pending[:, :, :take].clone()
            self.sink = part if self.sink is None else torch.cat([self.sink, part], dim=-2)
            self.store.restart(self.sink_len)  # nothing is stored before the sink is full
        if move:
            self._store_moved(pending[:, :, take:take + move], None if pvalid is None else pvalid[:, take:take + move])

    def set_window(self, window: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        self.window, self.window_valid = window, valid

    def _store_moved(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Quantize ``x [B, H, m, D]``, the next tokens leaving the window (``valid [B, m]``: their padding
        marks), into storage (values of a decode step in one compiled pass where it applies)."""
        fmt = self.format
        if (self.axis == VALUE_AXIS and self.store.writes_in_place and self.store.template is not None
                and self._fast_tokens(x)):
            # One compiled pass, written straight into the block storage (decode: one token per step).
            def write(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
                quantize_tokens_into(x[:, :, lo:hi], fmt, views["packed"], views["scale"], views["offset"])

            self.store.append_in_place(x.shape[-2], write)
            return
        self._store_valid(valid, x.shape[-2])
        self.store.append(self.quantize_tokens(x, valid))

    def _store_valid(self, pvalid: torch.Tensor | None, move: int) -> None:
        """Record the padding marks of keys about to be stored (see ``stored_valid``)."""
        if self.axis == KEY_AXIS and pvalid is not None and not bool(pvalid[:, :move].all()):
            first = self.store.length  # absolute position of the first key stored now
            old = self.stored_valid if self.stored_valid is not None else pvalid[:, :0]
            gap = torch.ones(pvalid.shape[0], first - old.shape[1], dtype=torch.bool, device=pvalid.device)
            self.stored_valid = torch.cat([old, gap, pvalid[:, :move]], dim=-1)

    def quantize_tokens(self, x: torch.Tensor, valid: torch.Tensor | None) -> PackedKV:
        """``x [B, H, T, D]`` (tokens leaving the window, T a multiple of G for keys) quantized as stored."""
        return quantize_side(x, self.format, valid=None if valid is None or self.axis == VALUE_AXIS else valid)

    def _fast_tokens(self, x: torch.Tensor) -> bool:
        """Whether values leave the window through :func:`kivi.quant.numba_quant.quantize_tokens_into`.

        It reproduces :func:`quantize_kv` bit for bit where it applies (CPU, float32, asymmetric, no
        compensation, finiteness checked, numba installed); everything else takes the torch path.
        """
        fast = self._fast.get(x.dtype)  # decided once per dtype (the format and device do not change)
        if fast is None:
            fast = self._fast[x.dtype] = x.device.type == "cpu" and token_quantizer_supported(self.format, x.dtype)
        return fast

    # ------------------------------------------------------------------ crop
    def crop(self, new_seen: int, dtype: torch.dtype) -> None:
        """Keep the tokens ``[0, new_seen)``. Window tokens come back bit-exact; a crop into a stored key
        group puts the group's survivors back in the window, dequantized, with their padding marks."""
        store = self.store
        if new_seen < self.sink_len or (self.sink_len and new_seen == self.sink_len):
            # Back into (or to the end of) the sink: everything after it goes.
            self.sink = self.sink[:, :, :new_seen].clone() if new_seen else None
            store.restart(self.sink_len)
            self.window = self.window_valid = self.stored_valid = None
            return
        if new_seen >= store.length:  # only the window shrinks
            keep = new_seen - store.length
            if self.window is not None:
                self.window = self.window[:, :, :keep].clone() if keep else None
                if self.window_valid is not None:
                    self.window_valid = self.window_valid[:, :keep].clone() if keep else None
            return
        store.check_truncate(new_seen)
        if not self.quantize or self.axis == VALUE_AXIS:
            store.truncate(new_seen)
            self.window = self.window_valid = None
            return
        G = self.config.group_size
        g0 = key_group_start(new_seen, self.sink_len, G)  # key groups start after the sink
        tail = None
        if g0 < new_seen:
            tail = dequantize_kv(store.read_range(g0, g0 + G), dtype)[:, :, : new_seen - g0].clone()
        store.truncate(g0)
        self.window, self.window_valid = tail, None
        if self.stored_valid is not None:  # the survivors keep their padding marks
            marks = self.stored_valid[:, g0:new_seen]
            if tail is not None and not bool(marks.all()):
                self.window_valid = torch.cat(
                    [marks, marks.new_ones(marks.shape[0], new_seen - g0 - marks.shape[1])], dim=-1)
            if g0 < self.stored_valid.shape[1]:
                self.stored_valid = self.stored_valid[:, :g0].clone()

    # ------------------------------------------------------------------ all or nothing, batch edits
    def checkpoint(self) -> tuple:
        """The side's state (tensors are replaced, never written in place, so references suffice)."""
        return (self.store.checkpoint(), self.window, self.window_valid, self.sink, self.stored_valid, dict(self._fast))

    def rollback(self, checkpoint: tuple) -> None:
        store, self.window, self.window_valid, self.sink, self.stored_valid, fast = checkpoint
        self.store.rollback(store)
        self._fast = fast

    def map_tensors(self, fn) -> None:
        self.store.map_tensors(fn)
        for name in _TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    # ------------------------------------------------------------------ saving, accounting
    def state_dict(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in _TENSORS}, "store": self.store.state_dict()}

    def load_state_dict(self, state: dict[str, Any], device: str | torch.device = "cpu") -> None:
        for name in _TENSORS:
            t = state.get(name)
            if t is not None and not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a tensor or none, got {type(t).__name__}")
            setattr(self, name, None if t is None else t.to(device))
        self.store.load_state_dict(state["store"], device)

    def memory_breakdown(self, out: dict[str, int]) -> None:
        """Add the side's bytes, by kind, to ``out``."""
        for name, nb in self.store.nbytes_by_field().items():
            key = {"packed": "codes", "scale": "scales_zero_points", "offset": "scales_zero_points",
                   "comp": "compensation", "data": "fp_unquantized"}[name]
            out[key] += nb
        if self.window is not None:
            out["fp_window"] += self.window.numel() * self.window.element_size()
        if self.sink is not None:
            out["fp_sink"] += self.sink.numel() * self.sink.element_size()
        for mask in (self.window_valid, self.stored_valid):
            if mask is not None:
                out["padding_masks"] += mask.numel()


__all__ = ["SideState"]
