"""A saved prefix file read as untrusted input: what it must hold, derived before anything is allocated.

A prefix file (:mod:`kivi.cache.persist`) carries a sha256 of its metadata and of every tensor, but
anyone can recompute those: they catch damage, not a forged file. So the loader trusts no size the
file states. From the configuration (the caller's, or the file's when none is given), the model's
shape where known and the file's token counts (checked against each other and against the cache's
schedule, :mod:`kivi.cache.schedule`), :func:`expected_tensors` derives the name, dtype and shape of
every tensor the file must hold; :func:`check_tensor_table` compares the file's safetensors table
with it before a byte is read; :func:`check_allocation` bounds what the built cache allocates beyond
the file's own bytes (the unused tail of each side's last block, less than ``block_size`` tokens);
:func:`check_values` refuses non-finite floats, non-boolean masks and token ids outside the
vocabulary. Every failure is a :class:`PrefixFileError` with one line naming the file, the field,
what was found and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..quant.kv import token_divisor
from .schedule import layer_sink_tokens, side_tokens, sliding_cut
from .store import FpSegment

#: safetensors dtype names -> torch dtypes (the ones a prefix file may hold).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
#: dtypes a layer's keys / values may have (the model's activations).
LAYER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
#: Bytes the unused tails of the last blocks may add beyond the file's own tensor bytes when that is more than
#: the file holds (a short prefix in large blocks): a larger claim is refused before anything is allocated.
TAIL_ALLOWANCE_BYTES = 64 << 20


class PrefixFileError(ValueError):
    """A prefix file cannot be loaded here; the message names the file and what differs."""


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one tensor (expected, or as a file's table states it with its byte range)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)} [{', '.join('?' if n is None else str(n) for n in self.shape)}]"


@dataclass(frozen=True)
class SidePlan:
    """One side of one layer as the file's counts say, checked: what the loader builds."""

    origin: int  # first stored position (the sink's length; 0 for an unquantized side)
    length: int  # store.length
    start: int  # store.start (after sliding-window evictions)
    starts: tuple[int, ...]
    caps: tuple[int, ...]
    present: tuple[bool, ...]
    template: Any  # a zero-token segment for B=1, H=1 (PackedKV / FpSegment) or None
    window: int  # tokens in the full-precision window
    sink: int
    window_valid: bool
    stored_valid: int | None  # columns of the stored keys' padding mask (None: no mask)

    def filled(self, j: int) -> int:
        return max(0, min(self.caps[j], self.length - self.starts[j]))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Described(str):
    """A description shown as it is (not quoted) in an error message."""


def _show(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, Described) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(path: Path, field: str, found: Any, expected: str) -> PrefixFileError:
    """The one error shape: ``<file>: <field>: found <value>, expected <what>``."""
    return PrefixFileError(f"{path}: {field}: found {_show(found)}, expected {expected}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Reader:
    """Typed access to the file's JSON metadata: a missing key or a wrong type is a :class:`PrefixFileError`."""

    def __init__(self, path: Path):
        self.path = path

    def get(self, obj: dict, key: str, where: str, kind: str, *, minimum: int | None = 0) -> Any:
        field = f"{where}.{key}" if where else key
        if not isinstance(obj, dict) or key not in obj:
            raise PrefixFileError(f"{self.path}: metadata field {field} is missing")
        value = obj[key]
        if kind == "int":
            if not _is_int(value) or (minimum is not None and value < minimum):
                raise fail(self.path, field, value, f"an integer >= {minimum}" if minimum is not None else "an integer")
        elif kind == "int?":
            if value is not None and (not _is_int(value) or value < 1):
                raise fail(self.path, field, value, "null or an integer >= 1")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise fail(self.path, field, value, "true or false")
        elif kind == "ints":
            if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
                raise fail(self.path, field, value, "a list of integers >= 0")
        elif kind == "bools":
            if not isinstance(value, list) or not all(isinstance(v, bool) for v in value):
                raise fail(self.path, field, value, "a list of true/false")
        elif kind == "dict":
            if not isinstance(value, dict):
                raise fail(self.path, field, value, "a JSON object")
        elif kind == "list":
            if not isinstance(value, list):
                raise fail(self.path, field, value, "a JSON list")
        elif kind == "str?":
            if value is not None and not isinstance(value, str):
                raise fail(self.path, field, value, "null or a string")
        return value


# ---------------------------------------------------------------------------------------------- the table
def parse_table(path: Path, table: dict[str, Any], payload: int) -> dict[str, TensorSpec]:
    """The safetensors tensor table (header JSON without ``__metadata__``) as :class:`TensorSpec`\\ s, checked:
    known dtypes, integer shapes, byte ranges that match dtype x shape and tile ``[0, payload)`` exactly."""
    out: dict[str, TensorSpec] = {}
    for name, info in table.items():
        where = f"tensor table entry {name!r}"
        if not isinstance(info, dict):
            raise fail(path, where, info, "an object with dtype, shape, data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise fail(path, f"{where} dtype", dtype, f"one of {sorted(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise fail(path, f"{where} shape", shape, "a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise fail(path, f"{where} data_offsets", offsets, "[begin, end] with 0 <= begin <= end")
        spec = TensorSpec(SAFETENSORS_DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
        if spec.end - spec.begin != spec.nbytes:
            raise fail(path, f"{where} data_offsets", offsets, f"{spec.nbytes} bytes for {spec.describe()}")
        out[name] = spec
    pos = 0
    for name, spec in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if spec.begin != pos:
            raise fail(path, f"tensor table entry {name!r} data_offsets", [spec.begin, spec.end],
                       f"to start at byte {pos} (tensors back to back, no gap or overlap)")
        pos = spec.end
    if pos != payload:
        raise PrefixFileError(f"{path}: tensor table covers {pos} bytes, the file holds {payload} after its header")
    return out


def check_tensor_table(path: Path, table: dict[str, TensorSpec], expected: dict[str, TensorSpec]) -> None:
    """Raise unless the file's tensors are exactly ``expected``: same names, dtypes and shapes."""
    for name in sorted(set(expected) | set(table)):
        if name not in table:
            raise fail(path, f"tensor {name}", Described("nothing"), expected[name].describe())
        if name not in expected:
            raise fail(path, f"tensor {name}", Described(table[name].describe()),
                       "no such tensor (not in the cache's state)")
        got, want = table[name], expected[name]
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            raise fail(path, f"tensor {name}", Described(got.describe()), want.describe())


# ---------------------------------------------------------------------------------------------- structure
def cache_dims(table: dict[str, TensorSpec], known: dict[str, int | None], meta: dict[str, Any]
               ) -> dict[str, int | None]:
    """Batch, kv heads and head_dim: the caller's (model / fingerprint) where known, else as the file's
    tensors state them (``None`` when no tensor has that axis); every tensor is then checked against
    these, so all must agree."""
    dims = {"batch": None, **known}
    for name, spec in sorted(table.items()):
        if not name.startswith("layer") or len(spec.shape) not in (2, 4):
            continue
        dims["batch"] = spec.shape[0] if dims["batch"] is None else dims["batch"]
        if len(spec.shape) == 4:
            dims["heads"] = spec.shape[1] if dims.get("heads") is None else dims["heads"]
            if dims.get("head_dim") is None and name.rsplit(".", 1)[-1] in ("window", "sink", "data"):
                dims["head_dim"] = spec.shape[3]
    ids = table.get("input_ids")
    if dims["batch"] is None and ids is not None and len(ids.shape) == 2:  # a cache holding no tensor yet
        dims["batch"] = ids.shape[0]
    if dims.get("head_dim") is None:  # only packed blocks hold channels: their template names head_dim
        for lm in meta.get("layers") if isinstance(meta.get("layers"), list) else []:
            for label in ("k", "v"):
                sm = lm.get(label) if isinstance(lm, dict) else None
                st = sm.get("store") if isinstance(sm, dict) else None
                tm = st.get("template") if isinstance(st, dict) else None
                if isinstance(tm, dict) and _is_int(tm.get("head_dim")) and tm["head_dim"] > 0:
                    dims["head_dim"] = tm["head_dim"]
    return dims


def _template(path: Path, layer: Any, side: Any, dtype: torch.dtype, head_dim: int, where: str) -> Any:
    """The zero-token segment this side stores (B=1, H=1): quantized by the layer's own rule, so dtypes and
    trailing shapes come from the code that writes them, never from the file."""
    cfg = layer.config
    if not side.quantize:
        return FpSegment(torch.empty((1, 1, 0, head_dim), dtype=dtype))  # what KiviLayer stores unquantized
    try:
        seg = layer._quantize(side, torch.zeros((1, 1, cfg.group_size, head_dim), dtype=dtype), None)
    except ValueError as e:  # e.g. group_size does not divide head_dim
        raise PrefixFileError(f"{path}: {where}: this configuration cannot store head_dim={head_dim}: {e}") from None
    return seg.with_tensors(**{k: t[:, :, :0] for k, t in seg.tensors().items()})


def template_meta(template: Any, batch: int | None = None, heads: int | None = None) -> dict[str, Any]:
    """What a prefix file records of a store's template (its fields for ``batch`` x ``heads``, by default
    the template's own): the saver writes it, the loader compares it with the one it derives."""
    fields = {k: {"dtype": dtype_name(t.dtype),
                  "shape": [t.shape[0] if batch is None else batch, t.shape[1] if heads is None else heads,
                            *t.shape[3:]]}
              for k, t in template.tensors().items()}
    if isinstance(template, FpSegment):
        return {"kind": "fp", "axis": template.axis, "group_size": template.group_size, "fields": fields}
    return {"kind": "packed", "bits": template.bits, "group_size": template.group_size, "axis": template.axis,
            "head_dim": template.head_dim, "residual_bits": template.residual_bits, "fields": fields}


def plan_side(path: Path, r: _Reader, sm: dict[str, Any], layer: Any, side: Any, seen: int, due: bool,
              dtype: torch.dtype | None, dims: dict[str, int | None], table: dict[str, TensorSpec],
              where: str) -> SidePlan:
    """Check one side's metadata against the configuration and the schedule; what the loader builds."""
    cfg = layer.config
    flags = {f: r.get(sm, f, where, "bool") for f in ("window", "window_valid", "sink", "stored_valid")}
    st = r.get(sm, "store", where, "dict")
    sw = f"{where}.store"
    block_size = r.get(st, "block_size", sw, "int", minimum=1)
    if block_size != cfg.block_size:
        raise fail(path, f"{sw}.block_size", block_size, f"{cfg.block_size} (the configuration's block_size)")
    length, start = r.get(st, "length", sw, "int"), r.get(st, "start", sw, "int")
    starts, caps, present = r.get(st, "starts", sw, "ints"), r.get(st, "caps", sw, "ints"), r.get(st, "present", sw, "bools")
    if not len(starts) == len(caps) == len(present):
        raise fail(path, f"{sw}.starts/caps/present", [len(starts), len(caps), len(present)], "three lists of one length")
    if length > seen:
        raise fail(path, f"{sw}.length", length, f"at most the {seen} tokens the layer has seen")
    sink_cap = layer_sink_tokens(cfg.sink_tokens, layer.sliding_window) if side.quantize else 0
    sink = min(sink_cap, length) if sink_cap else 0
    if flags["sink"] != (sink > 0):
        raise fail(path, f"{where}.sink", flags["sink"], f"{sink > 0} (store length {length}, sink_tokens {sink_cap})")
    origin = sink
    if not start >= origin or start > length:
        raise fail(path, f"{sw}.start", start, f"between the first stored position {origin} and the length {length}")
    if start > origin and layer.sliding_window is None:
        raise fail(path, f"{sw}.start", start, f"{origin} (only sliding-window layers drop tokens)")
    if start > origin:  # dropped at the start of a forward, up to the cut of the tokens before it
        cut = sliding_cut(seen - 1, layer.sliding_window, cfg.residual_length, cfg.group_size, block_size)
        if start > cut or (start % block_size and start != length):
            raise fail(path, f"{sw}.start", start, f"a multiple of block_size {block_size} (or the length {length}) "
                                                    f"up to {cut}, the sliding window's cut")
    if sink_cap and length < sink_cap and starts:
        raise fail(path, f"{sw}.starts", starts, "no blocks while the sink is not full")
    window = seen - length if side.quantize else 0
    if not side.quantize and length != seen:
        raise fail(path, f"{sw}.length", length, f"{seen}: an unquantized side stores every token")
    if flags["window"] != (window > 0):
        raise fail(path, f"{where}.window", flags["window"], f"{window > 0} ({window} tokens after the store)")
    if side.quantize and not due and window:
        most = side_tokens(side.axis, seen, cfg.residual_length, cfg.group_size, sink_cap, True, cfg.quantize_after)[2]
        if window > most:
            raise fail(path, f"{sw}.length", length, f"at least {seen - most} (the window holds at most {most} of "
                                                      f"{seen} tokens)")
    divisor = token_divisor(side.axis, cfg.group_size, "scale") if side.quantize else 1
    if (length - origin) % divisor:
        raise fail(path, f"{sw}.length", length, f"{origin} + a multiple of group_size {divisor} (keys are stored "
                                                  "in whole groups)")
    if flags["window_valid"] and not window:
        raise fail(path, f"{where}.window_valid", True, "false (no window)")
    stored_valid = None
    if flags["stored_valid"]:
        spec = table.get(f"{where}.stored_valid")
        cols = spec.shape[-1] if spec is not None and spec.shape else None
        if side.axis != "channel" or not side.quantize or cols is None or not 1 <= cols <= length:
            raise fail(path, f"{where}.stored_valid", cols, f"a padding mask of 1 to {length} stored keys" if
                       side.axis == "channel" else "none (values keep no stored padding mask)")
        stored_valid = cols
    # Blocks: back to back from the first stored position; all full but the last, whose capacity is what
    # a fresh append gives (block_size, or exactly its tokens when more); dropped iff wholly before `start`.
    if (length > origin) != bool(starts):
        raise fail(path, f"{sw}.starts", starts, f"{'at least one block' if length > origin else 'no blocks'} for "
                                                 f"stored tokens [{origin}, {length})")
    pos = origin
    for j, (b0, cap) in enumerate(zip(starts, caps)):
        if b0 != pos:
            raise fail(path, f"{sw}.starts[{j}]", b0, f"{pos} (blocks are back to back)")
        last = j == len(starts) - 1
        if last:
            filled = length - b0
            if filled < 1 or cap != max(block_size, filled):
                raise fail(path, f"{sw}.caps[{j}]", cap, f"{max(block_size, max(filled, 1))} (the last block holds "
                                                         f"{filled} tokens, block_size {block_size})")
        elif cap < block_size or b0 + cap >= length:
            raise fail(path, f"{sw}.caps[{j}]", cap, f"a full block of at least {block_size} tokens before the last")
        if cap % divisor:
            raise fail(path, f"{sw}.caps[{j}]", cap, f"a multiple of group_size {divisor}")
        if present[j] != (b0 + cap > start):
            raise fail(path, f"{sw}.present[{j}]", present[j], f"{b0 + cap > start} (store start {start})")
        pos = b0 + cap
    tm = r.get(st, "template", sw, "any") if "template" in st else None
    template = None
    if dtype is not None and (starts or tm is not None):
        if dims.get("head_dim") is None:
            raise PrefixFileError(f"{path}: {sw}.template: no tensor or model gives head_dim")
        template = _template(path, layer, side, dtype, dims["head_dim"], sw)
        want = template_meta(template, dims["batch"], dims["heads"])
        if tm != want:
            diff = next((k for k in want if not isinstance(tm, dict) or tm.get(k) != want[k]), "template")
            raise fail(path, f"{sw}.template.{diff}", tm.get(diff) if isinstance(tm, dict) else tm, _show(want[diff]))
    elif starts:
        raise fail(path, f"{where}", "blocks", "none in an uninitialized layer")
    return SidePlan(origin, length, start, tuple(starts), tuple(caps), tuple(present), template, window, sink,
                    flags["window_valid"], stored_valid)


def expected_tensors(name: str, plan: SidePlan, dtype: torch.dtype | None, dims: dict[str, int | None]
                     ) -> dict[str, TensorSpec]:
    """Every tensor the saver writes for one side (``name``: ``layer{i}.{k,v}``), derived from its plan."""
    if dtype is None:
        return {}
    B, H, D = dims.get("batch"), dims.get("heads"), dims.get("head_dim")
    out: dict[str, TensorSpec] = {}
    if plan.window:
        out[f"{name}.window"] = TensorSpec(dtype, (B, H, plan.window, D))
        if plan.window_valid:
            out[f"{name}.window_valid"] = TensorSpec(torch.bool, (B, plan.window))
    if plan.sink:
        out[f"{name}.sink"] = TensorSpec(dtype, (B, H, plan.sink, D))
    if plan.stored_valid is not None:
        out[f"{name}.stored_valid"] = TensorSpec(torch.bool, (B, plan.stored_valid))
    for j, present in enumerate(plan.present):
        if not present:
            continue
        for field, t in plan.template.tensors().items():
            rows = plan.filled(j) // token_divisor(plan.template.axis, plan.template.group_size, field)
            out[f"{name}.block{j}.{field}"] = TensorSpec(t.dtype, (B, H, rows, *t.shape[3:]))
    return out


def tail_bytes(plan: SidePlan, dims: dict[str, int | None]) -> int:
    """Bytes the loader allocates for this side beyond the file's tensors: the unused tail of its last block."""
    if not plan.present or not plan.present[-1]:
        return 0
    j = len(plan.caps) - 1
    total = 0
    for field, t in plan.template.tensors().items():
        d = token_divisor(plan.template.axis, plan.template.group_size, field)
        rows = plan.caps[j] // d - plan.filled(j) // d
        total += TensorSpec(t.dtype, (dims["batch"], dims["heads"], rows, *t.shape[3:])).nbytes
    return total


def check_allocation(path: Path, tails: int, payload: int) -> None:
    """Refuse a file whose cache would allocate more beyond its own bytes than :data:`TAIL_ALLOWANCE_BYTES`
    or the file's size, whichever is larger (a forged ``block_size`` / capacity)."""
    allowed = max(payload, TAIL_ALLOWANCE_BYTES)
    if tails > allowed:
        raise fail(path, "unused block capacity", Described(f"{tails} bytes"), f"at most {allowed} bytes beyond the file's "
                                                                     f"{payload} bytes of tensors")


# ---------------------------------------------------------------------------------------------- values
def check_values(path: Path, name: str, t: torch.Tensor, vocab_size: int | None) -> None:
    """Floats finite, masks 0/1, token ids in ``[0, vocab_size)`` (``>= 0`` when the vocabulary is unknown)."""
    if t.dtype.is_floating_point:
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise fail(path, f"tensor {name}", Described(f"{int(bad.sum())} non-finite values"), "finite values only")
    elif t.dtype == torch.bool:
        raw = t.view(torch.uint8)
        if bool((raw > 1).any()):
            raise fail(path, f"tensor {name}", Described(f"byte {int(raw.max())}"), "0 or 1 (a boolean mask)")
    elif name == "input_ids" and t.numel():
        lo, hi = int(t.min()), int(t.max())
        top = vocab_size if vocab_size is not None else None
        if lo < 0 or (top is not None and hi >= top):
            raise fail(path, "tensor input_ids", Described(f"ids {lo}..{hi}"), f"ids in [0, {top})" if top else "ids >= 0")


def layer_dtype(path: Path, value: Any, where: str) -> torch.dtype:
    if value not in LAYER_DTYPES:
        raise fail(path, where, value, f"one of {sorted(LAYER_DTYPES)}")
    return LAYER_DTYPES[value]


def known_dims(fingerprint: dict[str, Any], heads: int | None, head_dim: int | None) -> dict[str, int | None]:
    """Head count and head_dim from the model when given, else from the (already matched) fingerprint."""
    def pick(given: int | None, key: str) -> int | None:
        if given is not None:
            return given
        v = fingerprint.get(key)
        return v if _is_int(v) and v > 0 else None

    return {"heads": pick(heads, "num_key_value_heads"), "head_dim": pick(head_dim, "head_dim")}


__all__ = ["PrefixFileError", "TensorSpec", "SidePlan", "parse_table", "check_tensor_table", "cache_dims", "plan_side",
           "expected_tensors", "tail_bytes", "check_allocation", "template_meta", "dtype_name", "check_values", "known_dims", "layer_dtype",
           "SAFETENSORS_DTYPES", "LAYER_DTYPES", "TAIL_ALLOWANCE_BYTES"]
