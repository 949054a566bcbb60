"""scripts/setup.sh (the README's set-up) installs the transformers release kivi's continuous batching is tested
with: a fresh machine would otherwise get the newest 5.x, which the batching refuses (and `kivi serve` with it)."""

from __future__ import annotations

import re
from pathlib import Path

from kivi.batching.version import TESTED_TRANSFORMERS

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def test_setup_installs_the_tested_transformers():
    text = SETUP.read_text()
    m = re.search(r"^TRANSFORMERS_SPEC=\$\{KIVI_TRANSFORMERS:-(transformers~=(\d+)\.(\d+)\.0)\}$", text, re.M)
    assert m, "setup.sh must set TRANSFORMERS_SPEC=${KIVI_TRANSFORMERS:-transformers~=X.Y.0}"
    assert (int(m[2]), int(m[3])) == TESTED_TRANSFORMERS[-1], (m[1], TESTED_TRANSFORMERS)
    assert "pip install --quiet -e '.[all]' \"$TRANSFORMERS_SPEC\"" in text, "installed with kivi, in one resolve"
    assert "$TRANSFORMERS_SPEC\"" in text.split("want=", 1)[1].split("\n", 1)[0], "a changed spec must re-run setup"
