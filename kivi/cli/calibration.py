"""`kivi profile --per-head --calibrate-on suite`: the options that make long-context suite prompts the per-head
profile's calibration text, their checks (before the model loads) and the prompts they build
(:mod:`kivi.eval.longctx.calibration`; docs/evaluation.md, "Per-head widths calibrated on the suite")."""

from __future__ import annotations

import argparse

from . import CliError
from .validators import non_negative_int, positive_int, token_count

CALIB_OPTIONS = ("--calib-length", "--calib-tasks", "--calib-samples", "--calib-seed")


def calibration_requested(args: argparse.Namespace) -> bool:
    """Whether `kivi profile` calibrates on suite prompts; checked before the model loads: that needs
    ``--per-head``, and the ``--calib-*`` options need it."""
    given = [o for o in CALIB_OPTIONS if getattr(args, o[2:].replace("-", "_")) is not None]
    if args.calibrate_on != "suite":
        if given:
            raise CliError(f"{given[0]} needs --calibrate-on suite (the profile reads --text windows)")
        return False
    if not args.per_head:
        raise CliError("--calibrate-on suite needs --per-head (the per-layer profile ranks by KL on --text windows)")
    return True


def calibration_prompts_from_args(args: argparse.Namespace, model, tok, text: str):
    """``(prompts, settings)``: the per-head profile's suite prompts
    (:func:`kivi.eval.longctx.calibration.calibration_prompts`) and the settings they were built with (the
    ``--calib-*`` options, defaults filled in: the JSON's ``calibration``); the context is checked first."""
    from ..eval.longctx import calibration as cal
    from ..eval.longctx.tasks import MAX_NEW_TOKENS
    from .loading import check_context_fits

    if tok is None:
        raise CliError(f"--calibrate-on suite: the suite's prompts need {args.model!r}'s tokenizer, which did not load")
    settings = {"on": "suite", "length": args.calib_length or cal.DEFAULT_LENGTH,
                "tasks": list(args.calib_tasks or cal.DEFAULT_TASKS),
                "samples": args.calib_samples or cal.DEFAULT_SAMPLES,
                "seed": cal.DEFAULT_SEED if args.calib_seed is None else args.calib_seed}
    longest = max(MAX_NEW_TOKENS[t] for t in settings["tasks"])
    check_context_fits(model, settings["length"] + longest, f"--calib-length {settings['length']} + a {longest}-token "
                                                            "answer")
    prompts = cal.calibration_prompts(model, tok, text, length=settings["length"], tasks=settings["tasks"],
                                      samples=settings["samples"], seed=settings["seed"], progress=not args.no_progress)
    return prompts, settings


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    """`kivi profile --per-head --calibrate-on suite` (docs/evaluation.md, "Per-head widths calibrated on the
    suite")."""
    from ..eval.longctx import calibration as cal
    from ..eval.longctx.tasks import TASKS

    p.add_argument("--calibrate-on", choices=["text", "suite"], default="text",
                   help="with --per-head: score head-sides on --text windows (default) or on long-context suite "
                        "prompts built from --text, where only the question and full precision's answer are scored "
                        "(the window options are then not read)")
    p.add_argument("--calib-length", type=token_count, default=None, metavar="TOKENS",
                   help=f"suite prompts' length before the answer (default {cal.DEFAULT_LENGTH})")
    p.add_argument("--calib-tasks", nargs="+", choices=list(TASKS), default=None, metavar="TASK",
                   help=f"suite tasks (default: {' '.join(cal.DEFAULT_TASKS)})")
    p.add_argument("--calib-samples", type=positive_int, default=None,
                   help=f"prompts per task, depths spread over 0-100%% (default {cal.DEFAULT_SAMPLES})")
    p.add_argument("--calib-seed", type=non_negative_int, default=None,
                   help=f"the prompts' seed (default {cal.DEFAULT_SEED}; `kivi eval longctx` samples seed 0, so a "
                        "config chosen here is judged on samples it did not see)")


__all__ = ["CALIB_OPTIONS", "add_calibration_args", "calibration_prompts_from_args", "calibration_requested"]
