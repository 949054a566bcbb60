"""Decode speed of two kivi checkouts, A/B, on the same machine in one run.

For each round, checkout and config: a fresh process imports kivi from that checkout, loads SmolLM2,
applies ``quantize_model``, fills a ``KiviCache.from_model`` with ``--context`` tokens of random
keys/values through the public ``cache.update`` (no prefill forward: decode speed does not depend on the
cached values, and both checkouts see the same update calls), then times ``--steps`` one-token forwards
after ``--warmup`` untimed ones. Rows alternate between checkouts within a round, so slow drifts of a
shared box hit both. Reported: the median per-step wall time per (checkout, config, batch) and the ratio
of each checkout to the first.

    python benchmarks/ab_decode.py --roots /path/to/old /path/to/new --configs extreme \\
        results/configs/pareto12_cfg_tune5_first20.json --batches 1 4 --context 8192 --rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_row(root: str, config: str, context: int, batch: int, steps: int, warmup: int, threads: int,
            profile: int = 0) -> dict:
    sys.path.insert(0, root)
    import torch

    import kivi
    from kivi import KiviCache, KiviConfig, quantize_model

    assert str(Path(kivi.__file__).resolve()).startswith(str(Path(root).resolve())), kivi.__file__
    torch.set_num_threads(threads)
    cfg = KiviConfig.from_json(config) if config.endswith(".json") else KiviConfig.preset(config)
    model, _ = kivi.load_model("smollm2")
    model.eval()
    quantize_model(model, cfg)
    mc = model.config
    layers, kv = mc.num_hidden_layers, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    cache = KiviCache.from_model(model, cfg)
    g = torch.Generator().manual_seed(0)
    for li in range(layers):  # one prefill-sized update per layer, as a one-shot prefill makes
        cache.update(torch.randn(batch, kv, context, hd, generator=g), torch.randn(batch, kv, context, hd, generator=g),
                     li)
    ids = torch.randint(100, 1000, (batch, 1), generator=g)
    times = []
    prof = cProfile.Profile() if profile else None
    with torch.inference_mode():
        for i in range(warmup + steps):
            pos = torch.full((batch, 1), context + i, dtype=torch.long)
            if prof is not None and i == warmup:
                prof.enable()
            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    row = {"root": root, "config": config, "batch": batch, "context": context, "step_s": statistics.median(times),
           "steps": steps, "threads": threads}
    if prof is not None:  # the functions taking the most time of their own, per timed step
        prof.disable()
        stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:profile]
        row["profile"] = [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": st[0] / steps,
                           "own_ms_per_step": st[2] / steps * 1e3, "cum_ms_per_step": st[3] / steps * 1e3}
                          for (f, line, name), st in top]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", nargs="+", required=True, help="kivi checkouts (the first is the baseline)")
    p.add_argument("--configs", nargs="+", default=["extreme"], help="preset names or KiviConfig JSON files")
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile the timed steps (cProfile: adds overhead to the timing) and print, per "
                        "checkout, the N functions with the most time of their own per step")
    p.add_argument("--out", help="JSON file for every row")
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row (JSON args) and print its result
    a = p.parse_args()
    if a.row:
        print(json.dumps(one_row(**json.loads(a.row))))
        return
    rows = []
    for r in range(a.rounds):
        for config in a.configs:
            for batch in a.batches:
                for root in a.roots:
                    args = dict(root=root, config=config, context=a.context, batch=batch, steps=a.steps,
                                warmup=a.warmup, threads=a.threads, profile=a.profile)
                    out = subprocess.run([sys.executable, __file__, "--roots", root, "--row", json.dumps(args)],
                                         capture_output=True, text=True, cwd=root)
                    if out.returncode:
                        sys.exit(f"row failed ({root}, {config}, batch {batch}):\n{out.stderr[-2000:]}")
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    row["round"] = r
                    rows.append(row)
                    print(f"round {r} {Path(root).name:>12} {Path(config).stem:>32} b{batch}: "
                          f"{row['step_s'] * 1e3:8.1f} ms/step", flush=True)
    print("\nmedian over rounds (ms per decode step; ratio = baseline time / this time, >1 is faster):")
    for config in a.configs:
        for batch in a.batches:
            med = {root: statistics.median(x["step_s"] for x in rows if x["root"] == root and x["config"] == config
                                           and x["batch"] == batch) for root in a.roots}
            base = med[a.roots[0]]
            cells = "  ".join(f"{Path(rt).name}: {m * 1e3:.1f} ({base / m:.2f}x)" for rt, m in med.items())
            print(f"  {Path(config).stem} batch {batch}: {cells}")
    for row in rows:
        if row["round"] == 0 and row.get("profile"):
            print(f"\nprofile, {Path(row['root']).name} {Path(row['config']).stem} batch {row['batch']} "
                  "(ms per step: own, cumulative; calls per step):")
            for f in row["profile"]:
                print(f"  {f['own_ms_per_step']:8.2f} {f['cum_ms_per_step']:8.2f} {f['calls_per_step']:7.0f}  "
                      f"{f['function']}")
    if a.out:
        from kivi.files import write_text

        write_text(a.out, json.dumps({"argv": sys.argv, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
