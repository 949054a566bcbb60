"""The `kivi` command line. Each subcommand lives in its own module and registers itself here.

Conventions (every subcommand):
* bad user input raises :class:`CliError` (or ``ValueError``) -> one clear line on stderr, exit 2;
* ``--json`` prints one JSON object on stdout instead of tables (progress goes to stderr);
* ``KIVI_DEBUG=1`` shows full tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# module name -> registers one or more subcommands via `register(subparsers)`
SUBCOMMAND_MODULES = ("estimate", "generate", "demo", "evaluate", "tune", "serve")


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kivi",
        description="KIVI 2-bit KV-cache quantization for HuggingFace models: plan memory, generate, "
        "evaluate and tune. Run `kivi demo` to see it on the embedded SmolLM2-135M.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"kivi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


#: Commands that run short and time decoding side by side (FP vs KIVI): they keep glibc's default
#: allocator behaviour. Pinning the mmap threshold turns every large temporary into a fresh mapping;
#: measured at 2K tokens, that slowed DynamicCache decoding by ~35% (a torch.cat of the cache per
#: layer and step) and left KIVI's unchanged — an unfair baseline in the demo's speed column.
UNPINNED_COMMANDS = ("demo", "generate", "estimate")


def main(argv: list[str] | None = None) -> int:
    from ..allocator import reduce_fragmentation

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command not in UNPINNED_COMMANDS:
        reduce_fragmentation()  # long CPU runs: keep RSS close to what the caches really hold
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below, not at interpreter exit
        return int(rc or 0)
    except BrokenPipeError:
        # `kivi ... | head`: the reader left. Not an error of ours; exit quietly like other Unix tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail again
        return 141  # 128 + SIGPIPE
    except Exception as e:  # noqa: BLE001 - user-facing errors become one line, others re-raise
        user_error = isinstance(e, (CliError, ValueError, OSError)) or getattr(e, "user_facing", False)
        if not user_error or os.environ.get("KIVI_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"kivi {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
