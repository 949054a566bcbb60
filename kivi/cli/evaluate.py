"""`kivi eval ppl|kld|passkey` and `kivi sweep`: measure caches on a model and a text."""

from __future__ import annotations

import argparse

from .loading import check_context_fits, load_model_and_windows, load_model_from_args
from .options import (
    add_config_args,
    add_model_args,
    add_output_args,
    add_text_args,
    add_window_args,
    config_from_args,
    load_config_file,
)
from .output import emit
from .validators import fraction_list, int_list, output_path, positive_int, text_value


# ---------------------------------------------------------------------------- options of eval / sweep only
def add_baseline_arg(p: argparse.ArgumentParser) -> None:
    from ..eval.caches import BASELINES

    p.add_argument(
        "--baseline", default=None, type=text_value,
        help=f"evaluate a baseline cache instead of KIVI: one of {list(BASELINES)}"
    )


def spec_from_args(args: argparse.Namespace, *, default_fp: bool = False):
    """The cache spec of the options: --baseline NAME, a KIVI config, or FP / the default config."""
    from ..config import KiviConfig
    from ..eval.caches import check_spec

    cfg = config_from_args(args)
    base = getattr(args, "baseline", None)
    if base:
        if cfg is not None:
            raise ValueError("give either --baseline or KIVI options (--preset/--config/--k-bits ...), not both")
        return check_spec(base)
    if cfg is None:
        return None if default_fp else KiviConfig()
    return cfg


# ---------------------------------------------------------------------------- eval ppl / kld
def cmd_ppl(args: argparse.Namespace) -> int:
    from ..eval import perplexity

    spec = spec_from_args(args, default_fp=True)
    model, tok, windows = load_model_and_windows(args)
    r = perplexity(model, tok, windows, spec, prefix=args.prefix, chunk=args.chunk, progress=not args.no_progress,
                   batch_size=args.batch_size, fast=not args.reference_eval)
    emit(args, r, f"{r['name']}: ppl {r['ppl']:.4f} over {r['tokens_scored']} tokens ({r['windows']} windows); "
                  f"{r['bits_per_element']:.3f} bits/element, {r['cache_bytes']} cache bytes per window")
    return 0


def cmd_kld(args: argparse.Namespace) -> int:
    from ..eval import kl_divergence

    spec = spec_from_args(args)
    model, tok, windows = load_model_and_windows(args)
    r = kl_divergence(model, tok, windows, spec, prefix=args.prefix, chunk=args.chunk, progress=not args.no_progress,
                      batch_size=args.batch_size, fast=not args.reference_eval)
    emit(args, r, f"{r['name']}: KL {r['kl']:.5f} nats/token, top-1 agreement {100 * r['top1_agreement']:.2f}%, "
                  f"ppl {r['ppl']:.4f} vs FP {r['ppl_fp']:.4f} ({r['delta_ppl_pct']:+.2f}%), "
                  f"{r['bits_per_element']:.3f} bits/element")
    return 0


# ---------------------------------------------------------------------------- eval passkey
def cmd_passkey(args: argparse.Namespace) -> int:
    from ..eval.passkey import passkey
    specs: list = []
    if not args.no_fp:
        specs.append(None)
    cfg = config_from_args(args)
    if cfg is not None:
        specs.append(cfg)
    for p in _list_arg(args.presets):
        from ..config import KiviConfig

        specs.append(KiviConfig.preset(p))
    for b in _list_arg(args.baseline):
        from ..eval.caches import check_spec

        specs.append(check_spec(b))
    if not specs:
        raise ValueError("nothing to evaluate: drop --no-fp or give --preset/--presets/--baseline/--k-bits ...")
    lengths, depths = args.lengths, args.depths  # checked by their argparse types, before the model loads
    model, tok = load_model_from_args(args)
    check_context_fits(model, max(lengths) + args.max_new_tokens, f"--lengths {max(lengths)} + --max-new-tokens")
    r = passkey(model, tok, specs, lengths=lengths, depths=depths, seeds=args.seeds,
                max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    lines = []
    for x in r["results"]:
        if "unavailable" in x:
            lines.append(f"{x['name']}: unavailable: {x['unavailable']}")
        else:
            by = ", ".join(f"{k}: {100 * v:.0f}%" for k, v in x["by_length"].items())
            lines.append(f"{x['name']}: accuracy {100 * x['accuracy']:.0f}% ({by})")
    emit(args, r, "\n".join(lines))
    return 0


def _list_arg(v: str | None) -> list[str]:
    return [x.strip() for x in str(v).split(",") if x.strip()] if v else []


# ---------------------------------------------------------------------------- sweep
def cmd_sweep(args: argparse.Namespace) -> int:
    from ..config import KiviConfig
    from ..eval.caches import check_spec
    from ..eval.report import pareto_plot, write_rows
    from ..eval.sweep import default_grid, sweep

    specs: list = []
    if args.grid == "default":
        specs = default_grid(include_baselines=not args.no_baselines)
    for p in _list_arg(args.presets):
        specs.append(KiviConfig.preset(p))
    for f in args.configs or []:
        specs.append(load_config_file(f, "--configs"))
    if not args.no_baselines and args.grid != "default":
        specs += [check_spec(b) for b in _list_arg(args.baselines)]
    if not specs:
        raise ValueError("empty sweep: use --grid default, --presets, --configs or --baselines")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    model, tok, windows = load_model_and_windows(args)
    rows = sweep(model, tok, windows, specs, prefix=args.prefix, chunk=args.chunk, batch_size=args.batch_size,
                 passkey_lengths=args.passkey or (), progress=not args.no_progress, fast=not args.reference_eval)
    title = f"{args.model}: {windows.shape[0]} x {args.context} tokens, prefix {args.prefix}, chunk {args.chunk}"
    writes = [("--csv", args.csv, lambda p: write_rows(rows, p)),
              ("--plot", args.plot, lambda p: pareto_plot(rows, p, title=title))]
    table = [f"{'name':32s} {'bits':>7s} {'ppl':>9s} {'dppl%':>8s} {'KL':>9s} {'top1%':>6s}"]
    for r in rows:
        if r.get("unavailable"):
            table.append(f"{r['name']:32s} unavailable: {r['unavailable']}")
            continue
        table.append(f"{r['name']:32s} {r['bits_per_element']:7.3f} {r['ppl']:9.4f} {r['delta_ppl_pct']:+8.2f} "
                     f"{r['kl']:9.5f} {100 * r['top1_agreement']:6.2f}")
    emit(args, {"rows": rows}, "\n".join(table), writes=writes)
    return 0


# ---------------------------------------------------------------------------- registration
def _common(p: argparse.ArgumentParser, *, windows: int = 20, baseline: bool = True) -> None:
    add_model_args(p)
    add_text_args(p)
    add_window_args(p, windows=windows)
    add_config_args(p)
    if baseline:
        add_baseline_arg(p)
    add_output_args(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser("eval", help="perplexity, KL vs full precision, passkey retrieval",
                               description="Evaluate a KV cache (KIVI config, FP or a baseline) on a model.")
    evs = ev.add_subparsers(dest="eval_command", metavar="WHAT")
    ev.set_defaults(func=lambda a: (ev.print_help(), 2)[1])

    p = evs.add_parser("ppl", help="streaming perplexity through the cache (no KIVI option = FP DynamicCache)")
    _common(p)
    p.set_defaults(func=cmd_ppl)

    p = evs.add_parser("kld", help="KL divergence and top-1 agreement vs the FP cache (default config: KiviConfig())")
    _common(p)
    p.set_defaults(func=cmd_kld)

    p = evs.add_parser("passkey", help="passkey retrieval accuracy (FP always included unless --no-fp)")
    add_model_args(p)
    add_config_args(p)
    p.add_argument("--presets", default=None, type=text_value,
                   help="comma-separated presets to add, e.g. high,extreme")
    p.add_argument("--baseline", default=None, type=text_value,
                   help="comma-separated baselines to add, e.g. quanto-int2")
    p.add_argument("--lengths", default=[1024, 2048, 4096], type=int_list,
                   help="prompt lengths in tokens (default: 1024,2048,4096)")
    p.add_argument("--depths", default=[0.1, 0.5, 0.9], type=fraction_list,
                   help="needle depth fractions (default: 0.1,0.5,0.9)")
    p.add_argument("--seeds", type=positive_int, default=3, help="random keys per (length, depth) (default: 3)")
    p.add_argument("--max-new-tokens", type=positive_int, default=12, help="tokens generated per prompt (default 12)")
    p.add_argument("--no-fp", action="store_true", help="skip the FP reference")
    add_output_args(p)
    p.set_defaults(func=cmd_passkey)

    from .eval_attribute import add_parser as add_attribute
    from .eval_longctx import add_parser as add_longctx

    add_longctx(evs)
    add_attribute(evs)

    p = subparsers.add_parser("sweep", help="run a grid of configs and baselines; CSV/JSON rows, Pareto plot",
                              description="Evaluate many caches on the same windows (one FP reference per window).")
    add_model_args(p)
    add_text_args(p)
    add_window_args(p, windows=8)
    p.add_argument("--grid", default="default", choices=["default", "none"],
                   help="'default': presets, 2-bit variants, quanto baselines; 'none': only what you list")
    p.add_argument("--presets", default=None, type=text_value, help="comma-separated presets to add")
    p.add_argument("--configs", nargs="*", default=None, type=text_value, help="KiviConfig JSON files to add")
    p.add_argument("--baselines", default="quanto-int4,quanto-int2,quanto-int2-perchannel", type=text_value,
                   help="comma-separated baselines (with --grid none)")
    p.add_argument("--no-baselines", action="store_true", help="no quanto baselines")
    p.add_argument(
        "--passkey", default=None, type=int_list, help="also passkey accuracy at these lengths, e.g. 1024,2048"
    )
    p.add_argument("--csv", default=None, type=output_path, help="write the rows as CSV")
    p.add_argument(
        "--plot", default=None, type=output_path, help="write a Pareto plot (PNG) of Δppl vs bits per element"
    )
    add_output_args(p)
    p.set_defaults(func=cmd_sweep)
