"""What a saved prefix file must hold, derived from the configuration before anything is read or allocated.

A prefix file (:mod:`kivi.cache.persist`) holds each layer's
:meth:`~kivi.cache.layer.KiviLayer.state_dict`: per head group (``parts``) and side (``k`` / ``v``) the
full-precision ``window`` / ``window_valid`` / ``sink`` / ``stored_valid`` and the ``store`` (a block
store, or with position tiers ``{"tiers": [...]}``, one block store per quantized tier, oldest first).
The loader trusts none of the sizes the file states. :func:`plan_cache` builds each layer empty from the
configuration (:func:`~kivi.cache.heads.build_layer`: plain, sliding, tiered, head-split), so the head
groups, their widths, the tiers and their widths come from the config; the file's token counts are
checked against each other and against the cache's schedule (:mod:`kivi.cache.schedule`: sink, window,
tier counts, sliding cut, block capacities); every tensor's name, dtype and shape is then derived from
those (:func:`expected_tensors`; the stored formats come from quantizing zeros with the side's own rule,
:meth:`~kivi.cache.side.SideState.quantize_tokens`, and demoting them, :func:`~kivi.quant.demote.demote_kv`).
:func:`state_dict` assembles, from the checked plan and the tensors read, the state the layer loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import KiviConfig
from ..quant.demote import demote_kv
from ..quant.kv import token_divisor
from ..quant.side_format import KEY_AXIS
from .heads import build_layer
from .layer import KiviLayer
from .persist_checks import (
    Described,
    PrefixFileError,
    TensorSpec,
    _Reader,
    _show,
    cache_dims,
    fail,
    layer_dtype,
)
from .schedule import saved_capacity, side_tokens, sliding_cut, tier_tokens
from .store import FpSegment, segment_meta
from .tiers import TieredStore

_FIELDS = ("window", "window_valid", "sink", "stored_valid")


@dataclass(frozen=True)
class StorePlan:
    """One block store (a side's, or one tier's) as the file's counts say, checked."""

    name: str  # tensor name prefix: ``layer{i}.parts.{p}.{k|v}.store`` (``.tiers.{t}`` for a tier)
    block_size: int
    length: int
    start: int
    starts: tuple[int, ...]
    caps: tuple[int, ...]
    present: tuple[bool, ...]
    template: Any  # zero-token segment [B, H_group, 0, ...] (PackedKV / FpSegment), None before any block

    def rows(self, j: int, field: str) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of block ``j``'s ``field`` that the file holds (BlockStore.saved_rows)."""
        d = token_divisor(self.template.axis, self.template.group_size, field)
        b0 = self.starts[j]
        return (max(self.start, b0) - b0) // d, max(0, min(self.caps[j], self.length - b0)) // d


@dataclass(frozen=True)
class SidePlan:
    name: str
    window: int  # tokens in the full-precision window
    sink: int
    window_valid: bool
    stored_valid: int | None  # columns of the stored keys' padding mask (None: no mask)
    stores: tuple[StorePlan, ...]  # one, or one per tier (oldest first)
    tiered: bool


@dataclass
class LayerPlan:
    layer: KiviLayer  # built empty with the layer's config and sliding window
    state: dict[str, Any]  # seen, initialized, sliding_window, due, dtype
    dtype: torch.dtype | None
    sides: list[dict[str, SidePlan]]  # per head group: "k", "v"
    heads: list[int]  # kv heads per head group


def plan_cache(path: Path, meta: dict[str, Any], table: dict[str, TensorSpec], config: KiviConfig,
               known: dict[str, int | None]) -> tuple[list[LayerPlan], dict[str, TensorSpec], int, dict]:
    """``(layers, expected tensors, tail bytes, dims)``: the file's structure checked against ``config`` and
    the schedule, every tensor it must hold derived from that (never from the file's table), and the bytes the
    built cache allocates beyond them. Raises :class:`PrefixFileError` on the first mismatch."""
    r = _Reader(path)
    cache = r.get(meta, "cache", "", "dict")
    seq = r.get(cache, "seq_length", "cache", "int")
    layers_meta = r.get(cache, "layers", "cache", "list")
    dims = cache_dims(table, _config_heads(config, known), cache)
    expected: dict[str, TensorSpec] = {}
    if r.get(cache, "input_ids", "cache", "bool"):
        expected["input_ids"] = TensorSpec(torch.int64, (dims["batch"], seq))
    plans, tails = [], 0
    for i, lm in enumerate(layers_meta):
        where = f"cache.layers[{i}]"
        if not isinstance(lm, dict):
            raise PrefixFileError(f"{path}: metadata field {where}: found {type(lm).__name__}, expected a JSON object")
        seen = r.get(lm, "seen", where, "int")
        if seen != seq:
            raise PrefixFileError(f"{path}: {where}.seen: found {seen}, expected {seq} (cache.seq_length)")
        sliding = r.get(lm, "sliding_window", where, "int?")
        initialized, due = r.get(lm, "initialized", where, "bool"), r.get(lm, "due", where, "bool")
        saved_dtype = r.get(lm, "dtype", where, "str?")
        if not initialized and (saved_dtype is not None or seen):
            raise PrefixFileError(f"{path}: {where}: an uninitialized layer with dtype {saved_dtype} and {seen} tokens")
        dtype = None if not initialized else layer_dtype(path, saved_dtype, f"{where}.dtype")
        try:
            layer = build_layer(config, i, sliding)
        except ValueError as e:
            raise PrefixFileError(f"{path}: {where}: {str(e).splitlines()[0]}") from None
        parts = r.get(lm, "parts", where, "list")
        if len(parts) != len(layer.parts):
            raise fail(path, f"{where}.parts", Described(f"{len(parts)} head groups"),
                       f"{len(layer.parts)} (the configuration's head groups of layer {i})")
        heads = [_part_heads(path, p.heads, dims, where) for p in layer.parts]
        state = {"seen": seen, "initialized": initialized, "sliding_window": sliding, "due": due,
                 "dtype": saved_dtype}
        sides = []
        for g, (part, pm) in enumerate(zip(layer.parts, parts)):
            group = {}
            for label in ("k", "v"):
                name = f"layer{i}.parts.{g}.{label}"
                sm = r.get(pm, label, f"{where}.parts[{g}]", "dict")
                side = getattr(part, label)
                group[label] = plan = plan_side(path, r, sm, layer, side, seen, due, dtype, dims, heads[g], table,
                                                name)
                expected.update(expected_tensors(plan, dtype, dims, heads[g]))
                tails += tail_bytes(plan)
            sides.append(group)
        plans.append(LayerPlan(layer, state, dtype, sides, heads))
    return plans, expected, tails, dims


def _config_heads(config: KiviConfig, known: dict[str, int | None]) -> dict[str, int | None]:
    """The model's kv heads: the caller's, else what per-head widths state (one width per kv head)."""
    if known.get("heads") is None:
        widths = [v.get("k_bits") for v in (config.head_bits or {}).values() if isinstance(v, dict)]
        if widths and isinstance(widths[0], (list, tuple)):
            return {**known, "heads": len(widths[0])}
    return known


def _part_heads(path: Path, heads: slice | None, dims: dict[str, int | None], where: str) -> int | None:
    if heads is None:
        return dims.get("heads")
    if dims.get("heads") is not None and heads.stop > dims["heads"]:
        raise fail(path, f"{where}: head widths", Described(f"{heads.stop} kv heads"), f"{dims['heads']} (the model's)")
    return heads.stop - heads.start


def _tensor_ref(path: Path, sm: dict[str, Any], field: str, name: str, where: str) -> bool:
    """Whether the side saved ``field``: its value must be null or ``{"tensor": <the name it must have>}``."""
    if field not in sm:
        raise PrefixFileError(f"{path}: metadata field {where}.{field} is missing")
    value = sm[field]
    if value is None:
        return False
    if value != {"tensor": name}:
        raise fail(path, f"{where}.{field}", value, f"null or {{'tensor': {name!r}}}")
    return True


def plan_side(path: Path, r: _Reader, sm: dict[str, Any], layer: Any, side: Any, seen: int, due: bool,
              dtype: torch.dtype | None, dims: dict[str, int | None], heads: int | None,
              table: dict[str, TensorSpec], name: str) -> SidePlan:
    """Check one side's metadata against the configuration and the schedule; what the loader builds."""
    cfg = side.config
    flags = {f: _tensor_ref(path, sm, f, f"{name}.{f}", name) for f in _FIELDS}
    tiered = isinstance(side.store, TieredStore)
    st = r.get(sm, "store", name, "dict")
    if tiered:
        tiers = r.get(st, "tiers", f"{name}.store", "list")
        if len(tiers) != len(side.store.stores):
            raise fail(path, f"{name}.store.tiers", Described(f"{len(tiers)} tier stores"),
                       f"{len(side.store.stores)} (the configuration's quantized tiers)")
        metas = [(t, f"{name}.store.tiers.{j}") for j, t in enumerate(tiers)]
    else:
        metas = [(st, f"{name}.store")]
    newest, nw = metas[-1]
    length = r.get(newest, "length", nw, "int")
    if length > seen:
        raise fail(path, f"{nw}.length", length, f"at most the {seen} tokens the layer has seen")
    sink_cap = side.sink_tokens if side.quantize else 0
    sink = min(sink_cap, length) if sink_cap else 0
    if flags["sink"] != (sink > 0):
        raise fail(path, f"{name}.sink", flags["sink"], f"{sink > 0} (store length {length}, sink_tokens {sink_cap})")
    origin = sink
    window = seen - length if side.quantize else 0
    if not side.quantize and length != seen:
        raise fail(path, f"{nw}.length", length, f"{seen}: an unquantized side stores every token")
    if flags["window"] != (window > 0):
        raise fail(path, f"{name}.window", flags["window"], f"{window > 0} ({window} tokens after the store)")
    if side.quantize and not due and window:
        most = side_tokens(side.axis, seen, cfg.residual_length, cfg.group_size, sink_cap, True, cfg.quantize_after)[2]
        if window > most:
            raise fail(path, f"{nw}.length", length, f"at least {seen - most} (the window holds at most {most} of "
                                                      f"{seen} tokens)")
    divisor = token_divisor(side.axis, cfg.group_size, "scale") if side.quantize else 1
    if (length - origin) % divisor:
        raise fail(path, f"{nw}.length", length, f"{origin} + a multiple of group_size {divisor} (keys are stored "
                                                  "in whole groups)")
    if flags["window_valid"] and not window:
        raise fail(path, f"{name}.window_valid", True, "null (no window)")
    stored_valid = None
    if flags["stored_valid"]:
        spec = table.get(f"{name}.stored_valid")
        cols = spec.shape[-1] if spec is not None and spec.shape else None
        if side.axis != KEY_AXIS or not side.quantize or cols is None or not 1 <= cols <= length:
            raise fail(path, f"{name}.stored_valid", cols, f"a padding mask of 1 to {length} stored keys" if
                       side.axis == KEY_AXIS else "null (values keep no stored padding mask)")
        stored_valid = cols
    # Where each store's tokens end: by the tiers' counts (schedule.tier_tokens), oldest first.
    if tiered:
        keeps = tuple(reversed(side.store.keeps))  # newest first, as the schedule counts them
        held = tuple(reversed(tier_tokens(side.axis, length - origin, keeps, cfg.group_size)))
        ends, pos = [], origin
        for h in held:
            pos += h
            ends.append(pos)
    else:
        ends = [length]
    memo: list = []

    def templates() -> list[Any]:  # derived once, and only for a side that holds blocks
        if not memo:
            memo.append(_templates(path, side, dtype, dims, heads, name))
        return memo[0]

    stores, lower = [], origin
    for j, ((sm_, where), end) in enumerate(zip(metas, ends)):
        stores.append(plan_store(path, r, sm_, where, layer, side, seen, origin, lower, end, sink > 0 or not sink_cap,
                                 divisor, dtype, lambda j=j: templates()[j]))
        lower = end
    return SidePlan(name, window, sink, flags["window_valid"], stored_valid, tuple(stores), tiered)


def plan_store(path: Path, r: _Reader, st: dict[str, Any], where: str, layer: Any, side: Any, seen: int,
               origin: int, lower: int, end: int, sink_full: bool, divisor: int, dtype: torch.dtype | None,
               template: Any) -> StorePlan:
    """One block store: tokens ``[start, end)`` with ``start`` from ``lower`` (later only on sliding layers,
    up to the sliding cut); blocks in order from ``origin``, never overlapping, each opened at a group boundary
    with at least ``block_size`` tokens, full but the last, whose capacity is derived
    (:func:`~kivi.cache.schedule.saved_capacity`); freed iff wholly before ``start``; its format is
    ``template()``, derived."""
    cfg = side.config
    block_size = r.get(st, "block_size", where, "int", minimum=1)
    if block_size != cfg.block_size:
        raise fail(path, f"{where}.block_size", block_size, f"{cfg.block_size} (the configuration's block_size)")
    length, start = r.get(st, "length", where, "int"), r.get(st, "start", where, "int")
    if length != end:
        raise fail(path, f"{where}.length", length, f"{end} (the position tiers' token counts)")
    starts, caps = r.get(st, "starts", where, "ints"), r.get(st, "caps", where, "ints")
    blocks = r.get(st, "blocks", where, "list")
    if not len(starts) == len(caps) == len(blocks):
        raise fail(path, f"{where}.starts/caps/blocks", [len(starts), len(caps), len(blocks)],
                   "three lists of one length")
    if not lower <= start <= length:
        raise fail(path, f"{where}.start", start,
                   f"between the first position it may hold, {lower}, and the length {length}")
    if start > lower:
        if layer.sliding_window is None:
            raise fail(path, f"{where}.start", start, f"{lower} (only sliding-window layers drop tokens)")
        cut = sliding_cut(seen - 1, layer.sliding_window, cfg.residual_length, cfg.group_size, block_size)
        if start > max(cut, lower) or (start % block_size and start != length):
            raise fail(path, f"{where}.start", start, f"a multiple of block_size {block_size} (or the length "
                                                      f"{length}) up to {cut}, the sliding window's cut")
    if not sink_full and starts:
        raise fail(path, f"{where}.starts", starts, "no blocks while the sink is not full")
    present = []
    pos = origin
    for j, (b0, cap) in enumerate(zip(starts, caps)):
        if b0 < pos or b0 >= length or (b0 - origin) % divisor:
            raise fail(path, f"{where}.starts[{j}]", b0, f"a group boundary in [{pos}, {length}) (blocks in order, "
                                                         "never overlapping)")
        freed = b0 + cap <= start
        if j == len(starts) - 1 and not freed:
            want = saved_capacity(length - b0, block_size)
            if cap != want:
                raise fail(path, f"{where}.caps[{j}]", cap, f"{want} (the last block holds {length - b0} tokens, "
                                                            f"block_size {block_size})")
        elif cap < block_size or b0 + cap > length:
            raise fail(path, f"{where}.caps[{j}]", cap, f"a full block of at least {block_size} tokens before the last")
        if cap % divisor:
            raise fail(path, f"{where}.caps[{j}]", cap, f"a multiple of group_size {divisor}")
        if (max(start, b0) - b0) % divisor:
            raise fail(path, f"{where}.start", start, f"a group boundary of block {j}")
        present.append(not freed)
        pos = b0 + cap
    tm = r.get(st, "template", where, "any")
    keeps = bool(starts) or tm is not None  # a crop to a block's start keeps the format without blocks
    if keeps and dtype is None:
        raise fail(path, f"{where}.template", tm, "null (an uninitialized layer stores nothing)")
    seg = template() if keeps else None
    want = segment_meta(seg)
    if tm != want:
        diff = next((k for k in want if not isinstance(tm, dict) or tm.get(k) != want[k]), None) if want else None
        shown = tm.get(diff) if diff and isinstance(tm, dict) else tm
        raise fail(path, f"{where}.template" + (f".{diff}" if diff else ""), shown, _show(want[diff] if diff else want))
    for j, bm in enumerate(blocks):
        if not present[j]:
            if bm is not None:
                raise fail(path, f"{where}.blocks[{j}]", Described("a block"), f"null (freed: before start {start})")
            continue
        refs = {f: {"tensor": f"{where}.blocks.{j}.{f}"} for f in seg.tensors()}
        if bm != refs:
            raise fail(path, f"{where}.blocks[{j}]", bm, _show(refs))
    return StorePlan(where, block_size, length, start, tuple(starts), tuple(caps), tuple(present), seg)


def _tiered(side: Any) -> bool:
    return isinstance(side.store, TieredStore)


def _templates(path: Path, side: Any, dtype: torch.dtype, dims: dict[str, int | None], heads: int | None,
               where: str) -> list[Any]:
    """The zero-token segment each of the side's stores holds (oldest tier first), for ``B x heads``: quantized
    by the side's own rule and demoted to each older tier's width, so dtypes and trailing shapes come from the
    code that writes them, never from the file."""
    D, B = dims.get("head_dim"), dims.get("batch")
    if D is None or B is None or heads is None:
        raise PrefixFileError(f"{path}: {where}: no tensor or model gives the batch size, kv heads and head_dim")
    cfg = side.config
    if not side.quantize:
        base = FpSegment(torch.empty((1, 1, 0, D), dtype=dtype))  # what SideState stores unquantized
        segs = [base] * len(side.chain)
    else:
        try:
            seg = side.quantize_tokens(torch.zeros((1, 1, cfg.group_size, D), dtype=dtype), None)
            segs = [demote_kv(seg, b) for b in side.store.bits] + [seg] if _tiered(side) else [seg]
        except ValueError as e:  # e.g. group_size does not divide head_dim
            raise PrefixFileError(f"{path}: {where}: this configuration cannot store head_dim={D}: {e}") from None
    return [s.with_tensors(**{k: torch.empty((B, heads, 0, *t.shape[3:]), dtype=t.dtype)
                              for k, t in s.tensors().items()}) for s in segs]


def expected_tensors(plan: SidePlan, dtype: torch.dtype | None, dims: dict[str, int | None],
                     heads: int | None) -> dict[str, TensorSpec]:
    """Every tensor the saver writes for one side, derived from its plan."""
    if dtype is None:
        return {}
    B, D, name = dims.get("batch"), dims.get("head_dim"), plan.name
    out: dict[str, TensorSpec] = {}
    if plan.window:
        out[f"{name}.window"] = TensorSpec(dtype, (B, heads, plan.window, D))
        if plan.window_valid:
            out[f"{name}.window_valid"] = TensorSpec(torch.bool, (B, plan.window))
    if plan.sink:
        out[f"{name}.sink"] = TensorSpec(dtype, (B, heads, plan.sink, D))
    if plan.stored_valid is not None:
        out[f"{name}.stored_valid"] = TensorSpec(torch.bool, (B, plan.stored_valid))
    for store in plan.stores:
        for j, present in enumerate(store.present):
            if present:
                for field, t in store.template.tensors().items():
                    lo, hi = store.rows(j, field)
                    out[f"{store.name}.blocks.{j}.{field}"] = TensorSpec(t.dtype, (*t.shape[:2], hi - lo, *t.shape[3:]))
    return out


def tail_bytes(plan: SidePlan) -> int:
    """Bytes the loader allocates for this side beyond the file's tensors: the rows of its blocks the file does
    not hold (before ``start`` in the first block still held, the unused tail of the last)."""
    total = 0
    for store in plan.stores:
        for j, present in enumerate(store.present):
            if present:
                for field, t in store.template.tensors().items():
                    lo, hi = store.rows(j, field)
                    d = token_divisor(store.template.axis, store.template.group_size, field)
                    total += TensorSpec(t.dtype, (*t.shape[:2], store.caps[j] // d - (hi - lo), *t.shape[3:])).nbytes
    return total


def state_dict(plan: LayerPlan, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The layer's :meth:`~kivi.cache.layer.KiviLayer.state_dict` from its checked plan and the tensors read
    (every size from the plan, the rows from the file)."""
    parts = []
    for group in plan.sides:
        sides = {}
        for label, sp in group.items():
            stores = [{"block_size": s.block_size, "length": s.length, "start": s.start, "starts": list(s.starts),
                       "caps": list(s.caps), "template": segment_meta(s.template),
                       "blocks": [{f: tensors[f"{s.name}.blocks.{j}.{f}"] for f in s.template.tensors()}
                                  if present else None for j, present in enumerate(s.present)]}
                      for s in sp.stores]
            sides[label] = {**{f: tensors.get(f"{sp.name}.{f}") for f in _FIELDS},
                            "store": {"tiers": stores} if sp.tiered else stores[0]}
        parts.append(sides)
    return {**plan.state, "parts": parts}


__all__ = ["StorePlan", "SidePlan", "LayerPlan", "plan_cache", "plan_side", "plan_store", "expected_tensors",
           "tail_bytes", "state_dict"]
