"""Generated tokens/s of ``generate_batch`` over KIVI pages against one-at-a-time ``generate()``, same requests.

``--requests`` WikiText-2 prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens each, a budget with
room for all of them at once. Rows (each in a fresh process with ``--all``; wall time from submitting the
requests to the last token, prefill included, after an untimed warm-up):

* ``batch``: ``kivi.batching.generate_batch(model, prompts, KiviConfig(), cache_memory=...)``;
* ``single``: ``quantize_model(model, KiviConfig())`` then one ``model.generate()`` per prompt.

``--kivi-root DIR`` (a checkout) makes a ``batch`` row import kivi from there, e.g. the main branch for a
before/after comparison in one run:

    PYTHONPATH=$PWD python benchmarks/serving_vs_generate.py --all --kivi-root-before /work/main \\
        --requests 8 --prompt-len 512 --new-tokens 64 --threads 2 --out results/serving/serving_vs_generate_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def run_row(args) -> dict:
    sys.path.insert(0, args.kivi_root or str(HERE.parent.parent))
    import torch

    import kivi
    from kivi import KiviConfig, dequantize_model, load_model, quantize_model
    from kivi.batching import build_layout, generate_batch
    from kivi.data import load_text, token_windows

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    prompts = token_windows(tok, load_text(), args.prompt_len, args.requests).tolist()
    cfg = KiviConfig()
    layout = build_layout(model.config, cfg, 256, model.dtype)
    budget = layout.request_blocks(args.prompt_len + args.new_tokens) * args.requests * layout.block_bytes
    if args.row == "batch":
        def run(ps, n):
            extra = {} if args.max_batch_tokens is None else {"max_batch_tokens": args.max_batch_tokens}
            out = generate_batch(model, ps, cfg, cache_memory=budget, max_new_tokens=n, **extra)
            return [r.generated_tokens for r in out.values()]
    else:
        quantize_model(model, cfg)

        def run(ps, n):
            return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False)[0, len(p):].tolist() for p in ps]
    run([prompts[0][:64]], 2)  # warm-up: kernels loaded, allocator warm
    t0 = time.perf_counter()
    tokens = run(prompts, args.new_tokens)
    wall = time.perf_counter() - t0
    if args.row == "single":
        dequantize_model(model)
    gen = sum(len(t) for t in tokens)
    return {"row": args.row, "kivi": os.path.dirname(kivi.__file__), "wall_s": wall, "generated_tokens": gen,
            "generated_tokens_per_s": gen / wall, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="default: the library's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--row", choices=["batch", "single"], default="batch")
    ap.add_argument("--kivi-root", default=None, help="import kivi from this checkout (this row)")
    ap.add_argument("--all", action="store_true", help="run every row, each in a fresh process")
    ap.add_argument("--kivi-root-before", default=None, help="with --all: also a batch row with kivi from here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.all:
        print(json.dumps(run_row(args)))
        return 0
    common = [f"--model={args.model}", f"--requests={args.requests}", f"--prompt-len={args.prompt_len}",
              f"--new-tokens={args.new_tokens}", f"--threads={args.threads}"]
    if args.max_batch_tokens is not None:
        common.append(f"--max-batch-tokens={args.max_batch_tokens}")
    rows = (
        [("batch (before)", ["--row=batch", f"--kivi-root={args.kivi_root_before}"])] if args.kivi_root_before else []
    )
    rows += [("batch", ["--row=batch"]), ("single", ["--row=single"])]
    report = {"args": vars(args), "load_average_start": os.getloadavg(), "rows": {}}
    for name, extra in rows:
        out = subprocess.run([sys.executable, str(HERE), *common, *extra], capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        report["rows"][name] = row
        print(f"{name:<16} {row['wall_s']:7.1f} s  {row['generated_tokens_per_s']:6.2f} generated tokens/s  "
              f"(kivi from {row['kivi']})", flush=True)
    report["load_average_end"] = os.getloadavg()
    single = report["rows"]["single"]
    for name, row in report["rows"].items():
        same = sum(a == b for a, b in zip(row["tokens"], single["tokens"]))
        row["tokens_equal_single"] = same
        print(f"{name:<16} {row['generated_tokens_per_s'] / single['generated_tokens_per_s']:.2f}x one-at-a-time "
              f"generate(); {same}/{len(single['tokens'])} requests token-identical to it")
    print(f"load average {report['load_average_start']} -> {report['load_average_end']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
