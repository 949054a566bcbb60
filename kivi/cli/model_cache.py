"""`kivi cache ls|verify|clear`: the converted copies of GGUF models (``<cache root>/models``, see
docs/cli.md, "The converted-model cache")."""

from __future__ import annotations

import argparse
import time
from typing import Any

from . import CliError
from .output import print_json


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def cmd_ls(args: argparse.Namespace) -> int:
    from ..memory import format_bytes
    from ..models.conversion_cache import disk_bytes, kivi_cache_dir, list_converted

    copies = list_converted()
    root = kivi_cache_dir() / "models"
    if args.json:
        print_json({"root": str(root), "disk_bytes": disk_bytes(copies),
                    "copies": [c.to_dict() for c in copies]})
        return 0
    if not copies:
        print(f"no converted models under {root}")
        return 0
    print(f"converted models under {root} (most recently used first):")
    for c in copies:
        state = (f"  DAMAGED: {c.damaged}" if c.damaged else "") + (f"  STALE: {c.stale}" if c.stale else "")
        more = f" (+{len(c.sources) - 1} more)" if len(c.sources) > 1 else ""
        print(f"  {c.key}  {format_bytes(c.nbytes):>10s}  last use {_fmt_time(c.last_used)}  source {c.source}{more}"
              f"{state}")
    print(f"{len(copies)} copies, {format_bytes(disk_bytes(copies))} on disk (hard-linked files counted once); "
          "`kivi cache clear` removes the stale and damaged ones, "
          "`kivi cache clear KEY` one, `--all` every one")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Every file's SHA-256 against the copy's manifest: 0 when all are intact, 1 when one is damaged."""
    from ..models.conversion_cache import verify_converted

    try:
        checked = verify_converted(args.keys)
    except ValueError as e:
        raise CliError(str(e)) from None
    damaged = [c.key for c, problem in checked if problem]
    if args.json:
        print_json({"copies": [{"key": c.key, "path": str(c.path), "damaged": problem} for c, problem in checked],
                    "damaged": damaged})
    else:
        for c, problem in checked:
            print(f"  {c.key}  {'DAMAGED: ' + problem if problem else 'ok'}")
        print(f"{len(checked)} copies checked (every file's SHA-256), {len(damaged)} damaged"
              + ("; a load converts a damaged copy again, `kivi cache clear` removes it" if damaged else ""))
    return 1 if damaged else 0


def cmd_clear(args: argparse.Namespace) -> int:
    from ..memory import format_bytes
    from ..models.conversion_cache import remove_converted

    if args.all and args.keys:
        raise CliError("give either --all or KEYs, not both")
    removed = remove_converted(args.keys, all=args.all, stale=not args.keys and not args.all)
    if args.json:
        print_json({"removed": [c.to_dict() for c in removed], "freed_bytes": sum(c.nbytes for c in removed)})
        return 0
    for c in removed:
        print(f"removed {c.key} ({format_bytes(c.nbytes)})")
    what = "stale or damaged " if not args.keys and not args.all else ""
    print(f"freed {format_bytes(sum(c.nbytes for c in removed))} ({len(removed)} {what}cop"
          f"{'y' if len(removed) == 1 else 'ies'})")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("cache", help="list / verify / clear the converted copies of GGUF models (e.g. SmolLM2)",
                       description="The first load of a GGUF model keeps a converted copy (safetensors) under "
                       "<cache root>/models, keyed by the GGUF's content; see docs/cli.md, "
                       "\"The converted-model cache\". The cache root is "
                       "$KIVI_CACHE_DIR, else $XDG_CACHE_HOME/kivi, else ~/.cache/kivi.")
    cs = p.add_subparsers(dest="cache_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    ls = cs.add_parser("ls", help="list the converted copies: key, size, last use, source, whether stale or damaged")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(func=cmd_ls)
    ve = cs.add_parser("verify", help="check every file of the copies against their manifest (SHA-256); exit 1 "
                       "when one is damaged",
                       description="A load checks each file's size and the small files' SHA-256; this also hashes "
                       "the weights (about a second for SmolLM2's 538 MB).")
    ve.add_argument("keys", nargs="*", metavar="KEY", help="folder names shown by `kivi cache ls` (default: all)")
    ve.add_argument("--json", action="store_true", help="print one JSON object")
    ve.set_defaults(func=cmd_verify)
    cl = cs.add_parser(
        "clear",
        help="remove converted copies: the stale and damaged ones (default), KEYs, or --all",
        description="Without arguments, removes the stale copies (every GGUF file they were loaded for is gone or "
        "changed, or the conversion never finished) and the damaged ones (files other than those written); with "
        "KEYs (from `kivi cache ls`), those; with --all, every one.",
    )
    cl.add_argument("keys", nargs="*", metavar="KEY", help="folder names shown by `kivi cache ls`")
    cl.add_argument("--all", action="store_true", help="remove every converted copy")
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.set_defaults(func=cmd_clear)
