"""The `kivi` command line. Each subcommand lives in its own module and registers itself here.

Conventions (every subcommand):
* bad user input raises :class:`CliError` (or ``ValueError``) -> one clear line on stderr, exit 2;
  arguments are checked by the validators of :mod:`kivi.cli.validators` before any model loads;
* ``--json`` prints one JSON object on stdout instead of tables (progress goes to stderr);
* files the command writes are checked before the work starts; a write that still fails at the end
  prints the result on stdout and the error on stderr (exit 2): a computed result is never dropped;
* Ctrl-C at any time (the imports included) -> one line, exit 130;
* a closed pipe on stdout (``kivi ... | head``) -> quiet, exit 141 (see :func:`main`);
* ``KIVI_DEBUG=1`` shows full tracebacks.
"""

from __future__ import annotations

import os
import sys

from .errors import CliError

#: Subcommand modules (``kivi.cli.<name>``), each with ``register(subparsers)`` adding its
#: subcommand(s). One line per module: a new subcommand is a new line here.
SUBCOMMAND_MODULES = (
    "estimate",  # estimate
    "generate",  # generate
    "demo",  # demo
    "evaluate",  # eval ppl|kld|passkey, sweep
    "tune",  # profile, tune
    "model_cache",  # cache ls|verify|clear (the converted-model cache)
    "serve",  # serve (OpenAI-compatible HTTP server)
)


#: Exit status of a process killed by SIGPIPE, as a shell reports it (128 + 13).
EXIT_BROKEN_PIPE = 141
#: Exit status of a process stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


def build_parser():
    import importlib

    from .. import __version__
    from .options import KiviArgumentParser

    parser = KiviArgumentParser(
        prog="kivi",
        description="KIVI 2-bit KV-cache quantization for HuggingFace models: plan memory, generate, "
        "evaluate and tune. Run `kivi demo` to see it on the embedded SmolLM2-135M.",
    )
    parser.add_argument("--version", action="version", version=f"kivi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


#: Commands that run short and time decoding side by side (FP vs KIVI): they keep glibc's default
#: allocator behaviour. Pinning the mmap threshold turns every large temporary into a fresh mapping;
#: measured at 2K tokens, that slowed DynamicCache decoding by ~35% (a torch.cat of the cache per
#: layer and step) and left KIVI's unchanged — an unfair baseline in the demo's speed column.
#: ``serve`` too: its paged cache (float or KIVI) is one pool allocated when the server starts, so no
#: long-lived block lands between a step's temporaries; pinned, every step's temporaries were fresh
#: mappings (1.68 million page faults in 5 s, a third of the generation threads' time in the kernel) and
#: a float decode step of 2 requests took 150 ms against 85 ms in-process (docs/serving.md).
UNPINNED_COMMANDS = ("demo", "generate", "estimate", "cache", "serve")


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, (CliError, ValueError, OSError)) or getattr(e, "user_facing", False)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _quiet_stdout() -> None:
    """Point fd 1 at /dev/null, so that the interpreter's exit-time flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:  # pragma: no cover - nothing more to do
        pass


def _caused_by_interrupt(e: BaseException) -> bool:
    """Whether ``e`` was raised while handling a Ctrl-C (a ``KeyboardInterrupt`` in its cause/context chain)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _exit_now(rc: int) -> None:
    """End the process once a command's work is done and flushed, skipping the interpreter's teardown.

    For ``kivi serve``: after a clean shutdown (uvicorn stopped, the generation thread joined) the
    interpreter's final garbage collection over the server's libraries (uvicorn/starlette/pydantic,
    tokenizers, transformers' continuous batching) was seen to run for more than 15 s in about one
    test run in four on a loaded 2-core machine (gdb: ``Py_FinalizeEx -> finalize_modules -> gc``),
    so a Ctrl-C looked like a hang. Nothing is left to save at that point.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Everything, imports of torch / transformers included, runs inside this function's guard: a
    Ctrl-C at any moment prints one line and exits 130.

    A broken pipe on stdout (``kivi estimate | head -1``): the reader left. The command exits
    quietly with 141, what a shell reports for a C tool killed by SIGPIPE (``seq 1 100000 | head
    -1``), so ``set -o pipefail`` scripts see kivi exactly as they see any other Unix tool. stdout
    is written by Python's buffer (rich output is captured and printed through it, never written
    by rich itself, which would exit 1 on its own): output that fits the pipe goes out in one write
    at the end, so a small output read by ``head`` exits 0 every time and a write after the reader
    left exits 141 every time — never 1, never a traceback.
    """
    command = "kivi"
    try:
        if sys.stdout is None:  # `kivi ... >&-`: fd 1 closed at start; nothing could receive the result
            print("kivi: error: standard output is closed (e.g. `>&-`); redirect it to a file or /dev/null",
                  file=sys.stderr)
            return 2
        parser = build_parser()
        args = parser.parse_args(argv)
        # "kivi eval ppl": the command and its action (eval_command, cache_command, ...)
        words = [args.command] + [v for k, v in sorted(vars(args).items())
                                  if k.endswith("_command") and isinstance(v, str)]
        command = " ".join(["kivi", *[w for w in words if w]])
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if args.command not in UNPINNED_COMMANDS:
            from ..malloc_pin import reduce_fragmentation

            reduce_fragmentation()  # long CPU runs: keep RSS close to what the caches really hold
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below, not at interpreter exit
        if argv is None and getattr(args, "exit_without_finalizing", False):
            _exit_now(int(rc or 0))
        return int(rc or 0)
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - user-facing errors become one line, others re-raise
        if _caused_by_interrupt(e):  # e.g. transformers' lazy import turns a Ctrl-C into a RuntimeError
            print(f"{command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if not _is_user_error(e) or os.environ.get("KIVI_DEBUG"):
            raise
        print(f"{getattr(e, 'prog', None) or command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
