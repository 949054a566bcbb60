"""`kivi profile` (per-layer sensitivity -> layer_specific_config) and `kivi tune` (cheapest config
within a budget)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..files import TextReadError, read_text
from . import CliError
from .calibration import add_calibration_args, calibration_prompts_from_args, calibration_requested
from .loading import load_model_and_windows
from .options import (
    add_config_args,
    add_model_args,
    add_output_args,
    add_text_args,
    add_window_args,
    check_window_args,
    config_from_args,
    load_config_file,
)
from .output import emit, write_json_file, write_outputs
from .validators import (
    finite_float,
    json_object,
    non_negative_int,
    output_path,
    positive_float,
    positive_int,
    text_value,
    token_count,
)


def upgrade_config(base: Any, upgrade: dict) -> None:
    """``--upgrade`` must be fields a layer may override, with values KiviConfig accepts (checked now,
    not after the profile ran)."""
    import dataclasses

    from ..config import LAYER_FIELDS

    unknown = sorted(set(upgrade) - set(LAYER_FIELDS))
    if unknown:
        raise CliError(f"--upgrade has unknown field(s) {unknown}; allowed: {list(LAYER_FIELDS)}")
    try:
        dataclasses.replace(base, layer_specific_config={}, **upgrade)
    except (ValueError, TypeError) as e:
        raise CliError(f"--upgrade {json.dumps(upgrade)}: {e}") from None


def read_profile(path: str) -> dict:
    """A `kivi profile --json` output: an object whose 'ranking' lists layer indices."""
    try:
        profile = json.loads(read_text(path, option="--profile"))  # the one bounded reader
    except (OSError, TextReadError) as e:
        raise CliError(str(e)) from None
    except (json.JSONDecodeError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise CliError(f"--profile {path!r}: cannot read a layer profile ({reason})") from None
    ranking = profile.get("ranking") if isinstance(profile, dict) else None
    if not isinstance(ranking, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ranking):
        raise CliError(f"--profile {path!r} is not a `kivi profile --json` output (it needs 'ranking': a list of "
                       "layer indices)")
    return profile


def suite_line(name: str, r: dict, s: dict) -> str:
    """One line: a config's long-context suite score vs full precision's (a `SuiteReference.score` result)."""
    ci = r["score_drop_ci"]
    return (f"on the long-context suite ({s['protocol']}, {s['length']} tokens, {', '.join(s['tasks'])}; "
            f"{s['samples']} samples each): {name} scores {r['score']:.1f} vs FP {r['score_fp']:.1f}, drop "
            f"{r['score_drop']:+.1f} points" + (f" (95% paired interval {ci[0]:+.1f}..{ci[1]:+.1f})" if ci else "")
            + "; per task: " + ", ".join(f"{t} {v:.0f}" for t, v in r["score_tasks"].items()))


def score_recommendation(ref, rec, prof: dict) -> list[str]:
    """`kivi profile --score-length`: the recommended config scored on the suite ``ref`` (``prof`` gets ``suite``
    and ``recommended_suite``); the lines to print (none without a suite)."""
    if ref is None:
        return []
    prof["suite"] = ref.describe()
    prof["recommended_suite"] = ref.score(rec, rec.describe())
    return [suite_line(rec.describe(), prof["recommended_suite"], prof["suite"])]


def cmd_profile(args: argparse.Namespace) -> int:
    from ..config import KiviConfig
    from ..eval.profile import layer_profile, recommend_layer_config

    suite_requested(args)  # the suite's options refused before the model loads
    calibration_requested(args)
    if args.per_head:
        return cmd_head_profile(args)
    base = config_from_args(args) or KiviConfig.preset("extreme")
    upgrade = args.upgrade if args.upgrade is not None else {"k_bits": 4}
    upgrade_config(base, upgrade)
    if args.max_bits is not None and args.upgrade_layers is not None:
        raise ValueError("give either --upgrade-layers or --max-bits, not both")
    check_window_args(args)
    model, tok, windows = load_model_and_windows(args)
    ref = suite_reference(args, model, tok) if args.score_length is not None else None  # checks the context first
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if args.upgrade_layers is not None and args.upgrade_layers > num_layers:
        raise CliError(f"--upgrade-layers {args.upgrade_layers} is more than the model's {num_layers} layers")
    base.validate(num_layers=num_layers)
    prof = layer_profile(model, windows, base, prefix=args.prefix, chunk=args.chunk, batch_size=args.batch_size,
                         progress=not args.no_progress, fast=not args.reference_eval)
    n = args.upgrade_layers if args.max_bits is None else None
    if n is None and args.max_bits is None:
        n = max(1, len(prof["ranking"]) // 10)
    rec = recommend_layer_config(prof, base, upgrade=upgrade, num_layers=n, max_bits=args.max_bits, model=model,
                                 tokens=args.context, prefix=args.prefix)
    prof["recommended"] = rec.to_dict()
    prof["recommended_name"] = rec.describe()
    prof["upgrade"] = upgrade
    on_suite = score_recommendation(ref, rec, prof)
    lines = [f"per-layer sensitivity to {prof['base_name']} (others FP), {prof['protocol']['windows']} windows; "
             f"FP ppl {prof['fp_ppl']:.4f}",
             f"{'layer':>5s} {'KL':>10s} {'dppl%':>8s} {'top1%':>7s}"]
    for r in prof["layers"]:
        lines.append(f"{r['layer']:5d} {r['kl']:10.6f} {r['delta_ppl_pct']:+8.3f} {100 * r['top1_agreement']:7.2f}")
    lines.append(f"most sensitive first: {prof['ranking']}")
    lines.append(f"recommended: {rec.describe()}; layer_specific_config={rec.layer_specific_config}")
    lines += on_suite
    emit(args, prof, "\n".join(lines), writes=[("--write-config", args.write_config, rec.to_json)])
    return 0


def early_stop_factor(text: str) -> float:
    """``--early-stop``: 0 (off) or a factor >= 1."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v == 0 or v >= 1) or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 (off) or a factor >= 1 of the budget")
    return v
def cmd_head_profile(args: argparse.Namespace) -> int:
    """`kivi profile --per-head`: every (layer, kv head, side) scored in one FP pass; a head_bits config within
    --max-bits (the planner's bits per element, float16 model, 32K tokens)."""
    from ..config import KiviConfig
    from ..eval.head_profile import bits_per_element, head_profile, head_profile_prompts, recommend_head_bits
    from ..memory.sources import model_spec
    from .loading import load_model_from_args, read_text_arg

    if args.upgrade is not None or args.upgrade_layers is not None:
        raise CliError("--per-head takes --head-upgrade-bits and --max-bits, not --upgrade / --upgrade-layers")
    base = config_from_args(args) or KiviConfig.preset("extreme", sink_tokens=4)
    if args.head_upgrade_bits <= min(base.k_bits, base.v_bits):
        raise CliError(f"--head-upgrade-bits {args.head_upgrade_bits} must be wider than a base width "
                       f"(k_bits={base.k_bits}, v_bits={base.v_bits}); sides already that wide are left alone")
    check_window_args(args)
    widths = sorted({base.k_bits, base.v_bits, args.head_upgrade_bits})
    if args.calibrate_on == "suite":
        text = read_text_arg(args)  # fail on a bad path before loading the model
        model, tok = load_model_from_args(args)
        prompts, calibration = calibration_prompts_from_args(args, model, tok, text)
    else:
        model, tok, windows = load_model_and_windows(args)
    ref = suite_reference(args, model, tok) if args.score_length is not None else None  # checks the context first
    spec = model_spec(model)
    base.validate(num_layers=spec.num_layers)
    max_bits = args.max_bits if args.max_bits is not None else bits_per_element(spec, base) + 0.3
    if args.calibrate_on == "suite":
        prof = head_profile_prompts(model, [(p.ids, p.scored_from) for p in prompts], base, bits=widths,
                                    progress=not args.no_progress)
        prof["calibration"] = calibration
        source = (f"{len(prompts)} suite prompts ({calibration['length']} tokens, seed {calibration['seed']}; "
                  "question and answer scored)")
    else:
        prof = head_profile(model, windows, base, bits=widths, prefix=args.prefix, progress=not args.no_progress)
        source = f"{prof['protocol']['windows']} windows"
    rec, bits = recommend_head_bits(prof, spec, max_bits, base=base, upgrade=args.head_upgrade_bits)
    prof.update(recommended=rec.to_dict(), recommended_name=rec.describe(), recommended_bits=bits, max_bits=max_bits,
                base_bits=bits_per_element(spec, base))
    on_suite = score_recommendation(ref, rec, prof)
    up = str(args.head_upgrade_bits)
    lines = [
        f"per-head sensitivity ({prof['metric']}) to {prof['base_name']}, {source}",
        f"{'layer':>5s} {'head':>4s} {'side':>4s} " + " ".join(f"{b + '-bit':>10s}" for b in map(str, prof["bits"])),
    ]
    for r in prof["heads"]:
        lines.append(f"{r['layer']:5d} {r['head']:4d} {r['side']:>4s} "
                     + " ".join(f"{r['score'][str(b)]:10.6f}" for b in prof["bits"]))
    lines.append(f"recommended ({up}-bit where it pays most): {prof['base_bits']:.4f} -> {bits:.4f} bits/element "
                 f"(budget {max_bits:.4f}; float16, 32K tokens); head_bits={rec.head_bits}")
    lines += on_suite
    emit(args, prof, "\n".join(lines), writes=[("--write-config", args.write_config, rec.to_json)])
    return 0


def bits_at_arg(text: str) -> int | None:
    """``--bits-at``: ``eval`` (None) or a token count (``32k``)."""
    if str(text).strip().lower() == "eval":
        return None
    try:
        return token_count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'eval' or a token count (e.g. 32k, 32768)") from None


def score_drop_arg(text: str) -> float:
    """``--max-score-drop``: points of the long-context suite, 0..100 (the library's rule)."""
    from ..eval.longctx.objective import check_score_drop

    try:
        return check_score_drop(finite_float(text))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of points between 0 and 100") from None


DEFAULT_SCORE_LENGTH = 4096  # as `kivi eval longctx --lengths`
SUITE_OPTIONS = ("--score-tasks", "--score-samples", "--score-protocol")


def suite_requested(args: argparse.Namespace) -> bool:
    """Whether `kivi tune` / `kivi profile` score the long-context suite; its other options without it are refused."""
    on = getattr(args, "max_score_drop", None) is not None or args.score_length is not None
    given = [o for o in SUITE_OPTIONS if getattr(args, o[2:].replace("-", "_")) is not None]
    if given and not on:
        need = "--score-length L or --max-score-drop P" if hasattr(args, "max_score_drop") else "--score-length L"
        raise CliError(f"{given[0]} needs {need} (the long-context suite is off)")
    return on


def suite_reference(args: argparse.Namespace, model, tok):
    """The suite's full-precision side (prefilled once, replayed into every config it scores); the context is
    checked first."""
    from ..eval.longctx.objective import DEFAULT_SAMPLES, DEFAULT_TASKS, SuiteReference
    from ..eval.longctx.protocols import PROTOCOLS
    from ..eval.longctx.tasks import MAX_NEW_TOKENS
    from .loading import check_context_fits, read_text_arg

    if tok is None:
        raise CliError(f"--score-length: the long-context suite needs {args.model!r}'s tokenizer, which did not load")
    tasks = args.score_tasks or list(DEFAULT_TASKS)
    length = args.score_length or DEFAULT_SCORE_LENGTH
    longest = max(MAX_NEW_TOKENS[t] for t in tasks)
    check_context_fits(model, length + longest, f"--score-length {length} + a {longest}-token answer")
    return SuiteReference(model, tok, read_text_arg(args), length=length, tasks=tasks,
                          samples=args.score_samples or DEFAULT_SAMPLES, protocol=args.score_protocol or PROTOCOLS[0],
                          progress=not args.no_progress)


def cmd_tune(args: argparse.Namespace) -> int:
    from ..config import KiviConfig
    from ..eval.candidates import candidate_grid, tiers_comparable
    from ..eval.tuning import NoCandidateFits, parse_percent, tune

    if args.max_ppl_increase is None and args.max_bits is None and args.max_score_drop is None:
        raise ValueError("give a budget: --max-ppl-increase 5%%, --max-bits 4 and/or --max-score-drop 1".replace(
            "%%", "%"))
    with_suite = suite_requested(args)
    try:
        mpi = parse_percent(args.max_ppl_increase) if args.max_ppl_increase is not None else None
    except ValueError as e:
        raise CliError(f"--max-ppl-increase: {e}") from None
    profile = read_profile(args.profile) if args.profile else None
    cands = candidate_grid(profile, tiers=tiers_comparable(args.bits_at, args.context))
    extra = config_from_args(args)
    if extra is not None:
        cands.append(extra)
    for f in args.candidates or []:
        cands.append(load_config_file(f, "--candidates"))
    check_window_args(args)
    pw = args.head_profile_windows
    # the head profile reads the windows right after the tuning ones: text the candidates are not scored on
    model, tok, both = load_model_and_windows(argparse.Namespace(**{**vars(args), "windows": args.windows + pw}))
    windows, profile_windows = both[: args.windows], (both[args.windows:] if pw else None)
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    for c in cands:
        c.validate(num_layers=num_layers)  # a profile of another model names layers this one lacks
    suite = suite_reference(args, model, tok) if with_suite else None
    try:
        r = tune(model, windows, cands, max_ppl_increase=mpi, max_bits=args.max_bits, profile=profile,
                 suite=suite, max_score_drop=args.max_score_drop,
                 prefix=args.prefix, chunk=args.chunk, batch_size=args.batch_size, progress=not args.no_progress,
                 fast=not args.reference_eval, early_stop=args.early_stop or None, bits_at=args.bits_at,
                 profile_windows=profile_windows)
    except NoCandidateFits as e:  # the measurements are kept: -o gets them, with no chosen config
        kept = ""
        if args.output and not write_outputs([("-o/--output", args.output,
                                               lambda p, err=e: write_json_file(p, {"config": None, "error": str(err),
                                                                                    **err.result}))]):
            kept = f" (the {len(e.result['evaluated'])} measured candidates were written to {args.output})"
        raise CliError(f"{e}{kept}") from None
    out = args.write_config
    chosen = KiviConfig.from_dict(r["config"])
    stopped = sum(1 for x in r["evaluated"] if "stopped_early" in x)
    sec = r["seconds"]
    lines = [f"{'candidate (in order of bits)':58s} {'bits':>6s} {'@eval':>6s} {'dppl%':>8s} {'windows':>7s}"
             + (f" {'score':>6s} {'drop':>6s}" if suite else "")]
    for x in r["evaluated"]:
        on_suite = ""
        if suite:
            on_suite = (f" {x['score']:6.1f} {x['score_drop']:+6.1f}" if "score_drop" in x else f" {'-':>6s} {'-':>6s}")
        lines.append(f"{x['name'][:58]:58s} {x['bits_per_element']:6.3f} {x['bits_at_eval']:6.3f} "
                     f"{x['delta_ppl_pct']:+8.2f} {x['windows']:7d}" + on_suite
                     + ("  stopped early" if "stopped_early" in x else ""))
    lines.append(
        f"chose {r['name']}: {r['bits_per_element']:.3f} bits/element ({r['bits_basis']}; {r['bits_at_eval']:.3f} held "
        f"at the end of a {args.context}-token window), ppl {r['ppl']:.4f} vs FP {r['ppl_fp']:.4f} "
        f"({r['delta_ppl_pct']:+.2f}%) after measuring {len(r['evaluated'])} of {r['search']['ranked']} candidates"
        + (f" ({stopped} stopped early, over {args.early_stop:g} x the budget)" if stopped else "")
        + f"; {r['search']['per_head']} per-head candidates; tiers {r['search']['tiers']}; "
        f"seconds: profile {sec['profile']:.0f}, FP {sec['fp']:.0f}, candidates {sec['candidates']:.0f}"
        + (f" (suite {sec.get('suite', 0):.0f}), suite FP prefills {r['suite']['prefill_seconds']:.0f}"
           if suite else ""))
    if suite:
        lines.append(suite_line(r["name"], r, r["suite"])
                     + (f"; budget {args.max_score_drop:g} points" if args.max_score_drop is not None else ""))
    by_reason: dict[str, list[str]] = {}
    for x in r["skipped"]:
        by_reason.setdefault(x["reason"], []).append(x["name"])
    for reason, names in by_reason.items():
        lines.append(f"skipped {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") + f": {reason}")
    emit(args, r, "\n".join(lines), writes=[("--write-config", out, chosen.to_json)])
    return 0


def add_suite_args(p: argparse.ArgumentParser, *, constraint: bool = True) -> None:
    """The long-context suite as a constraint (``constraint``: `kivi tune`) and a report (docs/evaluation.md,
    "Choosing configs by it")."""
    from ..eval.longctx.objective import DEFAULT_SAMPLES, DEFAULT_TASKS
    from ..eval.longctx.protocols import PROTOCOLS
    from ..eval.longctx.tasks import TASKS

    if constraint:
        p.add_argument("--max-score-drop", type=score_drop_arg, default=None, metavar="POINTS",
                       help="admit a candidate only if its long-context suite score (0-100, average over "
                       "--score-tasks) is at most this many points below full precision's on the same samples")
        p.add_argument("--score-length", type=token_count, default=None, metavar="TOKENS",
                       help="score the pick (and, with --max-score-drop, the candidates) on the long-context suite "
                       f"at this prompt length (default with --max-score-drop: {DEFAULT_SCORE_LENGTH})")
    else:
        p.add_argument("--score-length", type=token_count, default=None, metavar="TOKENS",
                       help="also score the recommended config on the long-context suite at this prompt length "
                       "(a report; the ranking stays KL: docs/evaluation.md, \"Choosing configs by it\")")
    p.add_argument("--score-tasks", nargs="+", choices=list(TASKS), default=None, metavar="TASK",
                   help=f"suite tasks (default: {' '.join(DEFAULT_TASKS)}); any of {' '.join(TASKS)}")
    p.add_argument("--score-samples", type=positive_int, default=None,
                   help=f"suite samples per task, each prefilled once at full precision (default {DEFAULT_SAMPLES})")
    p.add_argument("--score-protocol", choices=list(PROTOCOLS), default=None,
                   help=f"suite protocol (default {PROTOCOLS[0]}: the question reads the candidate's cache)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="per-layer sensitivity; recommends a layer_specific_config",
                              description="For each layer, KL vs FP when only that layer is quantized with the "
                                          "base config (default: extreme, 2/2). Writes a recommended KiviConfig.")
    add_model_args(p)
    add_text_args(p)
    add_window_args(p, windows=2)
    add_config_args(p)
    p.add_argument("--upgrade", default=None, type=json_object,
                   help='what the most sensitive layers get (JSON, default {"k_bits": 4})')
    p.add_argument("--upgrade-layers", type=non_negative_int, default=None,
                   help="how many of the most sensitive layers to upgrade (default: a tenth of the layers)")
    p.add_argument("--max-bits", type=positive_float, default=None,
                   help="upgrade as many layers as fit in this many bits per element (instead of --upgrade-layers)")
    p.add_argument("--per-head", action="store_true",
                   help="score every (layer, kv head, side) in one FP pass and recommend per-head widths (head_bits) "
                        "within --max-bits, counted by the planner for a float16 model at 32K tokens (default: the "
                        "base + 0.3); docs/python.md, \"Per-head widths\"")
    p.add_argument("--head-upgrade-bits", type=positive_int, default=4,
                   help="with --per-head: the width the most sensitive head-sides get (default 4)")
    add_calibration_args(p)
    p.add_argument("--write-config", default=None, type=output_path, help="write the recommended KiviConfig JSON here")
    add_suite_args(p, constraint=False)
    add_output_args(p)
    p.set_defaults(func=cmd_profile)

    p = subparsers.add_parser("tune", help="cheapest config within a quality (or bits) budget",
                              description="Measure candidates (uniform widths x group sizes x 0/4 sinks, per-head "
                                          "mixes from a profile of the windows after the tuning ones, per-layer "
                                          "mixes with --profile, position tiers with --bits-at eval) in order of "
                                          "increasing bits per element (planner, float16, 32K tokens by default) "
                                          "and pick the cheapest within --max-ppl-increase (or the best within "
                                          "--max-bits). docs/evaluation.md")
    add_model_args(p)
    add_text_args(p)
    add_window_args(p, windows=4)
    add_config_args(p)
    p.add_argument("--max-ppl-increase", default=None, type=text_value,
                   help="perplexity budget vs FP, e.g. 5%% (percent)")
    p.add_argument("--max-bits", type=positive_float, default=None, help="bits per element budget")
    add_suite_args(p)
    p.add_argument("--profile", default=None, type=text_value,
                   help="`kivi profile --json` output: adds per-layer candidates")
    p.add_argument("--candidates", nargs="*", default=None, type=text_value,
                   help="extra KiviConfig JSON files to consider")
    p.add_argument(
        "--bits-at",
        type=bits_at_arg,
        default=32768,
        help="rank and budget candidates by bits per element as the planner counts them for a float16 "
        "model at this many tokens (default 32k, where the window and sinks weigh little; "
        "byte-exact against cache.nbytes), "
        "or 'eval': what the cache held at the end of an evaluation window (model dtype; the FP window "
        "weighs a lot at 1K). Position tiers are searched only when bits are counted at no more than "
        "--context tokens (docs/evaluation.md)",
    )
    p.add_argument("--head-profile-windows", type=non_negative_int, default=2,
                   help="windows (the ones right after the tuning windows) of the per-head profile pass that "
                   "generates per-head candidates; 0 = no per-head candidates (default 2)")
    p.add_argument("--early-stop", type=early_stop_factor, default=2.0,
                   help="drop a candidate after a window once its Δppl so far exceeds this many times the "
                   "--max-ppl-increase budget (default 2; 0 = measure every window)")
    p.add_argument("--write-config", "--out", dest="write_config", default=None, type=output_path,
                   help="write the chosen KiviConfig JSON here (loadable by KiviConfig.from_json)")
    add_output_args(p)
    p.set_defaults(func=cmd_tune)
