"""The vLLM plugin's batched paged decode kernel of two kivi checkouts, A/B, on one machine in one run.

Each row is a fresh process that imports kivi from one checkout and times one layer's decode kernel call
(:func:`kivi.vllm.decode.paged_decode`, the "decode kernel call" of ``studies/vllm_step_profile.py``) on a
vLLM-like bfloat16 cache of SmolLM2's shape (3 kv heads, 9 query heads, head size 64, pages of 128 tokens, the
window rings in one allocation as vLLM lays them out): ``--requests`` requests of ``--length`` tokens (a quarter
each 0, 128, 256, 384 shorter), random codes and rings, 1 thread. Rows alternate between the checkouts within a
round, so a slow drift of a shared box hits both; the output of both checkouts is compared (max |difference|).

    python studies/vllm_kernel_ab.py --roots /path/to/old /path/to/new --lengths 1040 2064 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_row(root: str, length: int, requests: int, reps: int, out_path: str | None) -> dict:
    sys.path.insert(0, root)
    import torch

    import kivi
    from kivi.config import KiviConfig
    from kivi.vllm.decode import decode_kernel, paged_decode
    from kivi.vllm.geometry import build_geometry
    from kivi.vllm.plan import step_plan

    assert str(Path(kivi.__file__).resolve()).startswith(str(Path(root).resolve())), kivi.__file__
    torch.set_num_threads(1)
    import numba

    numba.set_num_threads(1)
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128, attention_backend="cpu")
    H, HQ, D, P = 3, 9, 64, 128
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    k, pw, bb = geo.window_rings, geo.window_tokens, geo.block_bytes
    n_layers = 3  # vLLM's block-outermost packing: a layer's blocks n_layers pages apart
    pages_per = (length + P - 1) // P + 1
    nb = requests * pages_per + requests * k + 8
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 255, (nb * n_layers * bb,), dtype=torch.uint8, generator=g)
    pages = buf.as_strided((nb, H, P, geo.state_bytes), (n_layers * bb, P * geo.state_bytes, geo.state_bytes, 1), 0)
    rbuf = torch.randn(nb * (k + 1) * bb // 2, generator=g).to(torch.bfloat16)
    rings = [rbuf.as_strided((nb, H, pw, 2 * D), ((k + 1) * bb // 2, pw * 2 * D, 2 * D, 1), (r + 1) * bb // 2)
             for r in range(k)]
    kern = decode_kernel(cfg, geo, "cpu", pages, rings)
    if kern is None:
        raise SystemExit("the batched kernel does not apply to this cache (numba missing?)")
    for side in "kv":  # scales of a real cache's size; offsets anywhere
        kern.layout.field(kern.pool, side, "scale").uniform_(0.005, 0.02, generator=g)
        kern.layout.field(kern.pool, side, "offset").uniform_(-1, 1, generator=g)
    seqs = [length - 128 * (i % 4) for i in range(requests)]
    perm = torch.randperm(nb - 1, generator=g) + 1
    pt = perm[: requests * pages_per].view(requests, pages_per).int()
    rt = perm[requests * pages_per: requests * (pages_per + k)].view(requests, k).int()
    key, value = (torch.randn(requests, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(requests, HQ, D, generator=g).to(torch.bfloat16)
    plan = step_plan(cfg, geo, list(range(requests + 1)), seqs)
    assert plan.kernel is not None and len(plan.kernel.rows) == requests

    def call():
        return paged_decode(kern, plan.kernel, pt, rt, q, key, value, D**-0.5)

    out = call()  # compiles or loads the kernel
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - t0))
    if out_path:
        torch.save(out, out_path)
    return {"root": root, "commit": _commit(root), "length": length, "requests": requests,
            "ms_median": statistics.median(times), "ms_min": min(times)}


def _commit(root: str) -> str:
    r = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--roots", nargs="+", help="kivi checkouts (the first is the baseline)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1040, 2064])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows and the summary here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_row(args.one, args.lengths[0], args.requests, args.reps, args.save)))
        return
    if not args.roots:
        ap.error("--roots: name at least one kivi checkout")
    import tempfile

    import torch

    rows, tmp = [], tempfile.mkdtemp()
    for rnd in range(args.rounds):
        for length in args.lengths:
            for i, root in enumerate(args.roots):
                save = f"{tmp}/out_{i}_{length}.pt"
                cmd = [sys.executable, __file__, "--one", root, "--lengths", str(length), "--requests",
                       str(args.requests), "--reps", str(args.reps), "--save", save]
                r = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(r.stdout.strip().splitlines()[-1])
                row["round"] = rnd
                rows.append(row)
                print(f"round {rnd} length {length} {row['commit']}: median {row['ms_median']:.3f} ms, "
                      f"min {row['ms_min']:.3f}", flush=True)
    summary = {}
    for length in args.lengths:
        base = statistics.median(r["ms_median"] for r in rows if r["length"] == length and r["root"] == args.roots[0])
        ref = torch.load(f"{tmp}/out_0_{length}.pt")
        for i, root in enumerate(args.roots):
            med = statistics.median(r["ms_median"] for r in rows if r["length"] == length and r["root"] == root)
            diff = (torch.load(f"{tmp}/out_{i}_{length}.pt").float() - ref.float()).abs().max().item()
            summary[f"{_commit(root)} @ {length}"] = {"ms_per_call": round(med, 3), "vs_first": round(med / base, 3),
                                                     "max_abs_diff_vs_first": diff}
    for name, s in summary.items():
        print(f"{name}: {s['ms_per_call']:.3f} ms per layer call, {s['vs_first']:.3f}x the first, "
              f"max |diff| {s['max_abs_diff_vs_first']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows, "summary": summary},
                                              indent=1))


if __name__ == "__main__":
    main()
