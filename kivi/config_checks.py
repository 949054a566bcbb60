"""The field checks :class:`kivi.config.KiviConfig` runs: per-layer fields, per-head widths, position tiers.

Each raises ``ValueError`` naming the field, its value and what is allowed.
"""

from __future__ import annotations

from typing import Any

from .quant.primitives import SUPPORTED_BITS, check_bits

#: Compensation code widths: 0 (off) or any code width (the codes are packed like the quantized ones).
RESIDUAL_BITS = (0, *SUPPORTED_BITS)
#: ``clip`` values: off, both sides, or one side only.
CLIP_VALUES = (False, True, "keys", "values")

HEAD_BITS_FIELDS = ("k_bits", "v_bits")


def parse_head_bits(head_bits: Any) -> dict[int, dict[str, list[int]]]:
    """``head_bits`` with int layer keys (JSON gives strings), checked: widths supported, lists equal length."""
    if not isinstance(head_bits or {}, dict):
        raise ValueError(f"head_bits={head_bits!r} must be a mapping {{layer index: {{\"k_bits\": [per kv head], "
                         "\"v_bits\": [...]}}")
    out: dict[int, dict[str, list[int]]] = {}
    for k, entry in dict(head_bits or {}).items():
        digits = isinstance(k, str) and k.strip().isdigit()
        if isinstance(k, bool) or not (isinstance(k, int) or digits) or int(k) < 0:
            raise ValueError(f"head_bits key {k!r} is not a layer index; expected a non-negative integer")
        idx = int(k)
        if not isinstance(entry, dict) or not entry:
            raise ValueError(f"head_bits[{idx}]={entry!r} must be a non-empty mapping like "
                             "{\"k_bits\": [4, 2, 2], \"v_bits\": [2, 2, 2]} (one width per kv head)")
        unknown = sorted(set(entry) - set(HEAD_BITS_FIELDS))
        if unknown:
            raise ValueError(f"head_bits[{idx}] has unknown field(s) {unknown}; allowed: {list(HEAD_BITS_FIELDS)}")
        lists = {}
        for name, widths in entry.items():
            if not isinstance(widths, (list, tuple)) or not widths:
                raise ValueError(f"head_bits[{idx}].{name}={widths!r} must be a non-empty list, one width per kv head")
            for b in widths:
                check_bits(b, name=f"head_bits[{idx}].{name}")
            lists[name] = [int(b) for b in widths]
        if len({len(w) for w in lists.values()}) > 1:
            raise ValueError(f"head_bits[{idx}]: k_bits has {len(lists['k_bits'])} widths but v_bits "
                             f"{len(lists['v_bits'])}; both need one width per kv head")
        out[idx] = lists
    return out


def check_int(cfg: Any, name: str, *, minimum: int, where: str = "") -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}{name}={v!r} must be an integer >= {minimum}")


def check_layer_fields(cfg: Any, *, where: str) -> None:
    for name in ("k_bits", "v_bits"):
        v = getattr(cfg, name)
        check_bits(v, name=f"{where}{name}")
        if cfg.symmetric and v < 2:
            raise ValueError(f"{where}{name}={v} is not possible with symmetric=True (no level besides 0)")
    check_int(cfg, "group_size", minimum=1, where=where)
    check_int(cfg, "residual_length", minimum=0, where=where)
    check_int(cfg, "quantize_after", minimum=0, where=where)
    if cfg.residual_length % cfg.group_size:
        raise ValueError(
            f"{where}residual_length={cfg.residual_length} must be a multiple of group_size={cfg.group_size} "
            f"(e.g. {max(cfg.group_size, cfg.residual_length // cfg.group_size * cfg.group_size)})"
        )
    check_tiers(cfg, where)
    rb = cfg.residual_bits
    if isinstance(rb, bool) or rb not in RESIDUAL_BITS:
        raise ValueError(f"{where}residual_bits={rb!r} is not allowed; choose one of {list(RESIDUAL_BITS)} (0 = off)")
    if rb and cfg.symmetric:
        raise ValueError(f"{where}residual_bits={rb} is only implemented for asymmetric quantization (symmetric=False)")
    for name in ("quantize_key", "quantize_value", "symmetric"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{where}{name}={getattr(cfg, name)!r} must be true or false")
    if not any(cfg.clip is c or (isinstance(c, str) and cfg.clip == c) for c in CLIP_VALUES):
        raise ValueError(f"{where}clip={cfg.clip!r} is not allowed; choose one of {list(CLIP_VALUES)}")
    if cfg.clip and cfg.symmetric:
        raise ValueError(f"{where}clip={cfg.clip!r} is only implemented for asymmetric quantization (symmetric=False)")


def normalize_tiers(tiers: Any) -> tuple | None:
    """``tiers`` as ``((count | None, (k_bits, v_bits) | None), ...)``; the shape is checked, the values by
    :func:`check_tiers`. JSON lists and ints are accepted (an int width applies to keys and values)."""
    if tiers is None:
        return None
    if isinstance(tiers, (str, bytes, dict)) or not hasattr(tiers, "__iter__"):
        raise ValueError(
            f"tiers={tiers!r} must be a list of (tokens, bits) pairs, e.g. [(128, None), (1024, 4), (None, 2)]"
        )
    out = []
    for i, t in enumerate(tiers):
        if isinstance(t, (str, bytes, dict)) or not hasattr(t, "__len__") or len(t) != 2:
            raise ValueError(f"tiers[{i}]={t!r} must be a (tokens, bits) pair, e.g. (1024, 4) or (None, 2)")
        n, b = t
        if b is not None and not isinstance(b, (int, bool)):
            if isinstance(b, (str, bytes, dict)) or not hasattr(b, "__len__") or len(b) != 2:
                raise ValueError(f"tiers[{i}] width {b!r} must be an int, [k_bits, v_bits] or None (full precision)")
            b = (b[0], b[1])
        elif b is not None:
            b = (b, b)
        out.append((n, b))
    return tuple(out)


def check_tiers(cfg: Any, where: str) -> None:
    """Position tiers (see :class:`KiviConfig`): window first, widths that demote by grid containment."""
    tiers = cfg.tiers
    if tiers is None:
        return
    ex = "e.g. [(128, None), (1024, 4), (None, 2)]"
    if len(tiers) < 2:
        raise ValueError(f"{where}tiers={_show(tiers)} needs the window and at least one quantized tier ({ex})")
    if tiers[0] != (cfg.residual_length, None):
        raise ValueError(f"{where}tiers[0]={_show(tiers[0])} must be (residual_length, None) = "
                         f"({cfg.residual_length}, None): the first tier is the full-precision window; "
                         f"set residual_length to change it")
    for i, (n, b) in enumerate(tiers[1:], start=1):
        last = i == len(tiers) - 1
        if last and n is not None:
            raise ValueError(f"{where}tiers[{i}]=({n}, ...) is the last tier: its token count must be None "
                             f"(every older token), {ex}")
        if not last and (isinstance(n, bool) or not isinstance(n, int) or n < cfg.group_size or n % cfg.group_size):
            raise ValueError(f"{where}tiers[{i}] token count {n!r} must be a positive multiple of "
                             f"group_size={cfg.group_size} (keys demote in whole groups)")
        if b is None:
            raise ValueError(f"{where}tiers[{i}] width None: only tiers[0] (the window) is full precision")
        for side, v in zip(("k_bits", "v_bits"), b):
            check_bits(v, name=f"{where}tiers[{i}] {side}")
    first = tiers[1][1]
    if first != (cfg.k_bits, cfg.v_bits):
        raise ValueError(f"{where}tiers[1] widths (k, v)={first} must equal (k_bits, v_bits)=({cfg.k_bits}, "
                         f"{cfg.v_bits}): tokens leaving the window are quantized at k_bits / v_bits")
    for i in range(2, len(tiers)):
        for j, side in enumerate(("k_bits", "v_bits")):
            wide, narrow = tiers[i - 1][1][j], tiers[i][1][j]
            if wide % narrow:
                raise ValueError(f"{where}tiers[{i}] {side}={narrow} cannot follow {wide}: a code demotes only to a "
                                 f"width that divides its own (its grid must contain the narrower one: "
                                 f"8->4/2/1, 4->2/1, 2->1, or the same width)")
    if cfg.symmetric or cfg.residual_bits or not (cfg.quantize_key and cfg.quantize_value):
        raise ValueError(f"{where}tiers need asymmetric quantization of keys and values without compensation "
                         f"(symmetric=False, residual_bits=0, quantize_key=quantize_value=True); got "
                         f"symmetric={cfg.symmetric}, residual_bits={cfg.residual_bits}, "
                         f"quantize_key={cfg.quantize_key}, quantize_value={cfg.quantize_value}")


def _show(t: Any) -> str:
    if isinstance(t, tuple) and t and isinstance(t[0], tuple):
        return repr(t).replace("((", "[(").replace("))", ")]")
    return repr(t)


__all__ = ["CLIP_VALUES", "HEAD_BITS_FIELDS", "RESIDUAL_BITS", "check_int", "check_layer_fields", "check_tiers",
           "normalize_tiers", "parse_head_bits"]
