"""Serving throughput in a fixed cache budget: transformers' continuous batching with its float paged cache vs
KIVI pages (2/2 and ``balanced``), and the same requests served one at a time by ``generate()``.

Every continuous-batching row gets the same byte budget (each of ``--budgets``; by default what the float
cache needs to hold ``--fp-requests`` of the longest requests at once, also written ``fp:N``) and the same
requests, all submitted at once, greedy, no EOS; ``--rows NAME@BUDGET`` runs a row at its own budget only,
so one run (same load, same-run ratios) can hold a tight and a roomy budget. Workloads:

* ``uniform``: ``--requests`` random-id prompts of ``--prompt-len`` tokens (independent, or
  ``--shared-prefix F``: the first ``F`` of every prompt is one common prefix), ``--new-tokens`` each;
* ``decode-heavy``: ``--requests`` prompts of WikiText-2 text with lengths spread over ``--prompt-range``
  and new tokens over ``--new-range`` (default 512-4096 and 128-256), more requests than the default
  budget's float pages hold.

``--baselines dynamic kivi-2/2`` adds the one-at-a-time rows: each request through ``model.generate()``
(DynamicCache, or a ``quantize_model``-ed model), one after another, all counted as submitted at the start.
Columns: generated tokens/s (the headline), tokens/s with the prompts, p50/p95 time to first token,
p50/p95 per-token latency (a request's decode time / its tokens after the first), requests held at once
(sampled every 20 ms) and the budget's capacity for the longest request, the largest dequantized transient
of one layer (materialized KIVI rows), prompt tokens served from shared pages. ``--max-batch-tokens`` and
``--scheduler`` take several values: every row runs under each (default: kivi's defaults). Each row runs in
a fresh process (``--same-process``: all in this one). ``--plot F.png``: generated tokens/s vs budget.

``--http ROW[@BUDGET]`` adds rows served over HTTP by ``kivi serve`` (``serving_http.py``: a fresh server
subprocess, ``--http-clients`` concurrent streaming clients, tokens counted from each response's usage and
checked equal to the request's). ``--kivi-root-before DIR`` runs every batch and HTTP row a second time with
kivi imported from the checkout ``DIR`` (a before/after comparison in one run).

    OMP_NUM_THREADS=2 python benchmarks/bench_serving.py --model smollm2 --workload decode-heavy --requests 12 \\
        --budgets 400MiB 800MiB 1600MiB --baselines dynamic kivi-2/2 --threads 2 \\
        --out results/serving/serving_decode_heavy_smollm2.json --plot results/serving/serving_decode_heavy_smollm2.png
    OMP_NUM_THREADS=1 python benchmarks/bench_serving.py --model smollm2 --requests 16 --prompt-len 1024 \\
        --new-tokens 64 --fp-requests 4 --threads 1 --out results/serving/serving_smollm2.json
    OMP_NUM_THREADS=2 python benchmarks/bench_serving.py --model smollm2 --requests 8 --prompt-len 512 \\
        --new-tokens 128 --shared-prefix 0 --threads 2 --check-single 0 --baselines kivi-2/2 \\
        --rows kivi-2/2@1GiB float@fp:2 kivi-2/2@fp:2 float@1GiB --http kivi-2/2@1GiB float@1GiB \\
        --out results/serving/serving_8x512_128.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

#: the checkout whose kivi a row imports (``--kivi-root-before`` sets it in a row's fresh process)
KIVI_ROOT_ENV = "KIVI_ROOT"  # as benchmarks/profile_serving.py reads it
sys.path.insert(0, os.environ.get(KIVI_ROOT_ENV) or str(Path(__file__).resolve().parent.parent))

from common import command_line, environment, run_fresh, set_threads, write_json, write_text_file  # noqa: E402
from kivi.batching import build_layout, fp_block_bytes, generate_batch  # noqa: E402
from kivi.memory.units import parse_bytes  # noqa: E402
from serving_http import SERVER_PAGE_SIZE, http_row, serve_features  # noqa: E402
from serving_report import format_table, plot_budgets  # noqa: E402
from serving_rows import (  # noqa: E402
    BASELINES,
    ROWS,
    Workload,
    batch_row,
    decode_heavy,
    generate_row,
    identical,
    uniform,
)

DEFAULT_ROWS = ["float", "kivi-2/2", "balanced"]


class FloatNeeds(NamedTuple):
    """A budget named by what it holds: the bytes float pages need for ``requests`` of the longest requests."""

    requests: int

    def __str__(self) -> str:
        return f"fp:{self.requests}"


def budget_arg(text: str) -> int | FloatNeeds:
    """A budget: bytes (``67MiB``, ``1GiB``, a byte count) or ``fp:N`` (what float pages need for N of the
    workload's longest requests)."""
    if text.startswith("fp:"):
        n = text[3:]
        if not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: fp:N needs a whole number N >= 1 of requests")
        return FloatNeeds(int(n))
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; or fp:N (what float pages need for N requests)") from None


def row_arg(text: str) -> tuple[str, int | FloatNeeds | None]:
    """``NAME`` (a row run at every ``--budgets`` value) or ``NAME@BUDGET`` (that row at that budget only)."""
    name, at, budget = text.partition("@")
    if name not in ROWS:
        raise argparse.ArgumentTypeError(f"{text!r}: the row must be one of {', '.join(ROWS)} (optionally @BUDGET)")
    if at and not budget:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME@BUDGET needs a budget after @ (1GiB, fp:2)")
    return name, budget_arg(budget) if at else None


def _model(name: str):
    """``(model, tokenizer or None, vocab size)``: ``tiny`` is a random 4-layer model without a tokenizer; any other
    name is what ``kivi.load_model`` takes (an alias, a checkpoint folder)."""
    if name == "tiny":
        from tests.helpers import tiny_model

        return tiny_model(num_hidden_layers=4), None, 128
    from kivi.models import load_model

    model, tok = load_model(name)
    return model, tok, model.config.vocab_size


def workloads(args, tok, vocab: int) -> list[Workload]:
    """The request sets of this run (the same in every process: deterministic from the arguments)."""
    if args.workload == "uniform":
        return [uniform(args.requests, args.prompt_len, args.new_tokens, f, vocab, args.seed)
                for f in args.shared_prefix]
    ids = None
    if tok is not None:
        from kivi.data import load_text, token_ids

        ids = token_ids(tok, load_text()).tolist()
    return [decode_heavy(args.requests, tuple(args.prompt_range), tuple(args.new_range), ids, vocab, args.seed)]


def settings(args) -> list[dict]:
    """The scheduler settings every batch row runs under (an empty dict: kivi's defaults)."""
    out = []
    for mbt, sched in itertools.product(args.max_batch_tokens or [None], args.scheduler or [None]):
        out.append({k: v for k, v in (("max_batch_tokens", mbt), ("scheduler_type", sched)) if v is not None})
    return out


def float_needs(args, model, work: Workload, requests: int) -> int:
    """Bytes of float pages that hold ``requests`` of the workload's longest requests."""
    text = model.config.get_text_config()
    longest = max(len(p) + n for p, n in zip(work.prompts, work.new_tokens))
    return requests * -(-longest // args.page_size) * fp_block_bytes(text, model.dtype, args.page_size)


def row_plan(args, model, work: Workload) -> list[tuple[str, str, int]]:
    """``(kind, row, budget bytes)`` of every batch (``--rows``) and HTTP (``--http``) row, in run order: the rows
    without a budget of their own at each ``--budgets`` value (budget by budget), then those with one."""
    default = [args.cache_memory] if args.cache_memory else [FloatNeeds(args.fp_requests)]
    budgets = args.budgets or default
    resolve = lambda b: float_needs(args, model, work, b.requests) if isinstance(b, FloatNeeds) else b  # noqa: E731
    plan = []
    for kind, rows in (("batch", args.rows), ("http", args.http)):
        plan += [(kind, name, resolve(b)) for b in budgets for name, own in rows if own is None]
        plan += [(kind, name, resolve(own)) for name, own in rows if own is not None]
    return plan


def run_one(args, spec: dict) -> dict:
    """One row in this process: ``spec`` names the kind (``batch`` / ``generate``), row, workload and budget."""
    import kivi

    seconds = set_threads(args.threads)
    from kivi.quant.fused_cpu import warmup as warm_quant

    warm_quant()
    model, tok, vocab = _model(args.model)
    if args.float_attention and spec["kind"] == "batch" and ROWS[spec["row"]] is None:
        model.set_attn_implementation(args.float_attention)
    work = next(w for w in workloads(args, tok, vocab) if w.name == spec["workload"])
    short = Workload("warmup", [work.prompts[0][: min(len(work.prompts[0]), 300)]], [3])
    if spec["kind"] == "generate":
        cfg = (ROWS if spec.get("table") == "rows" else BASELINES)[spec["row"]]
        generate_row(model, cfg, short)  # first-call overheads out of the timed run
        row = generate_row(model, cfg, work, spec.get("limit"))
    else:
        cb = {"page_size": args.page_size, **spec["settings"]}
        generate_batch(model, short.prompts, ROWS[spec["row"]], cache_memory=spec["budget"], max_new_tokens=3, **cb)
        row = batch_row(model, ROWS[spec["row"]], work, spec["budget"], cb)
    row["kernel_load_s"] = seconds
    row["kivi_path"] = os.path.dirname(kivi.__file__)
    return row


def run(args, argv: list[str], spec: dict) -> dict:
    """A row in a fresh process (this script with ``--child SPEC``), or here with ``--same-process``."""
    if args.same_process:
        return run_one(args, spec)
    env = {KIVI_ROOT_ENV: spec["kivi_root"]} if spec.get("kivi_root") else {KIVI_ROOT_ENV: ""}
    child = run_fresh([__file__, *argv, "--child", json.dumps(spec)], env=env, timeout=args.row_timeout)
    if child.returncode != 0 or child.result is None:
        raise RuntimeError(f"row {spec} failed (exit {child.returncode}):\n{child.stderr}")
    return child.result


def capacity_table(model_config, at: int, budget: int, page: int) -> dict:
    fp16 = (budget // fp_block_bytes(model_config, torch.float16, page)) // -(-at // page)
    out = {"float16": fp16}
    for name, cfg in ROWS.items():
        if cfg is not None:
            out[name] = build_layout(model_config, cfg, page, torch.float16).requests_that_fit(budget, at)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (embedded GGUF) or 'tiny' (random, for a smoke run)")
    ap.add_argument("--workload", choices=("uniform", "decode-heavy"), default="uniform")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024, help="uniform: tokens of every prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="uniform: new tokens of every request")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[512, 4096], metavar=("MIN", "MAX"),
                    help="decode-heavy: prompt lengths, spread evenly over [MIN, MAX]")
    ap.add_argument("--new-range", type=int, nargs=2, default=[128, 256], metavar=("MIN", "MAX"),
                    help="decode-heavy: new tokens per request, spread evenly over [MIN, MAX]")
    ap.add_argument("--fp-requests", type=int, default=4,
                    help="default budget: bytes the float cache needs to hold this many of the longest requests "
                    "(the same as --budgets fp:N)")
    ap.add_argument("--cache-memory", type=parse_bytes, default=None, help="one budget (same as --budgets B)")
    ap.add_argument("--budgets", type=budget_arg, nargs="+", default=None,
                    help="budgets to sweep: bytes (64MiB, 1GiB) or fp:N, what float pages need for N of the longest "
                    "requests (overrides --fp-requests); every row without @BUDGET runs at each")
    ap.add_argument("--shared-prefix", type=float, nargs="+", default=[0.0, 0.75],
                    help="uniform: fractions of every prompt that are one common prefix; one variant each")
    ap.add_argument("--rows", nargs="*", type=row_arg, default=[(r, None) for r in DEFAULT_ROWS],
                    metavar="ROW[@BUDGET]",
                    help=f"continuous-batching rows, of {', '.join(ROWS)}; ROW@BUDGET (1GiB, fp:2) runs that row at "
                    "that budget only, so one run can mix budgets")
    ap.add_argument("--http", nargs="*", type=row_arg, default=[], metavar="ROW[@BUDGET]",
                    help="rows served by `kivi serve` (a subprocess; needs the serve extra) to --http-clients "
                    "concurrent clients: float (--float-cache) or a KIVI row's config, same model, budget, threads")
    ap.add_argument("--http-clients", type=int, default=None,
                    help="concurrent HTTP clients, each taking the next request (default: one per request)")
    ap.add_argument("--kivi-root-before", default=None, metavar="DIR",
                    help="also run every batch and HTTP row with kivi imported from the checkout DIR (before/after in "
                    "one run; fresh processes only)")
    ap.add_argument("--baselines", nargs="*", default=[], choices=list(BASELINES),
                    help="one-at-a-time generate() rows over the same requests (dynamic: DynamicCache)")
    ap.add_argument("--check-single", type=int, default=2,
                    help="uniform: compare the first N requests of every KIVI row with one-request generate()")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, nargs="+", default=None,
                    help="tokens per forward; each value is a separate row (default: kivi's default)")
    ap.add_argument("--scheduler", nargs="+", choices=("fifo", "prefill_first"), default=None,
                    help="transformers' scheduler; each value is a separate row (default: kivi's default)")
    ap.add_argument("--float-attention", choices=("sdpa", "paged|eager"), default=None,
                    help="attention of the float rows (default: sdpa, what kivi's float path runs on CPU)")
    ap.add_argument("--capacity-at", type=int, default=4096)
    ap.add_argument("--capacity-budget", type=int, default=4 * 1024**3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--same-process", action="store_true", help="run every row in this process (no fresh process)")
    ap.add_argument("--row-timeout", type=float, default=None, help="seconds one row may take (fresh processes)")
    ap.add_argument("--out", default=None, help="write the JSON here (and a .txt table beside it)")
    ap.add_argument("--plot", default=None, help="PNG of generated tokens/s vs budget (needs matplotlib)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def _check(ap: argparse.ArgumentParser, args) -> None:
    for name in ("requests", "prompt_len", "new_tokens", "fp_requests", "page_size", "threads", "http_clients"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ("prompt_range", "new_range"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')}={lo} {hi} must be 1 <= MIN <= MAX")
    if any(m < 1 for m in args.max_batch_tokens or []):
        ap.error(f"--max-batch-tokens={args.max_batch_tokens} must all be >= 1")
    if any(not 0 <= f < 1 for f in args.shared_prefix):
        ap.error(f"--shared-prefix={args.shared_prefix} must be fractions in [0, 1)")
    if args.http and args.kivi_root_before and args.page_size != SERVER_PAGE_SIZE \
            and "page_size" not in serve_features(args.kivi_root_before):
        ap.error(f"--kivi-root-before={args.kivi_root_before!r}: its kivi serve has no --page-size (its pages are "
                 f"{SERVER_PAGE_SIZE} tokens); --page-size={args.page_size} would measure other pages")
    if args.http and args.model == "tiny":
        ap.error("--http needs a model kivi serve loads (an alias or a checkpoint folder with a fast tokenizer), "
                 "not --model tiny")
    if args.kivi_root_before is not None:
        if args.same_process:
            ap.error("--kivi-root-before runs rows with another checkout's kivi in fresh processes; "
                     "drop --same-process")
        if not (Path(args.kivi_root_before) / "kivi" / "__init__.py").is_file():
            ap.error(f"--kivi-root-before={args.kivi_root_before!r} is not a checkout (no kivi/__init__.py in it)")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install matplotlib")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    if args.child is not None:
        print(json.dumps(run_one(args, json.loads(args.child)), default=str), flush=True)
        return 0
    model, tok, vocab = _model(args.model)  # for shapes, the workloads and the budgets
    text = model.config.get_text_config()
    works = workloads(args, tok, vocab)
    report = {"command": command_line(), "environment": environment(), "model": args.model, "dtype": str(model.dtype),
              "workload": args.workload, "threads": args.threads, "requests": args.requests,
              "page_size": args.page_size, "fresh_process_per_row": not args.same_process,
              "load_average": {"start": os.getloadavg()},
              "capacity": {"tokens_per_request": args.capacity_at, "budget_bytes": args.capacity_budget,
                           "requests_that_fit": capacity_table(text, args.capacity_at, args.capacity_budget,
                                                               args.page_size)},
              "rows": []}
    plans = {w.name: row_plan(args, model, w) for w in works}
    del model
    roots = [None] if args.kivi_root_before is None else [args.kivi_root_before, None]
    for work in works:
        base = {"workload": work.name, "prompt_tokens": [len(p) for p in work.prompts], "new_tokens": work.new_tokens}
        singles = {}
        for name in args.baselines:
            r = run(args, argv, {"kind": "generate", "row": name, "workload": work.name})
            singles[name] = r.pop("tokens")
            report["rows"].append({**base, "kind": "one-at-a-time", "cache": name, "budget_bytes": None, **r})
            _progress(report["rows"][-1])
        first_tokens = {}
        for kind, name, budget in plans[work.name]:
            for st, root in itertools.product(settings(args) if kind == "batch" else http_settings(args), roots):
                r = run_row(args, argv, kind, name, work, budget, st, root)
                if kind == "batch" and root is None:
                    first_tokens.setdefault(name, r["tokens"])
                compare(r, singles.get(name), first_tokens.get(name), tok)
                report["rows"].append({**base, "kind": kind, "cache": name, "budget_bytes": budget, **r})
                _progress(report["rows"][-1])
        if args.workload == "uniform" and args.check_single and work is works[0]:
            report["single_request_agreement"] = check_single(args, argv, work, first_tokens)
    report["load_average"]["end"] = os.getloadavg()
    table = format_table(report)
    print(table)
    if args.out:
        write_json(args.out, report)
        write_text_file(Path(args.out).with_suffix(".txt"), table + "\n")
    if args.plot:
        plot_budgets(report, args.plot)
    return 0


def http_settings(args) -> list[dict]:
    """The settings an HTTP row runs under: kivi serve takes ``--max-batch-tokens`` (its scheduler is FIFO)."""
    return [{} if m is None else {"max_batch_tokens": m} for m in args.max_batch_tokens or [None]]


def run_row(args, argv: list[str], kind: str, name: str, work: Workload, budget: int, st: dict,
            root: str | None) -> dict:
    """One batch row (a fresh process) or HTTP row (a fresh ``kivi serve``); ``root``: kivi from that checkout."""
    if kind == "batch":
        r = run(args, argv, {"kind": "batch", "row": name, "workload": work.name, "budget": budget, "settings": st,
                             "kivi_root": root})
    else:
        r = http_row(args.model, ROWS[name], work, budget, clients=args.http_clients or len(work.prompts),
                     threads=args.threads, max_batch_tokens=st.get("max_batch_tokens"), kivi_root=root,
                     timeout=args.row_timeout or 7200.0, page_size=args.page_size)
    if root is not None:
        r["kivi_root"] = root
    return r


def compare(r: dict, single: list[list[int]] | None, batch: list[list[int]] | None, tok) -> None:
    """Add to row ``r`` (and drop its tokens / texts) how many requests match the one-at-a-time row of the same
    cache (batch rows: greedy tokens) or its first batch row (HTTP rows: the text those tokens decode to)."""
    tokens, texts = r.pop("tokens", None), r.pop("texts", None)
    if tokens is not None and single is not None:
        r["same_tokens_as_one_at_a_time"] = identical(tokens, single)
    if texts is not None and batch is not None and tok is not None:
        same = [tok.decode(t, skip_special_tokens=True) == x for t, x in zip(batch, texts)]
        r["same_text_as_batch"] = {"requests": len(same), "identical": sum(same)}


def check_single(args, argv: list[str], work: Workload, tokens: dict[str, list[list[int]]]) -> dict:
    """Greedy tokens of each KIVI batch row (its first budget and setting) vs one-request ``generate()`` with the
    same config, over the first ``--check-single`` requests."""
    out = {}
    for name in (r for r in dict.fromkeys(n for n, _ in args.rows) if ROWS[r] is not None and r in tokens):
        ref = run(args, argv, {"kind": "generate", "row": name, "table": "rows", "workload": work.name,
                               "limit": args.check_single})["tokens"]
        out[name] = identical(tokens[name][: len(ref)], ref)
        print(f"{name}: {out[name]['identical']}/{out[name]['requests']} requests token-identical to one-request "
              "generate()", file=sys.stderr, flush=True)
    return out


def _progress(r: dict) -> None:
    s = r.get("settings", {})
    print(f"{r['workload']} {r['kind']:13s} {r['cache']:9s} budget {(r['budget_bytes'] or 0) / 2**20:7.1f} MiB "
          f"{s.get('scheduler', '-')}/{s.get('max_batch_tokens', '-')}  {r['generated_tokens_per_s']:7.2f} gen tok/s  "
          f"held {r['requests_held_at_once']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
