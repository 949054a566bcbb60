"""KIVI pages in vLLM: a plugin that stores each attention layer's KV cache as KIVI pages (docs/vllm.md).

Turned on per engine with ``LLM(..., additional_config={"kivi": {"k_bits": 2, "v_bits": 2}})`` (or
``{"preset": "balanced"}``; ``--additional-config`` for the server). vLLM calls :func:`register` in every
process through the ``vllm.general_plugins`` entry point; without a ``"kivi"`` key vLLM runs untouched.

Modules: ``version`` (the one vLLM release the plugin is tested with), ``config`` (reading
``additional_config``), ``select`` / ``backend`` / ``spec`` (the vLLM classes; imported by vLLM only),
``prefill`` / ``triton_prefill`` (a step's exact prefills through vLLM's own CPU / Triton attention kernels)
and ``scratch`` (their scratch pages). The page format and the step are the paged core's (:mod:`kivi.paged`,
shared with transformers' continuous batching). Nothing here imports :mod:`kivi.batching` (it pins a
transformers release vLLM's pins exclude).
"""

from __future__ import annotations


def register() -> None:
    """vLLM's general-plugin entry point: refuse an untested vLLM (one line), then point vLLM's attention backend
    entries at :mod:`kivi.vllm.select`, which answers with vLLM's own classes unless ``"kivi"`` is configured
    (then kivi's backend for ``CPU_ATTN`` and a one-line refusal for any other: no silent float cache), and
    register the KIVI page group's spec (:mod:`kivi.vllm.spec`: its blocks are never a prefix hit)."""
    from .version import check_vllm_version

    check_vllm_version()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .select import route

    route(AttentionBackendEnum)
    from .spec import register_spec

    register_spec()


__all__ = ["register"]
