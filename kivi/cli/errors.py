"""The CLI's user-facing error (its own module: `kivi.cli` and the modules of its subcommands and options
all need it)."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2. ``prog`` (e.g. ``"kivi eval ppl"``)
    names the command when the error comes from parsing the arguments."""

    def __init__(self, message: str, *, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog
