"""`kivi cache ls|clear`: the converted copies of GGUF models (``<cache root>/models``, see
docs/model-cache.md)."""

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
        state = f"  STALE: {c.stale}" if c.stale else ""
        print(f"  {c.key}  {format_bytes(c.nbytes):>10s}  last use {_fmt_time(c.last_used)}  source {c.source}{state}")
    print(f"{len(copies)} copies, {format_bytes(disk_bytes(copies))} on disk (hard-linked files counted once); "
          "`kivi cache clear` removes the stale ones, "
          "`kivi cache clear KEY` one, `--all` every one")
    return 0


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
    what = "stale " if not args.keys and not args.all else ""
    print(f"freed {format_bytes(sum(c.nbytes for c in removed))} ({len(removed)} {what}cop"
          f"{'y' if len(removed) == 1 else 'ies'})")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("cache", help="list / clear the converted copies of GGUF models (e.g. the embedded SmolLM2)",
                       description="The first load of a GGUF model keeps a converted copy (safetensors) under "
                       "<cache root>/models, keyed by the GGUF's content; see docs/model-cache.md. The cache root is "
                       "$KIVI_CACHE_DIR, else $XDG_CACHE_HOME/kivi, else ~/.cache/kivi.")
    cs = p.add_subparsers(dest="cache_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    ls = cs.add_parser("ls", help="list the converted copies: key, size, last use, source, whether stale")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(func=cmd_ls)
    cl = cs.add_parser(
        "clear",
        help="remove converted copies: the stale ones (default), KEYs, or --all",
        description="Without arguments, removes the stale copies (their GGUF is gone or changed, or "
        "the conversion never finished); with KEYs (from `kivi cache ls`), those; with --all, every one.",
    )
    cl.add_argument("keys", nargs="*", metavar="KEY", help="folder names shown by `kivi cache ls`")
    cl.add_argument("--all", action="store_true", help="remove every converted copy")
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.set_defaults(func=cmd_clear)
