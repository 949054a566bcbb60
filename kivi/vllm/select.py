"""The class vLLM gets for ``CPU_ATTN`` once the plugin is loaded: kivi's backend or vLLM's own.

:func:`kivi.vllm.register` points vLLM's ``CPU_ATTN`` entry at ``kivi.vllm.select.CPU_ATTN``. vLLM
resolves that path while it builds a model, with the engine's config current; this module's
``__getattr__`` answers with :class:`kivi.vllm.backend.KiviAttentionBackend` (bound to the config) when the config's
``additional_config`` has a ``"kivi"`` key and with vLLM's own ``CPUAttentionBackend`` otherwise, so a
run without ``"kivi"`` gets exactly vLLM's class. The one place the choice is made.
"""

from __future__ import annotations

from .config import kivi_config


def __getattr__(name: str):
    if name != "CPU_ATTN":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    kivi = None if config is None else kivi_config(config.additional_config)
    if kivi is not None:
        from .backend import backend_class

        return backend_class(kivi)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend
