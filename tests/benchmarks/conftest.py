"""The benchmark scripts import their shared helper as ``common`` (the folder a script runs from is on
``sys.path``); the tests that import the scripts put that folder there too."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
