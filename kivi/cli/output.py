"""How subcommands print and write their results: JSON or rich tables on stdout, files written so
that a failed write never drops a computed result."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from ..files import write_text
from .errors import CliError


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def print_rich(renderable: Any, *, width: int = 120) -> None:
    """Print a rich renderable through ``sys.stdout``: rich writing to a closed pipe itself would
    exit 1 on its own (``Console.on_broken_pipe``); captured, a broken pipe reaches
    :func:`kivi.cli.main` like any other write (exit 141)."""
    from rich.console import Console

    console = Console(width=max(width, Console().width), file=sys.stdout)
    with console.capture() as cap:
        console.print(renderable)
    sys.stdout.write(cap.get())


def write_json_file(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")  # the one writer (kivi.files)


Write = tuple[str, str, Callable[[str], Any]]  # (flag, path, writer(path))


def write_outputs(writes: list[Write]) -> list[str]:
    """Run each ``(flag, path, writer)``; returns one message per write that failed (never raises on OSError)."""
    failed = []
    for flag, path, writer in writes:
        if not path:
            continue
        try:
            writer(path)
        except OSError as e:
            failed.append(f"cannot write {flag} {path!r}: {e.strerror or e}")
    return failed


def emit(args: argparse.Namespace, result: Any, human: str, writes: list[Write] | None = None) -> None:
    """Write ``result`` to ``--output`` (when given) and the ``writes``, then print it as JSON
    (``--json``) or ``human``, followed by a ``wrote PATH`` line per file written. A write that fails
    does not drop the result: it is printed (as JSON too when it was shown as text), then one error
    line names what could not be written (exit 2)."""
    all_writes = [("-o/--output", getattr(args, "output", None), lambda p: write_json_file(p, result))]
    all_writes += list(writes or [])
    failed = write_outputs(all_writes)
    if getattr(args, "json", False):
        print_json(result)
    else:
        print(human)
        for _flag, path, _ in writes or []:
            if path and not any(repr(path) in f for f in failed):
                print(f"wrote {path}")
        if failed:
            print_json(result)
    if failed:
        raise CliError("; ".join(failed) + " — the result was printed on stdout instead")


__all__ = ["Write", "emit", "print_json", "print_rich", "write_json_file", "write_outputs"]
