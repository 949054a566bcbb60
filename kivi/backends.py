"""Choosing how attention reads a KIVI cache (``KiviConfig.attention_backend``), once.

* ``"reference"`` — the cache dequantizes each layer's history and returns plain tensors; the
  model's own attention (SDPA) runs over them. Ground truth; slow at long context.
* ``"cpu"`` — attention reads the packed storage: decode steps (one query token) run the fused
  numba kernel (:mod:`kivi.attention.fused_cpu`) when the format qualifies, everything else the
  blocked torch path (:func:`kivi.attention.blocked.blocked_attention`, any torch device).
* ``"triton"`` — ``kivi.kernels.triton_attention`` (CUDA).
* ``"auto"`` — ``"reference"`` for models whose attention the packed paths do not implement
  (logit softcapping, e.g. Gemma2; attention sinks); else ``"triton"`` on a CUDA device when
  triton is installed and the config is one the kernel implements (asymmetric, no compensation;
  every code width, 3 bits included; sink tokens and any number of stored blocks are read in place); else ``"cpu"``.

The decision is made once: :func:`kivi.quantize_model` resolves it for the model (and switches the
model's attention to ``"kivi"`` unless it is ``"reference"``); :meth:`KiviCache.from_model` takes
that result, and the cache hands it to attention inside what ``update`` returns
(:class:`kivi.cache.view.PackedStates`). An explicitly requested backend that cannot run raises;
nothing falls back silently — and ``"cpu"`` without numba (decode at about a third of the speed)
is announced with a warning that says how to fix it.
"""

from __future__ import annotations

import warnings
from typing import Any

from .capabilities import FEATURES, REFUSED, kernel_reasons, model_attention_unsupported, reasons, stored_formats
from .config import ATTENTION_BACKENDS
from .optional import numba_problem, triton_available

#: Name of the attention implementation kivi registers with transformers (kivi.attention.interface).
ATTN_IMPLEMENTATION = "kivi"


def numba_missing_message(problem: str) -> str:
    """The warning of a ``"cpu"`` backend that cannot run its numba kernel: ``problem`` (from
    :func:`kivi.optional.numba_problem`) and its fix."""
    if problem == "numba is not installed":
        fix = "pip install 'numba>=0.60'"
    elif "NUMBA_DISABLE_JIT" in problem:
        fix = "unset NUMBA_DISABLE_JIT"
    else:
        fix = "what numba's error says (its installation or its NUMBA_* environment variables)"
    return (f"kivi: {problem}, so the 'cpu' attention backend decodes through the blocked torch path (about 3x "
            f"slower than the fused numba kernel at 8K tokens on SmolLM2). Fix: {fix}")


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    return getattr(device, "type", None) or str(device).split(":")[0]


#: How an explicit request's error words each kind of reason (:attr:`kivi.capabilities.Reason.kind`), in this order.
_WORDING = {"model": "cannot run this model: {}; use 'reference'", "machine": "{}",
            "config": "does not implement {}; use {}", "format": "does not implement {}; use {}"}


def _alternatives(feature: str, backend: str) -> str:
    """The other backends of the ``"generate"`` host that take ``feature`` (its row of the table), worded."""
    ok = [b for b in ("cpu", "reference") if b != backend and FEATURES[feature].cells["generate", b] != REFUSED]
    return " or ".join(repr(b) for b in ok)


class Backend:
    """How attention reads a KIVI cache; one object per cache, resolved once (:func:`resolve_backend`).

    ``name``: what users pass as ``attention_backend``; ``packed``: attention reads the packed storage
    (the cache returns :class:`~kivi.cache.view.PackedStates`; the model runs the ``"kivi"`` attention);
    ``config``: the :class:`~kivi.config.KiviConfig` of the cache it was resolved for (``None``: not known,
    e.g. a backend named for one call). :meth:`supports` lists every reason it cannot run (empty: it can).
    The attention each backend computes lives in the attention layer
    (:func:`kivi.attention.interface.run_backend`, one function per backend class).
    """

    name: str = ""
    packed: bool = False

    def __init__(self, config: Any = None):
        self.config = config

    def supports(self, *, device: Any = None, config: Any = None, model_config: Any = None) -> list[str]:
        """Every reason this backend cannot read caches of ``config`` for ``model_config`` on ``device``,
        each a clause that follows ``attention_backend='<name>'`` in an error; empty when it can. ``None``
        arguments are not checked. The reasons are the refused cells of :data:`kivi.capabilities.TABLE`."""
        facts = {"triton": triton_available()} if self.name == "triton" else {}
        why = reasons(config, "generate", self.name, REFUSED, model_config=model_config, device=_device_type(device),
                      **facts)
        why.sort(key=lambda r: list(_WORDING).index(r.kind))
        return [_WORDING[r.kind].format(r.detail, _alternatives(r.feature, self.name)) if r.kind in ("config", "format")
                else _WORDING[r.kind].format(r.detail) for r in why]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __reduce__(self):  # pickle / deepcopy: the same backend for the same config
        return (type(self), (self.config,))


class ReferenceBackend(Backend):
    """``"reference"``: the cache dequantizes a layer's history; ground truth, any model, any device."""

    name = "reference"


class CpuBackend(Backend):
    """``"cpu"``: the fused numba decode kernel for one query token when the call qualifies, else the
    blocked torch path (any torch device). Without numba it runs (blocked), announced by a warning.

    The format part of "does a call qualify" is decided here once for the cache's config
    (:attr:`kernel_reads_layouts`): a cache whose every layer stores a format the kernel reads skips
    that scan at every decode step; only the query and mask are checked per call.
    """

    name = "cpu"
    packed = True

    def __init__(self, config: Any = None):
        super().__init__(config)
        #: True: every layer of a cache of ``config`` stores formats the fused kernel reads; False: some
        #: layer does not (each call's views are checked); None: config unknown (each call checked).
        self.kernel_reads_layouts: bool | None = (
            None if config is None else not kernel_reasons(config, "generate", "cpu")
        )


class TritonBackend(Backend):
    """``"triton"``: :mod:`kivi.kernels` on a CUDA device; asymmetric codes without compensation, every
    width, sink tokens and any number of stored blocks read in place. Position tiers are read by the
    blocked path (one width per side in the kernel), chosen explicitly in the attention layer."""

    name = "triton"
    packed = True


#: One backend class per ``attention_backend`` name (``"auto"`` resolves to one of them).
BACKEND_CLASSES: dict[str, type[Backend]] = {b.name: b for b in (ReferenceBackend, CpuBackend, TritonBackend)}

#: Backends that make attention read the packed cache (the model then runs ``"kivi"`` attention).
PACKED_BACKENDS = tuple(name for name, cls in BACKEND_CLASSES.items() if cls.packed)


def backend_named(name: str | Backend, config: Any = None) -> Backend:
    """The backend called ``name`` for caches of ``config``, unchecked (for a name already resolved); a
    :class:`Backend` is returned as it is."""
    if isinstance(name, Backend):
        return name
    try:
        return BACKEND_CLASSES[name](config)
    except (KeyError, TypeError):
        raise ValueError(f"attention backend {name!r} is not resolved; expected one of "
                         f"{list(BACKEND_CLASSES)}") from None


def resolve_backend(requested: str, device: Any = None, *, config: Any = None, model_config: Any = None) -> Backend:
    """The backend for ``requested`` (one of ``ATTENTION_BACKENDS``) on ``device``; raise if it cannot run.

    ``device=None`` (unknown) resolves ``"auto"`` to ``"cpu"``, the pure-torch path that runs on
    any device. ``config`` (KiviConfig) and ``model_config`` narrow what can run (see module doc); the
    error of an explicit request names every reason (:meth:`Backend.supports`).
    """
    if isinstance(requested, bool) or requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={requested!r} is not allowed; choose one of {list(ATTENTION_BACKENDS)}")
    dev = _device_type(device)
    if requested == "auto":
        if reasons(config, "generate", "cpu", REFUSED, model_config=model_config):  # what no packed path reads
            return ReferenceBackend(config)
        if dev == "cuda" and not TritonBackend().supports(device=device, config=config, model_config=model_config):
            return TritonBackend(config)
        requested = "cpu"
    backend = BACKEND_CLASSES[requested](config)
    why = backend.supports(device=device, config=config, model_config=model_config)
    if why:
        missing = any(r.kind == "machine" for r in reasons(None, "generate", requested, REFUSED, device=dev,
                                                             triton=triton_available()))
        error = RuntimeError if missing else ValueError
        raise error(f"attention_backend={requested!r} " + "; and ".join(why))
    problem = numba_problem() if requested == "cpu" and dev in (None, "cpu") else None
    if problem:
        warnings.warn(numba_missing_message(problem), RuntimeWarning, stacklevel=2)
    return backend


def resolve_attention_backend(requested: str, device: Any = None, *, config: Any = None,
                              model_config: Any = None) -> str:
    """The name of :func:`resolve_backend`'s result (``"reference"``, ``"cpu"`` or ``"triton"``)."""
    return resolve_backend(requested, device, config=config, model_config=model_config).name


def cache_attention_backend(model: Any, config: Any) -> Backend:
    """The backend a cache built for ``model`` and ``config`` gives attention.

    The one :func:`kivi.quantize_model` resolved, when ``config`` is the model's own KIVI config;
    otherwise resolved now. A model whose attention implementation is not ``"kivi"`` reads
    dequantized tensors (``"reference"``), and an explicit packed backend for it raises: its
    attention could not read packed states.
    """
    runs_kivi = getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION
    if config is getattr(model, "kivi_config", None) and getattr(model, "kivi_attention_backend", None):
        backend = backend_named(model.kivi_attention_backend, config)
    else:
        backend = resolve_backend(config.attention_backend, getattr(model, "device", None), config=config,
                                  model_config=model.config)
    if backend.packed and not runs_kivi:
        if config.attention_backend != "auto":
            raise ValueError(
                f"attention_backend={config.attention_backend!r} needs the model's attention to read the packed "
                f"cache, but it runs {model.config._attn_implementation!r}: "
                "call kivi.quantize_model(model, config) first"
            )
        return ReferenceBackend(config)
    return backend


def attention_reads_views(model: Any, *, reading_views: bool = False) -> bool:
    """Whether the attention that reads a cache built now for ``model`` reads kivi's views
    (:class:`~kivi.cache.view.PackedStates`), which can give each query of a forward its own precision.

    True when the model runs the ``"kivi"`` attention now (after :func:`kivi.quantize_model`), or when
    ``reading_views`` (the caller runs every forward under :func:`kivi.attention.interface.reading_views`)
    and ``"kivi"`` implements the model's attention; False for any other attention (it reads tensors only).
    """
    config = getattr(model, "config", None)
    if model_attention_unsupported(config) is not None:
        return False
    return reading_views or getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


__all__ = [
    "ATTN_IMPLEMENTATION",
    "PACKED_BACKENDS",
    "BACKEND_CLASSES",
    "Backend",
    "ReferenceBackend",
    "CpuBackend",
    "TritonBackend",
    "backend_named",
    "resolve_backend",
    "resolve_attention_backend",
    "numba_missing_message",
    "cache_attention_backend",
    "attention_reads_views",
    "model_attention_unsupported",
    "stored_formats",
]
