"""The numba decode kernel's two inner parts, key scores and value accumulation, of kivi checkouts A/B.

Each row is a fresh process that imports kivi from one checkout and times, on one kv head of SmolLM2's shape
(3 query heads, head size 64, ``--bits`` codes, groups of 32), the kernel's own :func:`_key_scores` over
``--tokens`` quantized tokens (in steps of the kernel's ``SUB`` tokens, as a task walks them) and its
:func:`_value_accumulate` over the same tokens in pieces of 128 (a vLLM page), random codes and parameters,
one thread. The statistic is the minimum over ``--trials`` blocks of ``--reps`` calls (the cost without this
VM's interruptions); rows alternate between the checkouts in every round, and the outputs of every checkout
are compared with the first's (max |difference|).

    python studies/kernel_parts_ab.py --roots /path/to/old /path/to/new --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

G, D, HQ, PAGE = 32, 64, 3, 128


def one_row(root: str, tokens: int, bits: int, trials: int, reps: int, save: str | None) -> dict:
    sys.path.insert(0, root)
    import numba
    import numpy as np

    import kivi
    from kivi.attention.fused_cpu import kernel as K
    from kivi.attention.fused_cpu.tables import _BITS, _BS, _BS2, _DATA, _DS2, _H1, _HI, _LO, _QUANT, _SC, _SS2, NCOL

    assert str(Path(kivi.__file__).resolve()).startswith(str(Path(root).resolve())), kivi.__file__
    numba.set_num_threads(1)
    sub = K.SUB
    if tokens % sub:
        raise SystemExit(f"--tokens must be a multiple of the kernel's SUB ({sub}), not {tokens}")
    rng = np.random.default_rng(0)
    row_bytes = (D * bits + 7) // 8

    def piece(n_params):
        codes = rng.integers(0, 256, (tokens, row_bytes), dtype=np.uint8)
        sc = rng.uniform(0.005, 0.02, (n_params, D if n_params < tokens else D // G)).astype(np.float32)
        bs = rng.uniform(-1, 1, sc.shape).astype(np.float32)
        d = np.zeros((1, NCOL), np.int64)
        d[0, _LO], d[0, _HI], d[0, _QUANT], d[0, _BITS], d[0, _H1] = 0, tokens, 1, bits, 1
        d[0, _DATA], d[0, _DS2] = codes.ctypes.data, row_bytes
        d[0, _SC], d[0, _SS2], d[0, _BS], d[0, _BS2] = sc.ctypes.data, sc.shape[1], bs.ctypes.data, bs.shape[1]
        return d, (codes, sc, bs)

    kd, keep_k = piece(tokens // G)
    vd, keep_v = piece(tokens)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    p = rng.uniform(0, 1, (HQ, tokens)).astype(np.float32)
    nw = 16  # words a row at most (8-bit codes of 64 channels)

    @numba.njit(fastmath=True)
    def keys(kd, qsc, reps, out):
        s = np.zeros((HQ, sub), np.float32)
        qp = np.zeros((HQ, (D + 3) // 4 * 4), np.float32)
        tw = np.empty((nw, sub), np.uint32)
        for _ in range(reps):
            for c0 in range(0, tokens, sub):
                K._key_scores(kd, 0, 0, 0, c0, c0 + sub, qsc, bits, G, c0, s, qp, tw)
                out[:, c0 : c0 + sub] = s

    @numba.njit(fastmath=True)
    def values(vd, p_all, reps, accq):
        accf = np.zeros((HQ, D), np.float32)
        accb = np.zeros((HQ, D), np.float32)
        wt = np.zeros((HQ, D // G, sub), np.float32)
        sbt = np.empty((2, D // G, sub), np.float32)
        tw = np.empty((nw, sub), np.uint32)
        pr = np.empty((HQ, sub), np.float32)
        for _ in range(reps):
            for c0 in range(0, tokens, sub):
                pr[:] = p_all[:, c0 : c0 + sub]
                for a in range(c0, c0 + sub, PAGE):
                    K._value_accumulate(vd, 0, 0, 0, a, a + PAGE, bits, G, c0, pr, accq, accf, accb, wt, sbt, tw)
        return accb

    scores = np.zeros((HQ, tokens), np.float32)
    keys(kd, q, 1, scores)
    acc = np.zeros((HQ, D), np.float32)
    base = values(vd, p, 1, acc)
    out = {"keys": [], "values": []}
    for _ in range(trials):
        t0 = time.perf_counter()
        keys(kd, q, reps, np.zeros((HQ, tokens), np.float32))
        out["keys"].append((time.perf_counter() - t0) / reps)
        t0 = time.perf_counter()
        values(vd, p, reps, np.zeros((HQ, D), np.float32))
        out["values"].append((time.perf_counter() - t0) / reps)
    if save:
        np.savez(save, scores=scores, acc=acc, base=base)
    del keep_k, keep_v
    return {"root": root, "commit": _commit(root), "tokens": tokens, "bits": bits,
            "keys_us_min": 1e6 * min(out["keys"]), "values_us_min": 1e6 * min(out["values"]),
            "keys_us_median": 1e6 * statistics.median(out["keys"]),
            "values_us_median": 1e6 * statistics.median(out["values"])}


def _commit(root: str) -> str:
    r = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--roots", nargs="+", help="kivi checkouts (the first is the baseline)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=2, choices=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows and the summary here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_row(args.one, args.tokens, args.bits, args.trials, args.reps, args.save)))
        return
    if not args.roots:
        ap.error("--roots: name at least one kivi checkout")
    import numpy as np

    rows, tmp = [], tempfile.mkdtemp()
    for rnd in range(args.rounds):
        for i, root in enumerate(args.roots):
            cmd = [sys.executable, __file__, "--one", root, "--tokens", str(args.tokens), "--bits", str(args.bits),
                   "--trials", str(args.trials), "--reps", str(args.reps), "--save", f"{tmp}/out_{i}.npz"]
            row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            row["round"] = rnd
            rows.append(row)
            print(f"round {rnd} {row['commit']}: keys {row['keys_us_min']:.1f} us, values {row['values_us_min']:.1f} "
                  f"us (minima)", flush=True)
    ref = np.load(f"{tmp}/out_0.npz")
    summary = {}
    for i, root in enumerate(args.roots):
        got = np.load(f"{tmp}/out_{i}.npz")
        part = {}
        for name in ("keys", "values"):
            mine = min(r[f"{name}_us_min"] for r in rows if r["root"] == root)
            first = min(r[f"{name}_us_min"] for r in rows if r["root"] == args.roots[0])
            part[name] = {"us_min": round(mine, 2), "vs_first": round(mine / first, 3)}
        part["max_abs_diff_vs_first"] = max(float(np.abs(got[k] - ref[k]).max()) for k in ("scores", "acc", "base"))
        summary[_commit(root)] = part
        print(f"{_commit(root)}: keys {part['keys']['us_min']} us ({part['keys']['vs_first']}x the first), values "
              f"{part['values']['us_min']} us ({part['values']['vs_first']}x), max |diff| "
              f"{part['max_abs_diff_vs_first']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows, "summary": summary},
                                              indent=1))


if __name__ == "__main__":
    main()
