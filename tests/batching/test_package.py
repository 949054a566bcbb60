"""kivi.batching's docstring names its modules: every module of the package, and no other name."""

from __future__ import annotations

import re
from pathlib import Path

import kivi.batching


def test_docstring_lists_the_real_modules():
    listed = kivi.batching.__doc__.split("Modules:", 1)[1]
    named = set(re.findall(r"``(\w+)``\s+\(", listed))
    modules = {p.stem for p in Path(kivi.batching.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert named == modules, f"listed, no module: {sorted(named - modules)}; not listed: {sorted(modules - named)}"
