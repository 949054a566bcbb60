"""`kivi eval longctx`: the offline RULER-style long-context suite (docs/evaluation.md, "Long-context suite")."""

from __future__ import annotations

import argparse
import hashlib
import sys

from .errors import CliError
from .loading import check_context_fits, load_model_from_args, read_text_arg
from .options import add_model_args, add_text_args
from .output import print_rich, write_json_file, write_outputs
from .validators import longctx_config, output_path, positive_int, seed, shard, token_count

DEFAULT_CONFIGS = ("fp", "extreme", "balanced")


def cmd_longctx(args: argparse.Namespace) -> int:
    from ..eval.longctx.runner import META, ResultLog, merge_logs, run_suite
    from ..eval.longctx.summary import INTERVAL, failures, summarize
    from ..eval.longctx.tasks import MAX_NEW_TOKENS

    chosen = args.configs or [longctx_config(x) for x in DEFAULT_CONFIGS]
    configs = list({label: (label, spec) for label, spec in chosen}.values())
    lengths = sorted(set(args.lengths))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install matplotlib") from None
    text = read_text_arg(args)  # a bad --text fails before the model loads (the one bounded reader)
    meta = {"model": args.model, "text": hashlib.sha1(text.encode("utf-8")).hexdigest()[:16], "seed": args.seed,
            "samples": args.samples}
    assert tuple(meta) == META
    if args.report_only and not args.jsonl:
        raise CliError("--report-only reads the rows of --jsonl FILE: give it")
    if not args.report_only and args.jsonl and len(args.jsonl) > 1:
        raise CliError(f"--jsonl: a run streams to one file, got {len(args.jsonl)}; several files are read "
                       "together with --report-only (e.g. the shards of one run)")
    if args.report_only and args.shard != (0, 1):
        raise CliError("--shard chooses what a run computes; --report-only computes nothing: give each shard's "
                       "--jsonl file instead")
    if args.report_only:
        rows = merge_logs(args.jsonl, meta)  # rows of another run, or one row twice, refused
    else:
        log = ResultLog(args.jsonl[0] if args.jsonl else None, meta)  # another run's file: refused before loading
        model, tok = load_model_from_args(args)
        longest = max(MAX_NEW_TOKENS[t] for t in args.tasks)
        check_context_fits(model, lengths[-1] + longest, f"--lengths {lengths[-1]} + a {longest}-token answer")
        rows = run_suite(model, tok, text, configs, lengths=lengths, tasks=args.tasks, samples=args.samples,
                         protocols=args.protocol, seed=args.seed, log=log, progress=not args.no_progress,
                         shard=args.shard)
    wanted = {(c, L, t, p) for c, _ in configs for L in lengths for t in args.tasks for p in args.protocol}
    rows = [r for r in rows if (r["config"], r["length"], r["task"], r["protocol"]) in wanted
            and r["sample"] < args.samples]
    if not rows:
        raise CliError(f"--jsonl {' '.join(args.jsonl or [])!r} holds no rows of these configs, lengths, tasks and "
                       "protocols")
    summary = summarize(rows, configs=[c for c, _ in configs], seed=args.seed)
    failed_answers = failures(rows)
    result = {"interval": INTERVAL, "score_unit": "points (0-100): mean over samples of RULER's fraction of "
              "expected strings found in the answer", "bits_per_element": "real cache bytes * 8 / (2 * layers * "
              "kv_heads * head_dim * length) once the cache holds the whole prompt", **meta,
              "lengths": lengths, "tasks": args.tasks, "protocols": args.protocol,
              "configs": {c: spec_json(s) for c, s in configs}, "rows": summary, "failures": failed_answers}
    from ..eval.longctx.report import plot, table

    title = f"{args.model}: {args.samples} samples per task, seed {args.seed}"
    failed = write_outputs([("--json", args.json, lambda p: write_json_file(p, result)),
                            ("--plot", args.plot, lambda p: plot(summary, p, title=title))])
    print_rich(table(summary))
    for c, f in failed_answers.items():
        print(f"{c}: {f['failed']} of {f['answers']} answers failed, left out of the table ({f['error']})",
              file=sys.stderr)
    for path in (args.json, args.plot, None if args.report_only or not args.jsonl else args.jsonl[0]):
        if path and not any(path in f for f in failed):
            print(f"wrote {path}", file=sys.stderr)
    if args.shard != (0, 1) and not args.report_only:
        print(f"shard {args.shard[0]}/{args.shard[1]}: the table holds this shard's rows only; summarize the whole "
              "run with --report-only --jsonl and every shard's file", file=sys.stderr)
    if failed:
        raise CliError("; ".join(failed))
    return 0


def spec_json(spec):
    from ..eval.caches import spec_to_json

    return spec_to_json(spec)


def add_parser(evs: argparse._SubParsersAction) -> None:
    from ..eval.longctx.protocols import PROTOCOLS
    from ..eval.longctx.tasks import TASKS

    p = evs.add_parser("longctx", help="RULER-style long-context suite (NIAH, variable tracking, word extraction, QA)",
                       description="Offline RULER-style long-context tasks at exact token lengths, one shared "
                       "full-precision prefill per sample, paired statistics vs full precision "
                       "(docs/evaluation.md, \"Long-context suite\").")
    add_model_args(p)
    add_text_args(p)
    p.add_argument("--lengths", nargs="+", type=token_count, default=[4096],
                   help="prompt lengths in tokens (template, document, question), e.g. 2048 4096 8k (default 4096)")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), metavar="TASK",
                   help=f"tasks (default: all): {' '.join(TASKS)}")
    p.add_argument("--samples", type=positive_int, default=10,
                   help="samples per (task, length); the needle depth sweeps 0..100%% over them (default 10)")
    p.add_argument("--configs", nargs="+", type=longctx_config, default=None, metavar="CONFIG",
                   help="caches to compare: fp, preset names, quanto-int2/quanto-int4 (optimum-quanto), "
                   "hqq-int2/hqq-int4 (hqq), KiviConfig .json files (default: fp extreme balanced)")
    p.add_argument("--protocol", nargs="+", choices=list(PROTOCOLS), default=[PROTOCOLS[0]],
                   help="question-after (default: the question reads the quantized cache) and/or one-shot")
    p.add_argument("--seed", type=seed, default=0, help="seed of the generated samples (default 0)")
    p.add_argument("--json", default=None, type=output_path, help="write the summary rows as JSON")
    p.add_argument("--jsonl", nargs="+", default=None, type=output_path, metavar="JSONL",
                   help="stream every answer to this JSONL file; an existing file of the same run is resumed "
                   "(with --report-only: one or more files of one run, e.g. its shards)")
    p.add_argument("--shard", type=shard, default=(0, 1), metavar="I/N",
                   help="compute only shard I of N (every N-th prompt from the I-th; 0-based), to split a grid over "
                   "processes or machines, each with its own --jsonl; then --report-only --jsonl A B ... "
                   "summarizes them (default 0/1: everything)")
    p.add_argument("--plot", default=None, type=output_path, help="write a PNG: score vs length, score vs bits")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing, load no model: summarize the rows --jsonl already holds (e.g. of a stopped run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_longctx)


__all__ = ["add_parser", "cmd_longctx"]
