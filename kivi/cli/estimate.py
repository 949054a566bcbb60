"""`kivi estimate`: KV-cache memory of a model at a context length, full precision vs KIVI."""

from __future__ import annotations

import argparse
from typing import Any

from ..memory.weights import WEIGHT_BITS
from . import CliError
from .options import add_config_args, config_from_args
from .output import print_json, print_rich
from .validators import byte_size, non_negative_float, output_path, positive_int, text_value, token_count

EPILOG = """examples:
  kivi estimate --num-layers 40 --num-kv-heads 40 --head-dim 128 --dtype float16 --context 128k
  kivi estimate --model smollm2 --context 8k --preset balanced --device-memory 24GiB
  kivi estimate --model meta-llama/Llama-3.1-8B --context 128k --batch 4 --device-memory 80GB --json
  kivi estimate --model smollm2 --context 8k --preset balanced --weight-bits 4   (weights + cache)
  kivi estimate --model smollm2 --context 8k --cache-budget 100MiB --write-config picked.json
      (the best-quality config whose cache fits 100 MiB at 8K tokens;
       docs/python.md, "Precision chosen from a byte budget")

Sizes: GB/MB are decimal (10^9/10^6), GiB/MiB and a bare G/M are binary. Contexts: 32768, 32k, 128K, 1m
(k = 1024 tokens)."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="KV-cache memory planner: FP vs KIVI bytes per token, totals, what fits in a device",
        description="How much memory the KV cache of a model takes at a context length, in full precision and "
        "with KIVI (codes, scales/zero-points, compensation, full-precision window, block reserve), the "
        "compression ratio, the weights' size, and the largest context / batch that fit in --device-memory. "
        "Reads only the model's configuration (no weights).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model (an alias / folder / .gguf / hub id, or an explicit shape)")
    m.add_argument(
        "--model",
        default=None,
        type=text_value,
        help="alias (smollm2), checkpoint folder, .gguf file or hub id (default: smollm2 unless a shape is given)",
    )
    m.add_argument("--num-layers", type=positive_int, default=None, help="decoder layers")
    m.add_argument(
        "--num-kv-heads", type=positive_int, default=None, help="key/value heads (MHA: = heads; GQA: fewer; MQA: 1)"
    )
    m.add_argument(
        "--num-heads", type=positive_int, default=None, help="query heads (optional, for the MHA/GQA/MQA label)"
    )
    m.add_argument("--head-dim", type=positive_int, default=None, help="channels per head")
    m.add_argument("--sliding-window", type=positive_int, default=None,
                   help="with an explicit shape: sliding window of the sliding layers (see --sliding-layers)")
    m.add_argument("--sliding-layers", default=None, type=text_value,
                   help="with an explicit shape: which layers use the sliding window, 'all' or a pattern "
                   "'N:M' = N sliding layers then M full ones, repeated (Gemma 3: 5:1)")
    m.add_argument(
        "--params", type=non_negative_float, default=None, help="weight parameters (e.g. 13e9) for the fit computation"
    )
    m.add_argument("--weights-bytes", default=None, type=byte_size, help="weight bytes instead of --params (e.g. 26GB)")
    m.add_argument("--weight-bits", type=int, default=None, choices=WEIGHT_BITS,
                   help="plan the weights as `--weight-bits` loads them: 16 = the model dtype, 8 / 4 = optimum-quanto "
                   "qint8 / qint4 linear layers (codes + scales); needs a model, not an explicit shape "
                   "(default: params x dtype, or --weights-bytes)")
    m.add_argument("--dtype", default=None, type=text_value,
                   help="cache dtype: float16 | bfloat16 | float32 (default: the model's; float16 for a shape)")
    w = p.add_argument_group("workload")
    w.add_argument("--context", default=None, type=token_count,
                   help="tokens per sequence: 32768, 32k, 128K, 1m (default: the model's maximum)")
    w.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    w.add_argument("--prefill", default=None, type=token_count,
                   help="tokens of the first forward; the rest is decoded one by one (default: the whole context)")
    w.add_argument(
        "--device-memory", default=None, type=byte_size, help="accelerator memory, e.g. 80GB, 80GiB, 24G, 16000MB"
    )
    w.add_argument("--ignore-max-context", action="store_true",
                   help="plan a context longer than the model's max_position_embeddings anyway")
    b = p.add_argument_group("precision from a budget (docs/python.md, \"Precision chosen from a byte budget\")")
    b.add_argument("--cache-budget", default=None, type=byte_size,
                   help="bytes for the KV cache alone (e.g. 2GiB): pick the best-quality config whose cache fits at "
                   "--context x --batch (presets high > balanced > K2V2+4 sinks > extreme > K2V2 G64, measured order), "
                   "then show its estimate")
    b.add_argument("--full-precision-first", action="store_true",
                   help="with --cache-budget: full precision as long as the budget allows (quantize_after = the most "
                        "tokens a full-precision cache holds in it), the picked config after that")
    b.add_argument("--write-config", default=None, type=output_path,
                   help="with --cache-budget: write the picked KiviConfig JSON here (for --config of every command)")
    add_config_args(p)
    p.add_argument("--block-size", type=int, default=None, help="KiviConfig.block_size (tokens per storage block)")
    p.add_argument("--scale-dtype", default=None, type=text_value,
                   help="KiviConfig.scale_dtype: auto | float16 | bfloat16 | float32")
    p.add_argument("--per-layer", action="store_true", help="also list every layer")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


def _parse_sliding(pattern: str, n_layers: int) -> list[str]:
    if pattern == "all":
        return ["sliding_attention"] * n_layers
    try:
        a, b = (int(x) for x in pattern.split(":"))
        if a < 0 or b < 0 or a + b == 0:
            raise ValueError
    except ValueError:
        raise CliError(f"--sliding-layers {pattern!r} is not 'all' or 'N:M' (N sliding then M full layers)") from None
    cycle = ["sliding_attention"] * a + ["full_attention"] * b
    return [cycle[i % len(cycle)] for i in range(n_layers)]


def build_spec(args: argparse.Namespace) -> Any:
    from ..memory import ModelSpec, model_spec

    shape = {"num_layers": args.num_layers, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    given = {k for k, v in shape.items() if v is not None}
    if given and args.model:
        raise CliError("give either --model or an explicit shape (--num-layers --num-kv-heads --head-dim), not both")
    if given:
        missing = [f"--{k.replace('_', '-')}" for k in shape if shape[k] is None]
        if missing:
            raise CliError(f"an explicit shape also needs {' '.join(missing)}")
        layer_types = None
        if args.sliding_layers or args.sliding_window:
            if not (args.sliding_layers and args.sliding_window):
                raise CliError("--sliding-window and --sliding-layers go together")
            layer_types = _parse_sliding(args.sliding_layers, args.num_layers)
        params = int(args.params) if args.params is not None else None
        return ModelSpec(
            **shape, dtype=args.dtype or "float16", num_heads=args.num_heads, layer_types=layer_types,
            sliding_window=args.sliding_window, params=params, weights_bytes=args.weights_bytes,
        )
    for opt in ("num_heads", "sliding_window", "sliding_layers"):
        if getattr(args, opt) is not None:
            raise CliError(f"--{opt.replace('_', '-')} only goes with an explicit shape (--num-layers ...)")
    spec = model_spec(args.model or "smollm2", dtype=args.dtype)
    if args.params is not None:
        spec.params = int(args.params)
    if args.weights_bytes:
        spec.weights_bytes = args.weights_bytes
    return spec


def _config(args: argparse.Namespace):
    from ..config import KiviConfig

    cfg = config_from_args(args) or KiviConfig()
    extra = {}
    if args.block_size is not None:
        extra["block_size"] = args.block_size
    if args.scale_dtype is not None:
        extra["scale_dtype"] = args.scale_dtype
    if extra:
        cfg = KiviConfig.from_dict({**cfg.to_dict(), **extra})
    return cfg


def _layer_groups(layers: list[dict]) -> list[str]:
    """'K4 V4 (full): layers 0-3, 8' lines, one per distinct layer kind."""
    def desc(layer: dict) -> str:
        k = f"K{layer['k_bits']}" if layer["k_bits"] is not None else "Kfp"
        v = f"V{layer['v_bits']}" if layer["v_bits"] is not None else "Vfp"
        return f"{k} {v} ({'sliding window' if layer['type'] == 'sliding_attention' else 'full attention'})"
    kinds: dict[str, list[int]] = {}
    for layer in layers:
        kinds.setdefault(desc(layer), []).append(layer["layer"])
    out = []
    for kind, idx in kinds.items():
        ranges, start = [], idx[0]
        for a, b in zip(idx, idx[1:] + [None]):
            if b != a + 1:
                ranges.append(f"{start}" if a == start else f"{start}-{a}")
                start = b
        out.append(f"{kind}: {len(idx)} layers ({', '.join(ranges)})")
    return out


def _fmt(n: float | None) -> str:
    from ..memory import format_bytes

    if n is None:
        return "-"
    return f"{format_bytes(n)}  ({int(round(n)):,} B)"


def _per(n: float) -> str:
    return f"{n:,.2f} B" if n != int(n) else f"{int(n):,} B"


def render(e: Any, *, per_layer: bool = False) -> None:
    import torch

    from ..cache.schedule import KEY_AXIS, VALUE_AXIS, side_tokens
    from ..config import KiviConfig
    from ..memory import DTYPE_BYTES

    heads = f"{e.num_heads} heads / " if e.num_heads else ""
    print(f"Model: {e.model} — {e.num_layers} layers, {heads}{e.num_kv_heads} KV heads ({e.attention}), "
          f"head_dim {e.head_dim}, cache dtype {e.dtype}")
    cfg = e.config
    scales = KiviConfig.from_dict(cfg).side_format("k").param_dtype(getattr(torch, e.dtype))
    sd = str(scales).removeprefix("torch.")
    print(f"Context {e.context:,} tokens x batch {e.batch}; KIVI {e.config_description} "
          f"(scales/zero-points in {sd}, block_size {cfg['block_size']})")
    if cfg["layer_specific_config"] or e.sliding_layers:
        for line in _layer_groups(e.layers):
            print(f"  {line}")
    rows: list[tuple[str, str, str]] = []
    b = e.kivi_breakdown
    pt = e.kivi_per_token_breakdown
    fp_name = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}[e.dtype]
    R, G = cfg["residual_length"], cfg["group_size"]
    S, Q = cfg.get("sink_tokens", 0), cfg.get("quantize_after", 0)
    sink, _, key_window = side_tokens(KEY_AXIS, e.context, R, G, S, quantize_after=Q)
    value_window = side_tokens(VALUE_AXIS, e.context, R, G, S, quantize_after=Q)[2]
    rows.append((f"{fp_name} cache (2 x layers x kv_heads x head_dim x {DTYPE_BYTES[e.dtype]} B)",
                 _per(e.fp_bytes_per_token) + " x batch", _fmt(e.fp_total_bytes)))
    rows.append(("KIVI codes (bit-packed)", _per(pt["codes"]), _fmt(b["codes"])))
    rows.append(("KIVI scales + zero-points", _per(pt["scales_zero_points"]), _fmt(b["scales_zero_points"])))
    rows.append(("KIVI error compensation", _per(pt["compensation"]), _fmt(b["compensation"])))
    if b["fp_unquantized"] or pt["fp_unquantized"]:
        rows.append(("KIVI unquantized sides / layers", _per(pt["fp_unquantized"]), _fmt(b["fp_unquantized"])))
    rows.append((f"KIVI full-precision window (V {value_window}, K {key_window} tokens)", "-", _fmt(b["fp_window"])))
    if b["fp_sink"]:
        rows.append((f"KIVI full-precision sink tokens (first {sink})", "-", _fmt(b["fp_sink"])))
    rows.append(("KIVI block reserve (allocated, not yet written)", "-", _fmt(b["block_reserve"])))
    rows.append(("KIVI total", _per(e.kivi_bytes_per_token) + " x batch", _fmt(e.kivi_total_bytes)))
    rows.append(("compression ratio (FP / KIVI)", f"{e.asymptotic_compression_ratio:.2f}x",
                 f"{e.compression_ratio:.2f}x"))
    if e.weights_bytes is not None:
        params = f"{e.weights_params / 1e9:.3g} B params" if e.weights_params else "-"
        kind = {None: "", 16: f" ({e.dtype})", 8: " (int8 linear layers, quanto)", 4: " (int4 linear layers, quanto)"}
        rows.append((f"weights{kind[e.weight_bits]}", params, _fmt(e.weights_bytes)))
        if e.weights_breakdown and e.weight_bits != 16:
            wb = e.weights_breakdown
            rows.append(("  quantized linear layers: codes", "-", _fmt(wb["codes"])))
            rows.append(("  quantized linear layers: scales + shifts", "-", _fmt(wb["scales"])))
            rows.append((f"  left in {e.dtype} (embeddings, norms, lm_head)", "-", _fmt(wb["float"])))
        rows.append((f"total: weights + {fp_name} cache", "-", _fmt(e.total_fp_bytes)))
        rows.append(("total: weights + KIVI cache", "-", _fmt(e.total_kivi_bytes)))
    _table(rows, ("", "per token", f"total ({e.context:,} tokens x {e.batch})"))
    if e.device_memory is not None:
        print(f"Device memory {_fmt(e.device_memory)}, minus weights {_fmt(e.weights_bytes or 0)}:")
        print(
            f"  largest context at batch {e.batch}:  FP {e.fp_max_context:,} tokens   "
            f"KIVI {e.kivi_max_context:,} tokens"
        )
        print(f"  largest batch at {e.context:,} tokens:  FP {e.fp_max_batch:,}   KIVI {e.kivi_max_batch:,}")
    if per_layer:
        _table(
            [(str(ly["layer"]), ly["type"], f"K{ly['k_bits']} V{ly['v_bits']}  {ly['bytes']:,} B") for ly in e.layers],
            ("layer", "type", "KIVI bytes"),
        )
    for n in e.notes:
        print(f"note: {n}")


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    try:
        from rich.table import Table
    except ImportError:  # plain text
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        return
    t = Table(*header, show_lines=False)
    for c in t.columns[1:]:
        c.justify = "right"
    for r in rows:
        t.add_row(*r, style="bold" if r[0].startswith(("KIVI total", "compression")) else None)
    print_rich(t, width=120)


def run(args: argparse.Namespace) -> int:
    from ..memory import estimate_kv_memory

    cfg = _config(args)  # options and files first: nothing is read before they are valid
    if args.cache_budget is not None and config_from_args(args) is not None:
        raise CliError("give either --cache-budget (kivi picks the config) or KIVI options (--preset/--config/"
                       "--k-bits ...), not both")
    if args.write_config and args.cache_budget is None:
        raise CliError("--write-config goes with --cache-budget (it writes the picked config)")
    if args.full_precision_first and args.cache_budget is None:
        raise CliError("--full-precision-first goes with --cache-budget (it sets how long the budget allows "
                       "full precision)")
    spec = build_spec(args)
    if args.context is None:
        if not spec.max_context:
            raise CliError("--context is required (e.g. --context 32k) when the model's maximum context is unknown")
        context = spec.max_context
    else:
        context = args.context
    if spec.max_context and context > spec.max_context and not args.ignore_max_context:
        raise CliError(
            f"--context {context:,} is longer than {spec.name} supports ({spec.max_context:,} tokens, "
            "max_position_embeddings); add --ignore-max-context to plan it anyway"
        )
    if args.prefill is not None and args.prefill > context:
        raise CliError(f"--prefill {args.prefill:,} is longer than the context ({context:,} tokens)")
    pick = None
    if args.cache_budget is not None:
        from ..config import KiviConfig
        from ..memory.budget import config_for_budget, default_candidates

        extra = {k: v for k, v in (("block_size", args.block_size), ("scale_dtype", args.scale_dtype)) if v is not None}
        cands = [(n, KiviConfig.from_dict({**c.to_dict(), **extra})) for n, c in default_candidates()]
        pick = config_for_budget(spec, args.cache_budget, context, args.batch, cands, prefill=args.prefill,
                                 full_precision_first=args.full_precision_first)
        cfg = pick.config
    est = estimate_kv_memory(spec, context, batch=args.batch, config=cfg,
                             device_memory=args.device_memory, prefill=args.prefill, weight_bits=args.weight_bits)
    failed = []
    if pick is not None and args.write_config:  # written first: the file exists whatever happens to stdout
        from .output import write_outputs

        failed = write_outputs([("--write-config", args.write_config, pick.config.to_json)])
    if args.json:
        d = est.to_dict()
        if not args.per_layer:
            d.pop("layers")
        if pick is not None:
            d["budget_pick"] = pick.to_dict()
        print_json(d)
    else:
        if pick is not None:
            render_pick(pick)
        render(est, per_layer=args.per_layer)
    if pick is not None and args.write_config:
        if failed:
            raise CliError("; ".join(failed))
        if not args.json:
            print(f"wrote {args.write_config}")
    return 0


def render_pick(pick: Any, file: Any = None) -> None:
    """What --cache-budget chose and why (every candidate with its need), before the estimate table
    (``file``: stdout unless given; ``kivi generate`` prints it on stderr)."""
    for line in pick_lines(pick):
        print(line, file=file)


def pick_lines(pick: Any) -> list[str]:
    """The lines of :func:`render_pick`."""
    from ..memory import format_bytes

    lines = [f"Budget {format_bytes(pick.budget_bytes)} for a {pick.context:,}-token cache x batch {pick.batch}: "
             f"picked {pick.name} ({pick.config.describe()}), needs {format_bytes(pick.need_bytes)} "
             f"({pick.need_bytes:,} B)"]
    for c in pick.considered:
        if "invalid" in c:
            lines.append(f"  {c['name']:14s} not usable here: {c['invalid']}")
        else:
            mark = "fits" if c["fits"] else "too large"
            lines.append(f"  {c['name']:14s} {format_bytes(c['need_bytes']):>11s}  {mark}")
    if pick.config.quantize_after:
        n = pick.config.quantize_after
        lines.append(f"full precision first: the cache stays in full precision up to {n:,} tokens "
                     f"({'the whole request' if n >= pick.context else 'then KIVI'}), the most the budget allows")
    elif pick.fp_fits:
        lines.append(f"note: the full-precision cache ({format_bytes(pick.fp_bytes)}) fits this budget too; "
                     "KIVI is not needed for memory here")
    return lines
