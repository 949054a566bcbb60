"""`KiviConfig`: what to quantize, how, and where (per layer)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .config_checks import check_int, check_layer_fields, normalize_tiers, parse_head_bits
from .files import read_text, write_text
from .quant.rotation import check_rotation
from .quant.side_format import AXIS, KEY_AXIS, SIDES, SideFormat

PRESETS: dict[str, dict[str, Any]] = {
    # 4-bit keys and values + 4 full-precision sink tokens: within ~0.3% of full precision here.
    "high": {"k_bits": 4, "v_bits": 4, "sink_tokens": 4},
    # The spec's "balanced" was 2/2 + error compensation; measured, that compensation does not help
    # (docs/results.md, "Evaluation results in full"). Keys are the sensitive side, so
    # balanced spends its extra bits there:
    # 4-bit keys, 2-bit values, 4 sink tokens (about +2% perplexity on SmolLM2 / WikiText-2).
    "balanced": {"k_bits": 4, "v_bits": 2, "sink_tokens": 4},
    # 2-bit keys and values, nothing else: KIVI-2 as published.
    "extreme": {"k_bits": 2, "v_bits": 2},
}

ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
#: Sink tokens are a handful of full-precision tokens; more than this is a mistake (not a cache).
MAX_SINK_TOKENS = 4096
SCALE_DTYPES = ("auto", "float16", "bfloat16", "float32")

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
            only; asymmetric only. Per layer via ``layer_specific_config``. Measured: docs/python.md, "Quality per bit".
        head_bits: per-head widths, ``{layer_idx: {"k_bits": [one per kv head], "v_bits": [...]}}``
            (either list may be left out: that side keeps the layer's width for every head). Heads of
            one layer may then hold different widths (docs/python.md, "Per-head widths"); the lists' length must be the
            model's number of kv heads.
        tiers: position tiers, newest first, e.g. ``[(128, None), (1024, 4), (None, 2)]``: the
            ``residual_length`` most recent tokens at full precision (``tiers[0]`` restates the window
            and must be ``(residual_length, None)``), the next 1024 at 4 bits, every older token at
            2 bits; tokens move down as they age by demotion of their codes (docs/python.md, "Position tiers").
            A width is an int (keys and values) or ``[k_bits, v_bits]``; the first quantized tier's widths must be
            ``k_bits`` / ``v_bits`` (what tokens leaving the window get). ``None`` = no tiers.
        quantize_after: full precision until a layer holds more than this many tokens (0 = off, KIVI from
            the first token). While a layer holds ``<= quantize_after`` tokens nothing is quantized
            (attention is exact, memory that of a full-precision cache); the update that takes it past
            that quantizes everything but the window (and sink tokens) at once, by the usual rules, so
            from then on the layer holds what it would hold with ``quantize_after=0``
            (:func:`kivi.cache.schedule.quantizing`; docs/python.md, "Precision chosen from the request's length").
            Per layer via ``layer_specific_config``; not on sliding-window layers (override it to 0 there).
        key_rotation: ``"none"`` (KIVI as published) or ``"hadamard"``: stored keys are quantized after an
            orthogonal rotation of each head's channels (normalized Walsh-Hadamard with a fixed +-1 sign per
            row; ``head_dim`` must be a power of two) and rotated back when read (:mod:`kivi.quant.rotation`).
            Same bytes; sink tokens and the window stay unrotated and bit-exact. Read by the ``reference``
            attention backend only (``"auto"`` picks it; the packed backends and KIVI pages refuse it).
            Measured: docs/evaluation.md, "Key rotation (Hadamard) screened with the suite".
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
    key_rotation: str = "none"

    def __post_init__(self) -> None:
        self.tiers = normalize_tiers(self.tiers)
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
                lsc[int(k)]["tiers"] = normalize_tiers(v["tiers"])
        self.layer_specific_config = lsc
        self.head_bits = parse_head_bits(self.head_bits)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self, num_layers: int | None = None) -> None:
        """Raise ``ValueError`` naming the field, its value and what is allowed."""
        check_layer_fields(self, where="")
        check_int(self, "block_size", minimum=1)
        check_int(self, "sink_tokens", minimum=0)
        if self.sink_tokens > MAX_SINK_TOKENS:
            raise ValueError(
                f"sink_tokens={self.sink_tokens} is more than {MAX_SINK_TOKENS}: "
                "sink tokens are kept in full precision "
                "(a handful, e.g. 4, is what they are for); use residual_length for a longer full-precision window"
            )
        check_rotation(self.key_rotation)
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
                          clip=cfg.clips(AXIS[side]), scale_dtype=sd, check_finite=cfg.check_finite,
                          rotation=cfg.key_rotation if side == "k" else "none")

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
        if self.key_rotation != "none":
            parts.append(f"rot-{self.key_rotation}")
        if self.layer_specific_config:
            parts.append(f"{len(self.layer_specific_config)} layer overrides")
        if self.head_bits:
            parts.append(f"{len(self.head_bits)} per-head layers")
        return " ".join(parts)
