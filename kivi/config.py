"""`KiviConfig`: what to quantize, how, and where (per layer)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .files import read_text, write_text
from .quant.primitives import SUPPORTED_BITS, check_bits
from .quant.side_format import AXIS, KEY_AXIS, SIDES, SideFormat

PRESETS: dict[str, dict[str, Any]] = {
    # 4-bit keys and values + 4 full-precision sink tokens: within ~0.3% of full precision here.
    "high": {"k_bits": 4, "v_bits": 4, "sink_tokens": 4},
    # The spec's "balanced" was 2/2 + error compensation; measured, that compensation does not help
    # (docs/evaluation-results.md). Keys are the sensitive side, so balanced spends its extra bits there:
    # 4-bit keys, 2-bit values, 4 sink tokens (about +2% perplexity on SmolLM2 / WikiText-2).
    "balanced": {"k_bits": 4, "v_bits": 2, "sink_tokens": 4},
    # 2-bit keys and values, nothing else: KIVI-2 as published.
    "extreme": {"k_bits": 2, "v_bits": 2},
}

ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
#: Sink tokens are a handful of full-precision tokens; more than this is a mistake (not a cache).
MAX_SINK_TOKENS = 4096
SCALE_DTYPES = ("auto", "float16", "bfloat16", "float32")
#: Compensation code widths: 0 (off) or any code width (the codes are packed like the quantized ones).
RESIDUAL_BITS = (0, *SUPPORTED_BITS)
#: ``clip`` values: off, both sides, or one side only.
CLIP_VALUES = (False, True, "keys", "values")

# Fields a `layer_specific_config` entry may override.
LAYER_FIELDS = (
    "k_bits",
    "v_bits",
    "group_size",
    "residual_length",
    "residual_bits",
    "quantize_key",
    "quantize_value",
    "symmetric",
    "clip",
    "tiers",
    "quantize_after",
)


@dataclass
class KiviConfig:
    """KIVI KV-cache quantization settings.

    Keys are quantized per channel (each channel, groups of ``group_size`` consecutive tokens);
    values per token (each token, groups of ``group_size`` channels). The most recent
    ``residual_length`` tokens stay in full precision (bit-exact).

    Attributes:
        k_bits / v_bits: code width for keys / values (1, 2, 3, 4 or 8).
        group_size: tokens per key group and channels per value group (must divide ``head_dim``).
        residual_length: full-precision window of recent tokens; a multiple of ``group_size``
            (0 allowed: keys still keep the last, incomplete group in full precision).
        residual_bits: the spec's error compensation — per quantization group, the mean of the
            quantization error, stored on ``residual_bits`` bits relative to the group's step. 0 = off.
        quantize_key / quantize_value: quantize that side at all (False keeps it full precision).
        symmetric: symmetric (no offset) instead of KIVI's asymmetric min/max; for comparison.
        layer_specific_config: ``{layer_idx: {"k_bits": 4, ...}}``; any field of ``LAYER_FIELDS``.
        block_size: tokens per preallocated storage block (multiple of ``group_size``); storage grows
            block by block, never by copying what is stored.
        scale_dtype: dtype of scales / offsets; ``"auto"`` = the cached tensors' dtype.
        attention_backend: how attention reads the cache (``"reference"`` dequantizes layer by layer).
        check_finite: raise on NaN/Inf entering the quantizer instead of storing garbage.
        sink_tokens: the first ``sink_tokens`` tokens of the sequence stay in full precision (bit-exact)
            and are left out of every group statistic ("attention sinks": the first token draws much
            of the attention and its key is an outlier that widens its channel groups). Quantized
            key groups then start at position ``sink_tokens``. Not applied to sliding-window layers
            (their first tokens fall out of the window). 0 = off (KIVI as published).
        clip: MSE-optimal clipping of every quantization group's range (a small grid of shrink
            factors, the one with the lowest squared error; :mod:`kivi.quant.clipping`): ``True`` (keys
            and values), ``"keys"``, ``"values"`` or ``False``. Same stored format and bytes, write path
            only; asymmetric only. Per layer via ``layer_specific_config``. Measured: docs/quality.md.
        head_bits: per-head widths, ``{layer_idx: {"k_bits": [one per kv head], "v_bits": [...]}}``
            (either list may be left out: that side keeps the layer's width for every head). Heads of
            one layer may then hold different widths (docs/per-head.md); the lists' length must be the
            model's number of kv heads.
        tiers: position tiers, newest first, e.g. ``[(128, None), (1024, 4), (None, 2)]``: the
            ``residual_length`` most recent tokens at full precision (``tiers[0]`` restates the window
            and must be ``(residual_length, None)``), the next 1024 at 4 bits, every older token at
            2 bits; tokens move down as they age by demotion of their codes (docs/tiers.md). A width is
            an int (keys and values) or ``[k_bits, v_bits]``; the first quantized tier's widths must be
            ``k_bits`` / ``v_bits`` (what tokens leaving the window get). ``None`` = no tiers.
        quantize_after: full precision until a layer holds more than this many tokens (0 = off, KIVI from
            the first token). While a layer holds ``<= quantize_after`` tokens nothing is quantized
            (attention is exact, memory that of a full-precision cache); the update that takes it past
            that quantizes everything but the window (and sink tokens) at once, by the usual rules, so
            from then on the layer holds what it would hold with ``quantize_after=0``
            (:func:`kivi.cache.schedule.quantizing`; docs/length-policy.md). Per layer via
            ``layer_specific_config``; not on sliding-window layers (override it to 0 there).
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    residual_bits: int = 0
    quantize_key: bool = True
    quantize_value: bool = True
    symmetric: bool = False
    layer_specific_config: dict[int, dict[str, Any]] = field(default_factory=dict)
    block_size: int = 256
    scale_dtype: str = "auto"
    attention_backend: str = "auto"
    check_finite: bool = True
    sink_tokens: int = 0
    clip: bool | str = False
    head_bits: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    tiers: tuple | None = None
    quantize_after: int = 0

    def __post_init__(self) -> None:
        self.tiers = _normalize_tiers(self.tiers)
        # JSON turns int keys into strings; accept both.
        lsc = {}
        if not isinstance(self.layer_specific_config or {}, dict):
            raise ValueError(
                f"layer_specific_config={self.layer_specific_config!r} "
                "must be a mapping {layer index: {field: value}}"
            )
        for k, v in dict(self.layer_specific_config or {}).items():
            digits = isinstance(k, str) and k.strip().isdigit()
            if isinstance(k, bool) or not (isinstance(k, int) or digits):
                raise ValueError(
                    f"layer_specific_config key {k!r} is not a layer index; expected a non-negative integer"
                )
            if not isinstance(v, dict):
                raise ValueError(
                    f"layer_specific_config[{k!r}]={v!r} must be a mapping of fields, e.g. {{\"k_bits\": 4}}"
                )
            lsc[int(k)] = dict(v)
            if "tiers" in v:
                lsc[int(k)]["tiers"] = _normalize_tiers(v["tiers"])
        self.layer_specific_config = lsc
        self.head_bits = _parse_head_bits(self.head_bits)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self, num_layers: int | None = None) -> None:
        """Raise ``ValueError`` naming the field, its value and what is allowed."""
        _check_layer_fields(self, where="")
        _check_int(self, "block_size", minimum=1)
        _check_int(self, "sink_tokens", minimum=0)
        if self.sink_tokens > MAX_SINK_TOKENS:
            raise ValueError(
                f"sink_tokens={self.sink_tokens} is more than {MAX_SINK_TOKENS}: "
                "sink tokens are kept in full precision "
                "(a handful, e.g. 4, is what they are for); use residual_length for a longer full-precision window"
            )
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"check_finite={self.check_finite!r} must be true or false")
        if self.block_size % self.group_size:
            raise ValueError(
                f"block_size={self.block_size} must be a multiple of group_size={self.group_size}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} is not allowed; choose one of {list(SCALE_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is not allowed; choose one of {list(ATTENTION_BACKENDS)}"
            )
        for idx, overrides in self.layer_specific_config.items():
            if idx < 0:
                raise ValueError(f"layer_specific_config has layer index {idx}; layer indices start at 0")
            if num_layers is not None and idx >= num_layers:
                raise ValueError(
                    f"layer_specific_config has layer index {idx}, but the model has {num_layers} layers "
                    f"(valid indices 0..{num_layers - 1})"
                )
            unknown = sorted(set(overrides) - set(LAYER_FIELDS))
            if unknown:
                raise ValueError(
                    f"layer_specific_config[{idx}] has unknown field(s) {unknown}; allowed: {list(LAYER_FIELDS)}"
                )
            if overrides:
                try:
                    dataclasses.replace(self, layer_specific_config={}, head_bits={}, **overrides)  # validates
                except ValueError as e:
                    raise ValueError(f"layer_specific_config[{idx}].{e}") from None
        for idx, entry in self.head_bits.items():
            if num_layers is not None and idx >= num_layers:
                raise ValueError(
                    f"head_bits has layer index {idx}, but the model has {num_layers} layers "
                    f"(valid indices 0..{num_layers - 1})"
                )
            lcfg = self.for_layer(idx)
            for name, quant in (("k_bits", lcfg.quantize_key), ("v_bits", lcfg.quantize_value)):
                if name in entry and not quant:
                    side = "quantize_key" if name == "k_bits" else "quantize_value"
                    raise ValueError(f"head_bits[{idx}].{name} is given but {side}=False for layer {idx}; "
                                     "drop it or quantize that side")
                for b in entry.get(name, ()):
                    if lcfg.symmetric and b < 2:
                        raise ValueError(f"head_bits[{idx}].{name} has {b}, not possible with symmetric=True "
                                         "(no level besides 0); allowed: >= 2")

    def check_kv_heads(self, num_kv_heads: int) -> None:
        """Every ``head_bits`` list must have one width per kv head (``num_kv_heads``); ``ValueError`` otherwise."""
        for idx, entry in self.head_bits.items():
            for name, widths in entry.items():
                if len(widths) != num_kv_heads:
                    raise ValueError(f"head_bits[{idx}].{name} has {len(widths)} widths, but the layer has "
                                     f"{num_kv_heads} kv heads; give exactly one width per kv head")

    def layer_head_bits(self, layer_idx: int) -> tuple[list[int], list[int]] | None:
        """``(k_bits per kv head, v_bits per kv head)`` of a layer with per-head widths, else ``None``.

        A side ``head_bits`` leaves out has the layer's width (after ``layer_specific_config``) on every head.
        """
        entry = self.head_bits.get(layer_idx)
        if entry is None:
            return None
        lcfg = self.for_layer(layer_idx)
        n = len(next(iter(entry.values())))
        return (list(entry.get("k_bits", [lcfg.k_bits] * n)), list(entry.get("v_bits", [lcfg.v_bits] * n)))

    def clips(self, axis: str) -> bool:
        """Whether groups of ``axis`` (``"channel"``: keys, ``"token"``: values) are clipped."""
        return self.clip is True or self.clip == ("keys" if axis == KEY_AXIS else "values")

    def side_format(self, side: str, layer: int | None = None, head: int | None = None) -> SideFormat:
        """The quantized format of side ``side`` (``"k"`` keys, ``"v"`` values): of this config, or of layer
        ``layer`` (``layer_specific_config`` applied) and, with ``head``, of that kv head (``head_bits``)."""
        if side not in SIDES:
            raise ValueError(f"side={side!r} must be one of {list(SIDES)} (keys, values)")
        cfg = self.for_layer(layer) if layer in self.layer_specific_config else self  # only fields are read
        bits = cfg.k_bits if side == "k" else cfg.v_bits
        if head is not None:
            if layer is None:
                raise ValueError(f"head={head!r} needs layer: per-head widths (head_bits) are given per layer")
            widths = self.layer_head_bits(layer)
            if widths is not None:
                if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < len(widths[0]):
                    raise ValueError(f"head={head!r} is not a kv head of layer {layer} "
                                     f"(head_bits gives {len(widths[0])}: 0..{len(widths[0]) - 1})")
                bits = widths[SIDES.index(side)][head]
        sd = None if cfg.scale_dtype == "auto" else getattr(torch, cfg.scale_dtype)
        return SideFormat(AXIS[side], bits, cfg.group_size, symmetric=cfg.symmetric, residual_bits=cfg.residual_bits,
                          clip=cfg.clips(AXIS[side]), scale_dtype=sd, check_finite=cfg.check_finite)

    # ------------------------------------------------------------------ per layer
    def for_layer(self, layer_idx: int) -> "KiviConfig":
        """This config with ``layer_specific_config[layer_idx]`` applied (and no further overrides)."""
        overrides = self.layer_specific_config.get(layer_idx, {})
        # Per-head widths are not a layer's config: `layer_head_bits` reads them (kivi/cache/heads.py).
        return dataclasses.replace(self, layer_specific_config={}, head_bits={}, **overrides)

    # ------------------------------------------------------------------ presets / json
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "KiviConfig":
        """``"high"`` (K4 V4 + sinks), ``"balanced"`` (K4 V2 + sinks) or ``"extreme"`` (K2 V2, plain KIVI)."""
        key = str(name).lower()
        if key not in PRESETS:
            raise ValueError(f"preset={name!r} is unknown; choose one of {list(PRESETS)}")
        return cls(**{**PRESETS[key], **overrides})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tiers"] = None if self.tiers is None else [[n, None if b is None else list(b)] for n, b in self.tiers]
        d["layer_specific_config"] = {str(k): dict(v) for k, v in self.layer_specific_config.items()}
        for v in d["layer_specific_config"].values():
            if v.get("tiers") is not None:
                v["tiers"] = [[n, None if b is None else list(b)] for n, b in v["tiers"]]
        d["head_bits"] = {str(k): {n: list(w) for n, w in v.items()} for k, v in self.head_bits.items()}
        return d

    def to_json(self, path: str | Path | None = None, *, indent: int = 2) -> str:
        """Serialise to JSON; also write it to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=False)
        if path is not None:
            write_text(path, text + "\n")  # the one writer: atomic, refuses a device / FIFO / folder
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KiviConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a KiviConfig must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown KiviConfig field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "KiviConfig":
        """Load from a JSON string or a path to a JSON file."""
        s = str(text_or_path)
        if not s.lstrip().startswith("{"):
            p = Path(s)
            try:  # the one bounded reader: a FIFO or a device stops at its bound; not UTF-8 is one line
                s = read_text(p, option="KiviConfig JSON file")
            except OSError as e:
                raise ValueError(f"cannot read KiviConfig JSON file {str(p)!r}: {e.strerror or 'it does not exist'}"
                                 ) from None
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid KiviConfig JSON: {e}") from None
        except RecursionError:
            raise ValueError("invalid KiviConfig JSON: nested too deeply") from None
        # `kivi tune --json` wraps the config with its measurements.
        if isinstance(d, dict) and "config" in d and isinstance(d["config"], dict) and "k_bits" not in d:
            d = d["config"]
        return cls.from_dict(d)

    # ------------------------------------------------------------------ describe
    def describe(self) -> str:
        parts = []
        parts.append(f"K{self.k_bits if self.quantize_key else 'fp'}")
        parts.append(f"V{self.v_bits if self.quantize_value else 'fp'}")
        parts.append(f"G{self.group_size}")
        parts.append(f"R{self.residual_length}")
        if self.residual_bits:
            parts.append(f"comp{self.residual_bits}")
        if self.symmetric:
            parts.append("sym")
        if self.clip:
            parts.append("clip" if self.clip is True else f"clip-{self.clip}")
        if self.sink_tokens:
            parts.append(f"sink{self.sink_tokens}")
        if self.quantize_after:
            parts.append(f"fp<={self.quantize_after}")
        if self.tiers:
            parts.append("tiers " + "/".join(
                f"{'rest' if n is None else n}@{'fp' if b is None else (b[0] if b[0] == b[1] else f'K{b[0]}V{b[1]}')}"
                for n, b in self.tiers))
        if self.layer_specific_config:
            parts.append(f"{len(self.layer_specific_config)} layer overrides")
        if self.head_bits:
            parts.append(f"{len(self.head_bits)} per-head layers")
        return " ".join(parts)


HEAD_BITS_FIELDS = ("k_bits", "v_bits")


def _parse_head_bits(head_bits: Any) -> dict[int, dict[str, list[int]]]:
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


def _check_int(cfg: Any, name: str, *, minimum: int, where: str = "") -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}{name}={v!r} must be an integer >= {minimum}")


def _check_layer_fields(cfg: KiviConfig, *, where: str) -> None:
    for name in ("k_bits", "v_bits"):
        v = getattr(cfg, name)
        check_bits(v, name=f"{where}{name}")
        if cfg.symmetric and v < 2:
            raise ValueError(f"{where}{name}={v} is not possible with symmetric=True (no level besides 0)")
    _check_int(cfg, "group_size", minimum=1, where=where)
    _check_int(cfg, "residual_length", minimum=0, where=where)
    _check_int(cfg, "quantize_after", minimum=0, where=where)
    if cfg.residual_length % cfg.group_size:
        raise ValueError(
            f"{where}residual_length={cfg.residual_length} must be a multiple of group_size={cfg.group_size} "
            f"(e.g. {max(cfg.group_size, cfg.residual_length // cfg.group_size * cfg.group_size)})"
        )
    _check_tiers(cfg, where)
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


def _normalize_tiers(tiers: Any) -> tuple | None:
    """``tiers`` as ``((count | None, (k_bits, v_bits) | None), ...)``; the shape is checked, the values by
    :func:`_check_tiers`. JSON lists and ints are accepted (an int width applies to keys and values)."""
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


def _check_tiers(cfg: Any, where: str) -> None:
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
