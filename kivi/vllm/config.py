"""Reading the plugin's configuration from vLLM's ``additional_config``.

``LLM(..., additional_config={"kivi": {...}})`` or ``--additional-config '{"kivi": {...}}'``: the object
holds :class:`~kivi.config.KiviConfig` fields (``{"k_bits": 2, "v_bits": 2}``) or a preset with optional
overrides (``{"preset": "balanced", "residual_length": 64}``). Without a ``"kivi"`` key the plugin does
nothing. ``additional_config`` is part of vLLM's config hash, so compiled artefacts of a KIVI run and
a plain run never mix. Pure: no vLLM import (tested in the default environment).

``attention_backend`` says how pages are read: ``"auto"`` / ``"cpu"`` (kivi's numba kernel, vLLM on the CPU),
``"reference"`` (torch, the ground truth) or ``"triton"`` (kivi's Triton kernels: the opt-in GPU path, which
only a GPU platform's backend entries take, :mod:`kivi.vllm.select`).
"""

from __future__ import annotations

from typing import Any

from ..capabilities import host_reasons, reasons
from ..config import KiviConfig

CONFIG_KEY = "kivi"


def _unsupported(cfg: KiviConfig) -> str | None:
    """What of ``cfg`` the vLLM pages cannot hold or its backend cannot read (:mod:`kivi.capabilities`), as
    ``"field=value: why"``, or ``None``."""
    refusals = host_reasons(cfg, "vllm")
    if refusals:
        return f"{'; '.join(map(str, refusals))}: not supported by the vLLM plugin"
    if cfg.attention_backend == "triton":
        why = reasons(cfg, "vllm", "triton")
        if why:
            return (f"attention_backend='triton' (the GPU path) does not implement {why[0]}; the vLLM plugin reads "
                    "such pages with 'cpu' or 'reference', on vLLM's CPU platform")
    return None


def kivi_config(additional_config: Any) -> KiviConfig | None:
    """The :class:`KiviConfig` in ``additional_config["kivi"]``, or ``None`` when there is no ``"kivi"`` key.

    ``ValueError`` naming the field, its value and what is allowed on anything else.
    """
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    d = additional_config[CONFIG_KEY]
    if not isinstance(d, dict):
        raise ValueError(f'additional_config["kivi"] must be an object of KiviConfig fields or {{"preset": name}}, '
                         f"got {type(d).__name__} {d!r}")
    d = dict(d)
    preset = d.pop("preset", None)
    try:
        cfg = KiviConfig.from_dict(d) if preset is None else KiviConfig.preset(preset, **_checked_fields(d))
    except (TypeError, ValueError) as e:
        raise ValueError(f'additional_config["kivi"]: {e}') from None
    problem = _unsupported(cfg)
    if problem is not None:
        raise ValueError(f'additional_config["kivi"]: {problem}')
    return cfg


def _checked_fields(d: dict[str, Any]) -> dict[str, Any]:
    KiviConfig.from_dict(d)  # unknown names and bad values fail here, naming the field
    return d


__all__ = ["CONFIG_KEY", "kivi_config"]
