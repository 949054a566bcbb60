"""What the benchmark scripts share: thread setup, rows in a fresh process, timing, JSON output, machine facts.

The scripts import it as ``common`` (``python benchmarks/NAME.py`` puts this folder on ``sys.path``;
``tests/benchmarks/conftest.py`` does the same for the tests).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]


def set_threads(threads: int, entries: tuple[str, ...] | None = None) -> float | None:
    """Load kivi's numba kernels (the entry points ``entries``, e.g. ``SINGLE_SEQUENCE`` of
    :mod:`kivi.attention.fused_cpu`; ``None``: all), then give torch and numba ``threads`` threads (0: keep their
    defaults).

    The order matters: loading the kernels can reset torch's thread count to numba's
    (``kivi.cli.threads.set_cpu_threads``), so the count is set after the load, and the load itself
    stays out of every timed region. Returns the seconds the load (or compilation) took, None without numba.
    """
    from kivi.attention.fused_cpu import fused_decode_available, warmup
    from kivi.cli.threads import set_cpu_threads

    seconds = warmup(entries) if fused_decode_available() else None
    if threads:
        set_cpu_threads(threads)
    return seconds


class Fresh(NamedTuple):
    """What a child process left: its exit status, the JSON object it printed last (or None), its stderr's tail."""

    returncode: int
    result: dict | None
    stderr: str


def run_fresh(args: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
              timeout: float | None = None) -> Fresh:
    """Run ``python ARGS`` in a fresh interpreter (no allocator state or caches left over from other rows).

    The repository root goes first on the child's ``PYTHONPATH`` so that it imports this checkout's kivi.
    The child reports by printing one JSON object on a line of its own; the last such line is returned.
    """
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    p = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=full_env, cwd=cwd,
                       timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    return Fresh(p.returncode, result, p.stderr[-3000:])


def time_calls(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn`` (wall clock), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def proc_status_bytes(field: str) -> int | None:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``) in bytes; None where missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment() -> dict[str, Any]:
    """Versions and the machine, recorded beside every result."""
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def write_json(path: str | Path, obj: Any, *, indent: int = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` (parent folders created), ending with a newline."""
    return write_text_file(path, json.dumps(obj, indent=indent, default=str) + "\n")


def write_text_file(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through kivi's one writer (``kivi.files.write_text``: atomic, refuses a device,
    FIFO or folder at ``path``); unlike kivi's command line, a benchmark creates the parent folders."""
    from kivi.files import write_text

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_text(p, text)
    return p


def command_line() -> str:
    """How this script was run, to store beside its result."""
    import shlex

    return shlex.join(["python", *sys.argv])
