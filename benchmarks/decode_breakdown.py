"""Where a decode step's time goes, per layer: the cache write and the attention, layers with per-head widths
apart from plain ones.

For each configuration (the rows of ``bench_decode.py``: ``kivi2-cpu``, a ``KiviConfig`` JSON file, ...) in
one process, rounds interleaved: prefill a random prompt of ``--context`` tokens, 3 untimed decode steps,
then ``--steps`` timed ones. Every ``KiviCache.update`` call (the cache write, per layer) and every call of
the ``"kivi"`` attention (per layer) is timed with the wall clock; the table gives the step time and, per
layer kind (layers the config's ``head_bits`` names, the others), the mean microseconds per layer and step
in each. This says what a per-head layer costs over a plain one in the same model and run; rows of one
process influence each other (use ``bench_decode.py --isolate`` for the speeds themselves).

    python benchmarks/decode_breakdown.py --context 8192 --steps 24 --threads 2 \\
        --configs kivi2-cpu results/configs/pareto12_cfg_tune5_first20.json
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402 - the rows, their preparation and the warm-up are bench_decode's
from kivi.cache.cache import KiviCache  # noqa: E402
from kivi.cli.threads import set_cpu_threads  # noqa: E402
from kivi.eval import make_cache  # noqa: E402
from kivi.models import load_model  # noqa: E402


class Timers:
    """Seconds per layer index spent in ``KiviCache.update`` and in the ``"kivi"`` attention, while installed."""

    def __init__(self):
        self.update: dict[int, float] = collections.defaultdict(float)
        self.attention: dict[int, float] = collections.defaultdict(float)

    def clear(self) -> None:
        self.update.clear()
        self.attention.clear()

    def __enter__(self) -> "Timers":
        self._install()
        return self

    def __exit__(self, *exc) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        KiviCache.update, ALL_ATTENTION_FUNCTIONS["kivi"] = self._saved

    def _install(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        update = KiviCache.update

        def timed_update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            t = time.perf_counter()
            try:
                return update(cache, key_states, value_states, layer_idx, *args, **kwargs)
            finally:
                self.update[layer_idx] += time.perf_counter() - t

        attention = ALL_ATTENTION_FUNCTIONS["kivi"]

        def timed_attention(module, *args, **kwargs):
            t = time.perf_counter()
            try:
                return attention(module, *args, **kwargs)
            finally:
                self.attention[module.layer_idx] += time.perf_counter() - t

        self._saved = (update, attention)
        KiviCache.update = timed_update
        ALL_ATTENTION_FUNCTIONS["kivi"] = timed_attention


@torch.no_grad()
def run_row(model, name: str, context: int, steps: int, timers: Timers) -> dict:
    spec = bench_decode._prepare(model, name)
    torch.manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (1, context))
    cache = make_cache(model, spec)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    timers.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    step_s = (time.perf_counter() - t0) / steps
    head_layers = set(getattr(spec, "head_bits", None) or {})
    layers = range(model.config.num_hidden_layers)
    row = {"config": bench_decode.row_name(name), "context": context, "steps": steps, "step_ms": 1e3 * step_s}
    for kind, chosen in (("plain", [i for i in layers if i not in head_layers]),
                         ("per_head", [i for i in layers if i in head_layers])):
        row[f"{kind}_layers"] = len(chosen)
        for part, times in (("update", timers.update), ("attention", timers.attention)):
            row[f"{kind}_{part}_us"] = 1e6 * sum(times[i] for i in chosen) / steps / len(chosen) if chosen else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", required=True, help="bench_decode.py rows (kivi2-cpu, FILE.json, ...)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every row, interleaved; the table shows medians")
    ap.add_argument("--threads", type=int, default=0, help="torch and numba threads (0 = their defaults)")
    ap.add_argument("--json-out", metavar="FILE")
    a = ap.parse_args()
    if a.context < 1 or a.steps < 1 or a.rounds < 1:
        ap.error(f"--context, --steps and --rounds must be at least 1 (got {a.context}, {a.steps}, {a.rounds})")
    model = load_model("smollm2")[0]
    bench_decode._warm(model)
    from kivi.attention.fused_cpu import fused_decode_available, warmup

    if fused_decode_available():
        warmup()
    if a.threads:
        set_cpu_threads(a.threads)
    runs = collections.defaultdict(list)
    with Timers() as timers:
        for r in range(a.rounds):
            for name in a.configs:
                row = run_row(model, name, a.context, a.steps, timers)
                runs[name].append(row)
                print(f"  round {r + 1}/{a.rounds} {row['config']}: {row['step_ms']:.2f} ms/step", file=sys.stderr)
    rows = []
    for name in a.configs:
        row = dict(runs[name][0])
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = statistics.median(x[k] for x in runs[name])
        rows.append(row)
    base = rows[0]["step_ms"]
    print(f"SmolLM2, context {a.context}, batch 1, {a.threads or 'default'} threads, {a.steps} steps, "
          f"median of {a.rounds} rounds (us per layer and step)")
    print(f"{'config':40s} {'ms/step':>8s} {'vs first':>8s} | {'plain: n':>8s} {'write':>7s} {'attn':>7s} | "
          f"{'per-head: n':>11s} {'write':>7s} {'attn':>7s}")
    fmt = lambda v: f"{v:7.1f}" if v is not None else f"{'-':>7s}"  # noqa: E731
    for row in rows:
        print(f"{row['config'][:40]:40s} {row['step_ms']:8.2f} {base / row['step_ms']:8.3f} | "
              f"{row['plain_layers']:8d} {fmt(row['plain_update_us'])} {fmt(row['plain_attention_us'])} | "
              f"{row['per_head_layers']:11d} {fmt(row['per_head_update_us'])} {fmt(row['per_head_attention_us'])}")
    if a.json_out:
        from common import write_json

        write_json(a.json_out, {"args": vars(a), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
