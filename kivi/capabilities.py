"""What each attention backend of each host does with a config: one table, read by every refusal and kernel choice.

A *host* is what drives the cache: ``"generate"`` (kivi's own :class:`~kivi.cache.KiviCache`, any transformers
forward), ``"batching"`` (KIVI pages in transformers' continuous batching, :mod:`kivi.batching`) or ``"vllm"``
(KIVI pages behind vLLM, :mod:`kivi.vllm`). A *backend* is ``KiviConfig.attention_backend`` as resolved
(``"reference"``, ``"cpu"``, ``"triton"``; :mod:`kivi.backends`). :data:`TABLE` gives, for every feature a cache
can have (a config setting, a stored format, the model's attention, the machine), one outcome per host and backend:

* ``ok`` — read by the backend's kernel (or, for ``"reference"``, by the reference);
* ``refused`` — the config is refused when the cache is made (``ValueError`` naming the setting);
* ``torch`` — accepted; the backend's decode kernel declines it, its torch path reads it (the blocked path for
  ``"generate"``, request by request for pages);
* ``writes`` — accepted and decoded by the kernel; the compiled page writes (:mod:`kivi.paged.write`) decline it,
  the torch writes store it.

:func:`reasons` lists the features of a config (and of the facts a caller knows: the model, numba, the device,
dtypes) whose cell is one outcome; each caller words its error or picks its path from that list. Facts left
``None`` are not checked. No kernel and no optional dependency is imported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .quant.primitives import SUPPORTED_BITS
from .quant.side_format import SIDES, VALUE_AXIS, SideFormat

HOSTS = ("generate", "batching", "vllm")
BACKENDS = ("reference", "cpu", "triton")
OK, REFUSED, TORCH, WRITES = "ok", "refused", "torch", "writes"
_CODES = {".": OK, "R": REFUSED, "T": TORCH, "W": WRITES}

#: Code widths the numba decode kernels read (single sequence and paged).
KERNEL_BITS = SUPPORTED_BITS
#: Code widths the Triton page writes pack (whole codes per byte).
WORD_BITS = tuple(b for b in SUPPORTED_BITS if 8 % b == 0)
#: dtypes of the pages' scales / offsets the paged decode kernels read.
PAGE_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: dtypes of the pages' parameters and of the window rings the compiled (numba) page writes read.
WRITE_DTYPES = (torch.float32, torch.bfloat16)

@dataclass(frozen=True)
class Facts:
    """What a caller knows besides the config; ``None``: not known, not checked.

    ``model_config``: the model's (its attention); ``numba``: :func:`kivi.optional.numba_problem`'s answer
    (``""``: numba runs); ``triton``: whether triton imports; ``device``: where the cache / model lives
    (``"cpu"``, ``"cuda"``); ``param_dtype``: the pages' scales / offsets dtype; ``row_dtype``: the window rings'
    dtype; ``sliding``: the layer has a sliding window."""

    model_config: Any = None
    numba: str | None = None
    triton: bool | None = None
    device: str | None = None
    param_dtype: Any = None
    row_dtype: Any = None
    sliding: bool | None = None


@dataclass(frozen=True)
class Feature:
    """One row of :data:`TABLE`: ``kind`` (``"config"``, ``"format"``, ``"model"`` or ``"machine"``), the
    detector (a config's, a stored format's or the facts' details, each a clause naming the value), and the
    outcome of every ``(host, backend)``."""

    name: str
    kind: str
    detect: Callable[..., list[str]]
    cells: dict[tuple[str, str], str]


@dataclass(frozen=True)
class Reason:
    """A feature found in a config: ``feature`` (its row), ``kind``, ``detail`` (the clause) and ``everywhere``
    (its host refuses it on every backend: a host limit rather than a backend's)."""

    feature: str
    kind: str
    detail: str
    everywhere: bool = False

    def __str__(self) -> str:
        return self.detail


def _grid(cells: str) -> dict[tuple[str, str], str]:
    codes = cells.split()
    if len(codes) != len(HOSTS) * len(BACKENDS):
        raise ValueError(f"a row needs {len(HOSTS) * len(BACKENDS)} cells, got {cells!r}")
    it = iter(codes)
    return {(h, b): _CODES[next(it)] for h in HOSTS for b in BACKENDS}


def _levels(cfg) -> list[tuple[str, Any, set[str]]]:
    """``(where, config of that level, the fields that level sets)``: the config, then each layer override."""
    out = [("", cfg, set(vars(cfg)))]
    for i in sorted(cfg.layer_specific_config):
        out.append((f"layer_specific_config[{i}].", cfg.for_layer(i), set(cfg.layer_specific_config[i])))
    return out


def _head_bits(cfg) -> list[str]:
    return ["head_bits: per-head widths (a page holds one width per side)"] if cfg.head_bits else []


def _unquantized(cfg) -> list[str]:
    return [f"{w}quantize_key={c.quantize_key}, quantize_value={c.quantize_value}: pages hold quantized keys and "
            "values only" for w, c, sets in _levels(cfg)
            if sets & {"quantize_key", "quantize_value"} and not (c.quantize_key and c.quantize_value)]


def _tiers(cfg) -> list[str]:
    return [f"{w}tiers={[list(t) for t in c.tiers]}: position tiers (a page holds one width per side)"
            for w, c, sets in _levels(cfg) if "tiers" in sets and c.tiers]


def _quantize_after(cfg) -> list[str]:
    return [f"{w}quantize_after={c.quantize_after}: full precision before quantizing (a request's full-precision "
            "rows are sized for the window; use 0)" for w, c, sets in _levels(cfg)
            if "quantize_after" in sets and c.quantize_after]


def _rotated(cfg) -> list[str]:
    return [f"{w}key_rotation={c.key_rotation!r}: rotated keys (the kernels and pages read codes in the keys' own "
            "basis; only the reference rotates them back)" for w, c, sets in _levels(cfg)
            if "key_rotation" in sets and c.key_rotation != "none"]


def _per_layer(cfg) -> list[str]:
    return ["layer_specific_config: per-layer settings"] if cfg.layer_specific_config else []


def _one(clause: str, test: Callable[[SideFormat], bool]) -> Callable[[SideFormat], list[str]]:
    return lambda f: [clause] if test(f) else []


def _model(facts: Facts) -> list[str]:
    why = model_attention_unsupported(facts.model_config)
    return [why] if why else []


def _no_numba(facts: Facts) -> list[str]:
    return [facts.numba] if facts.numba else []


def _no_triton(facts: Facts) -> list[str]:
    return ["is not available: the 'triton' package is not installed (pip install 'kivi[triton]')"] \
        if facts.triton is False else []


def _not_cuda(facts: Facts) -> list[str]:
    return [f"needs a CUDA device; the model is on {facts.device!r}"] \
        if facts.device is not None and facts.device != "cuda" else []


def _not_cpu(facts: Facts) -> list[str]:
    return [f"pages on {facts.device!r} (the numba kernels read CPU memory)"] \
        if facts.device is not None and facts.device != "cpu" else []


def _param_dtype(facts: Facts) -> list[str]:
    d = facts.param_dtype
    return [f"scales in {d} (the kernel reads {sorted(map(str, PAGE_PARAM_DTYPES))})"] \
        if d is not None and d not in PAGE_PARAM_DTYPES else []


def _write_dtypes(facts: Facts) -> list[str]:
    return [f"{what} in {d} (the compiled writes read {sorted(map(str, WRITE_DTYPES))})"
            for what, d in (("scales", facts.param_dtype), ("window rows", facts.row_dtype))
            if d is not None and d not in WRITE_DTYPES]


def _sliding(facts: Facts) -> list[str]:
    return ["a sliding-window layer (its window is applied per request)"] if facts.sliding else []


#: The table: one row per feature, one cell per host and backend (``.`` ok, ``R`` refused, ``T`` torch decode,
#: ``W`` torch writes; see the module docstring). Both paged hosts run the same step (:mod:`kivi.paged`): their
#: kernel and write cells agree (``tests/test_capabilities.py``); they differ where a host refuses a feature on every
#: backend, and batching refuses ``"triton"`` without triton where the plugin (GPU vLLM ships it) decodes in torch.
_CELLS = {  #                generate      batching      vllm
    #                        ref cpu tri   ref cpu tri   ref cpu tri
    "head_bits":             " .   .   .     R   R   R     R   R   R",
    "unquantized_side":      " .   .   .     R   R   R     R   R   R",
    "tiers":                 " .   .   T     R   R   R     R   R   R",
    "quantize_after":        " .   .   .     R   R   R     R   R   R",
    "layer_specific_config": " .   .   .     .   .   .     R   R   R",
    "key_rotation":          " .   R   R     R   R   R     R   R   R",
    "symmetric":             " .   .   R     .   W   R     .   W   R",
    "compensation":          " .   .   R     .   T   R     .   T   R",
    "code_width":            " .   T   .     .   T   T     .   T   T",
    "odd_code_width":        " .   .   .     .   .   W     .   .   W",
    "value_groups":          " .   T   .     .   T   T     .   T   T",
    "clip":                  " .   .   .     .   .   W     .   .   W",
    "unchecked":             " .   .   .     .   W   W     .   W   W",
    "model_attention":       " .   R   R     R   R   R     .   .   .",
    "no_numba":              " .   T   .     .   T   .     .   T   .",
    "no_triton":             " .   .   R     .   .   R     .   .   T",
    "not_cuda":              " .   .   R     .   .   .     .   .   .",
    "not_cpu":               " .   T   .     .   T   .     .   T   .",
    "param_dtype":           " .   .   .     .   T   T     .   T   T",
    "write_dtypes":          " .   .   .     .   W   .     .   W   .",
    "sliding_window":        " .   .   .     .   T   T     .   .   .",
}
#: How each feature is found: its kind (what it reads: the config, each stored format, the model, the machine) and
#: its detector (the details found, each a clause naming the value).
_DETECT: dict[str, tuple[str, Callable[..., list[str]]]] = {
    "head_bits": ("config", _head_bits),
    "unquantized_side": ("config", _unquantized),
    "tiers": ("config", _tiers),
    "quantize_after": ("config", _quantize_after),
    "layer_specific_config": ("config", _per_layer),
    "key_rotation": ("config", _rotated),
    "symmetric": ("format", _one("symmetric quantization", lambda f: f.symmetric)),
    "compensation": ("format", _one("error compensation (residual_bits > 0)", lambda f: f.residual_bits > 0)),
    "code_width": ("format", lambda f: [] if f.bits in KERNEL_BITS else
                   [f"{f.bits}-bit codes (the kernel reads {list(KERNEL_BITS)})"]),
    "odd_code_width": ("format", lambda f: [] if f.bits in WORD_BITS else
                       [f"{f.bits}-bit codes (the Triton page writes pack {list(WORD_BITS)})"]),
    "value_groups": ("format", lambda f: [f"value groups of {f.group_size} channels (the kernel reads 4 channels at "
                                          "a time)"] if f.axis == VALUE_AXIS and f.group_size % 4 else []),
    "clip": ("format", _one("clipped ranges (clip=True)", lambda f: f.clip)),
    "unchecked": ("format", _one("unchecked values (check_finite=False)", lambda f: not f.check_finite)),
    "model_attention": ("model", _model),
    "no_numba": ("machine", _no_numba),
    "no_triton": ("machine", _no_triton),
    "not_cuda": ("machine", _not_cuda),
    "not_cpu": ("machine", _not_cpu),
    "param_dtype": ("machine", _param_dtype),
    "write_dtypes": ("machine", _write_dtypes),
    "sliding_window": ("machine", _sliding),
}
TABLE: tuple[Feature, ...] = tuple(Feature(name, *_DETECT[name], _grid(cells)) for name, cells in _CELLS.items())
FEATURES: dict[str, Feature] = {f.name: f for f in TABLE}


def model_attention_unsupported(model_config: Any) -> str | None:
    """Why the packed paths ("cpu", "triton") cannot run this model's attention, or ``None``."""
    if model_config is None:
        return None
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "its attention uses logit softcapping (attn_logit_softcapping)"
    if getattr(text, "use_sinks", False) or getattr(text, "sinks", None) is not None:
        return "its attention uses attention sinks"
    return None


def stored_formats(config: Any) -> list[SideFormat]:
    """Every quantized format a cache of ``config`` stores, without repeats: each side of the config and of
    each layer it overrides (``layer_specific_config``) or splits by head (``head_bits``), at every width
    its tokens take (the layer's, each position tier's, each head's)."""
    layers = sorted(set(config.layer_specific_config) | set(config.head_bits))
    out: list[SideFormat] = []
    for idx, c in [(None, config)] + [(i, config.for_layer(i)) for i in layers]:
        heads = config.layer_head_bits(idx) if idx is not None else None
        for j, (side, quant) in enumerate(zip(SIDES, (c.quantize_key, c.quantize_value))):
            if not quant:
                continue
            fmt = c.side_format(side)
            widths = {fmt.bits} | {w[j] for _, w in (c.tiers or ())[1:]} | set(heads[j] if heads else ())
            out += [f for f in (dataclasses.replace(fmt, bits=b) for b in sorted(widths)) if f not in out]
    return out


def _check(host: str, backend: str) -> None:
    if host not in HOSTS or backend not in BACKENDS:
        raise ValueError(f"host={host!r}, backend={backend!r}: expected a host of {list(HOSTS)} and a backend of "
                         f"{list(BACKENDS)}")


def _found(feature: Feature, config: Any, formats: list[SideFormat], facts: Facts) -> list[str]:
    if feature.kind == "config":
        return feature.detect(config) if config is not None else []
    if feature.kind == "format":
        out: list[str] = []
        for f in formats:
            out += [d for d in feature.detect(f) if d not in out]
        return out
    return feature.detect(facts)


def reasons(config: Any, host: str, backend: str, outcome: str = REFUSED, *, formats: list[SideFormat] | None = None,
            **facts: Any) -> list[Reason]:
    """Every feature of ``config`` (a KiviConfig, or ``None``: only ``formats`` and the facts) whose cell for
    ``host`` and ``backend`` in :data:`TABLE` is ``outcome``, in table order; empty: none. ``formats``: the
    stored formats to check (default: :func:`stored_formats` of ``config``). ``facts``: :class:`Facts` fields.

    ``outcome=TORCH`` gives ``"reference"`` a reason (it runs no kernel)."""
    _check(host, backend)
    if outcome not in _CODES.values():
        raise ValueError(f"outcome={outcome!r}: expected one of {list(_CODES.values())}")
    known = Facts(**facts)
    if formats is None:
        formats = stored_formats(config) if config is not None else []
    out: list[Reason] = []
    if outcome == TORCH and backend == "reference":
        out.append(Reason("backend", "backend", "the reference runs no kernel"))
    for feature in TABLE:
        if feature.cells[host, backend] != outcome:
            continue
        everywhere = all(feature.cells[host, b] == REFUSED for b in BACKENDS)
        out += [Reason(feature.name, feature.kind, d, everywhere)
                for d in _found(feature, config, formats, known)]
    return out


def host_reasons(config: Any, host: str) -> list[Reason]:
    """The features of ``config`` that ``host`` refuses on every backend (its own limits: what KIVI pages hold,
    what the vLLM plugin takes); empty: none."""
    return [r for r in reasons(config, host, BACKENDS[0]) if r.everywhere]


def kernel_reasons(config: Any, host: str, backend: str, **kw: Any) -> list[Reason]:
    """Why ``backend``'s decode kernel on ``host`` does not read caches of ``config`` (its torch path does); empty:
    it reads them. Takes :func:`reasons`' keywords."""
    return reasons(config, host, backend, TORCH, **kw)


__all__ = ["HOSTS", "BACKENDS", "OK", "REFUSED", "TORCH", "WRITES", "TABLE", "FEATURES",
           "KERNEL_BITS", "WORD_BITS", "PAGE_PARAM_DTYPES", "WRITE_DTYPES", "Facts", "Feature", "Reason", "reasons",
           "host_reasons", "kernel_reasons", "stored_formats", "model_attention_unsupported"]
