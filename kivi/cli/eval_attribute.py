"""`kivi eval attribute`: where a config loses the long-context suite's answers (docs/evaluation.md, "Where the
loss is")."""

from __future__ import annotations

import argparse
import hashlib
import sys

from .errors import CliError
from .loading import load_model_from_args, read_text_arg
from .options import add_model_args, add_text_args
from .output import print_rich, write_json_file, write_outputs
from .validators import longctx_config, output_path, positive_int, text_value, token_count


def cmd_attribute(args: argparse.Namespace) -> int:
    from ..eval.longctx.attribution import attribute
    from ..eval.longctx.report import attribution_table

    label, spec = args.config
    text = read_text_arg(args)
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
    rows = [r for r in _read_rows(args.jsonl) if (not args.lengths or r.get("length") in args.lengths)
            and (not args.protocol or r.get("protocol") in args.protocol)]
    if not rows:
        raise CliError(f"--jsonl {args.jsonl!r} holds no rows of these --lengths / --protocol")
    other = sorted({(r.get("model"), r.get("text")) for r in rows} - {(args.model, digest)})
    if other:
        raise CliError(f"--jsonl {args.jsonl!r} holds rows of another model or text ({other}); give the same "
                       f"--model and --text as the run (here: {args.model!r}, text {digest})")
    model, tok = load_model_from_args(args)
    try:
        result = attribute(model, tok, text, rows, label, spec, top=args.top, progress=not args.no_progress)
    except ValueError as e:
        raise CliError(str(e)) from None
    failed = write_outputs([("--json", args.json, lambda p: write_json_file(p, result))])
    print_rich(attribution_table(result, limit=args.show))
    if args.json and not failed:
        print(f"wrote {args.json}", file=sys.stderr)
    if failed:
        raise CliError("; ".join(failed))
    return 0


def _read_rows(path: str) -> list[dict]:
    """The rows of a ``kivi eval longctx --jsonl`` file (read by the one bounded reader, :mod:`kivi.files`)."""
    import json

    from ..files.read import read_text

    rows = []
    for n, line in enumerate(read_text(path, option="--jsonl").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise CliError(f"--jsonl {path!r}: line {n} is not JSON") from None
    if not rows:
        raise CliError(f"--jsonl {path!r} holds no rows")
    return rows


def add_parser(evs: argparse._SubParsersAction) -> None:
    from ..eval.longctx.protocols import PROTOCOLS

    p = evs.add_parser("attribute", help="where a config loses the long-context suite's answers (side, layer, head)",
                       description="For every sample of a `kivi eval longctx` run that full precision answers and "
                       "CONFIG does not: the margin between the two answers at their first differing token, under "
                       "CONFIG and under ablations keeping keys, values, one layer or one head at full precision "
                       "(docs/evaluation.md, \"Where the loss is\").")
    add_model_args(p)
    add_text_args(p)
    p.add_argument("--jsonl", required=True, type=text_value, help="the rows of a `kivi eval longctx --jsonl` run")
    p.add_argument("--config", required=True, type=longctx_config,
                   help="the KiviConfig (preset or .json) whose losses to explain, as named in that run")
    p.add_argument("--lengths", nargs="+", type=token_count, default=None,
                   help="only the rows of these prompt lengths (default: every length in the file)")
    p.add_argument("--protocol", nargs="+", choices=list(PROTOCOLS), default=None,
                   help="only the rows of these protocols (default: every protocol in the file)")
    p.add_argument("--top", type=positive_int, default=2,
                   help="ablate each kv head of this many layers, those whose ablation recovers most (default 2)")
    p.add_argument("--show", type=positive_int, default=12, help="ablations shown in the table (default 12)")
    p.add_argument("--json", default=None, type=output_path, help="write every margin and the ranking as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_attribute)


__all__ = ["add_parser", "cmd_attribute"]
