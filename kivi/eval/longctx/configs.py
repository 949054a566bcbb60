"""The configurations a long-context run compares, named on the command line: ``fp``, a preset name, a
quanto or hqq baseline (``quanto-int2``, ``hqq-int2``, ...) or a KiviConfig JSON file."""

from __future__ import annotations

from pathlib import Path

from ...config import PRESETS, KiviConfig
from ..caches import BASELINES, CacheSpec, baseline_unavailable_reason, check_spec


def resolve_config(name: str) -> tuple[str, CacheSpec]:
    """``(label, spec)`` of one ``--configs`` entry; ``ValueError`` (one line) for anything else, a
    missing/invalid JSON file, or a baseline whose package (optimum-quanto, hqq) is missing."""
    key = str(name).strip()
    if key.lower() in BASELINES:
        reason = baseline_unavailable_reason(key.lower())
        if reason:
            raise ValueError(f"{key!r}: {reason}")
        return key.lower(), check_spec(key.lower())
    if key in PRESETS:
        return key, KiviConfig.preset(key)
    path = Path(key).expanduser()
    if key.lower().endswith(".json") or path.exists():
        if not path.is_file():
            raise ValueError(f"{key!r}: no such KiviConfig JSON file")
        try:
            return path.stem, KiviConfig.from_json(path)
        except (ValueError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{key!r}: {first}") from None
    raise ValueError(f"{key!r} is not 'fp', a preset ({', '.join(PRESETS)}), a baseline "
                     f"({', '.join(b for b in BASELINES if b != 'fp')}) or a KiviConfig .json file")


__all__ = ["resolve_config"]
