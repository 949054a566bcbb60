"""Decode throughput and memory on SmolLM2: DynamicCache vs transformers' QuantizedCache (quanto) vs KIVI.

For each context length and batch size, each configuration: prefill a random prompt of ``context``
tokens and ``--warmup-steps`` decode steps (not timed), then ``--steps`` greedy decode steps (timed)
-> tokens/s = batch * steps / time. The process's CPU time of the same steps is recorded too
(``tok_per_cpu_s``, ``cpu_speed_vs_kivi2``): on a box loaded by other jobs the wall clock counts the
time a row waited for a core (measured: wall 3-4x the CPU time of a 1-thread row at load 8-10 on 2 cores).

This machine class is noisy (the same row varied by 30% between runs, and a row's speed depends on
what ran before it in the process: quanto int2 at 8K measured 3.75 tok/s alone, 2.89 after a
DynamicCache row and once 0.22). Hence ``--isolate`` (each row in a fresh process) and
``--repeat N`` (rows interleaved, N rounds; the table shows the median and the spread); ratios
are medians over medians measured in the same run.

``floor`` is a pseudo-configuration: DynamicCache decoding after a 32-token prompt, i.e. what a
decode step costs without any cache to speak of (weights, norms, MLP, framework). ``step - floor``
is then the part of a step spent on the cache and attention; the table reports it per row and
its ratio to quanto int2's.

Peak memory: "peak_rss_delta_MiB" = peak process RSS (psutil, sampled every 2 ms by a thread)
during prefill+decode minus the RSS just before, i.e. the cache plus transient activations; also
the cache's own tensor bytes ("cache_MiB", ``kivi.eval.cache_nbytes``: KIVI's own accounting, the
key/value tensors of DynamicCache, the packed tensors of quanto's QuantizedCache).
Without ``--isolate`` this delta is meaningless for later rows (freed memory of earlier rows is reused).

    python benchmarks/bench_decode.py --contexts 1024 4096 --batches 1 4 [--steps 32] [--json]
    python benchmarks/bench_decode.py --contexts 8192 --batches 1 --configs floor dynamic quanto2 kivi2-cpu \
        --isolate --repeat 3
    python benchmarks/bench_decode.py --contexts 8192 --batches 1 4 --configs dynamic kivi2-cpu \
        results/configs/pareto12_cfg_heads_k3v3_4p3.json --isolate --repeat 3

Long contexts: a context beyond the model's ``max_position_embeddings`` (SmolLM2: 8192) is refused unless
``--ignore-max-context`` is given; such rows measure speed only (the model was not trained that far, its
outputs there mean nothing) and say so (``"beyond_max_context": true``). Nothing else changes past the
limit: the prompt is random token ids (no source text to run out of) and the rotary embeddings are
computed for any position. Building a long context costs far more than the timed decode (a 32K-token
prefill is quadratic in attention), so ``--fill random`` appends random keys/values to the cache
directly (``kivi.eval.fill_random``: the same cache updates as a prefill, no model forward; decode speed
does not depend on the numbers), and ``--prefill-chunk N`` runs a real prefill N tokens at a time to
bound its activations. Either way only the decode steps are timed::

    python benchmarks/bench_decode.py --contexts 16384 32768 --batches 1 4 --configs dynamic kivi2-cpu \
        --ignore-max-context --fill random --threads 1 --isolate --repeat 3

A ``--configs`` argument ending in ``.json`` is a ``KiviConfig`` file (``KiviConfig.to_json``, ``kivi profile
--write-config``): its row is named after the file's stem and runs on the backend the file names
(``"auto"``: the machine's default, the fused numba kernel on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from common import run_fresh, set_threads, write_json
from kivi import KiviConfig, dequantize_model, quantize_model
from kivi.attention.fused_cpu import SINGLE_SEQUENCE
from kivi.eval import cache_nbytes, fill_random, make_cache
from kivi.memory import model_spec
from kivi.models import load_model


class PeakRSS:
    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def delta_mib(self):
        return (self.peak - self.base) / 2**20


FLOOR_CONTEXT = 32

#: row name -> ``kivi.eval.make_cache`` spec of its baseline (quanto: transformers' defaults, group 64, R 128)
BASELINE_SPECS = {"dynamic": None, "floor": None, "quanto2": "quanto-int2", "quanto4": "quanto-int4"}


#: how a row's context gets into the cache (``--fill``)
FILLS = ("prefill", "random")


@torch.no_grad()
def build_context(model, cache, context, batch, vocab, *, fill="prefill", prefill_chunk=0):
    """Put ``context`` tokens into ``cache``; returns the first decode step's input ids ``[batch, 1]``.

    ``"prefill"``: the model runs on random token ids, ``prefill_chunk`` tokens per forward (0: all at
    once). ``"random"``: :func:`kivi.eval.fill_random` (random keys/values, no forward).
    """
    torch.manual_seed(0)
    if fill == "random":
        fill_random(model, cache, context, batch=batch)
        return torch.randint(10, vocab, (batch, 1))
    ids = torch.randint(10, vocab, (batch, context))
    step = prefill_chunk or context
    for start in range(0, context, step):
        out = model(input_ids=ids[:, start:start + step], cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def run_one(model, spec, context, batch, steps, vocab, warmup_steps=2, *, fill="prefill", prefill_chunk=0):
    gc.collect()
    with PeakRSS() as mem:
        cache = make_cache(model, spec)
        nxt = build_context(model, cache, context, batch, vocab, fill=fill, prefill_chunk=prefill_chunk)
        for _ in range(warmup_steps):  # first steps after a prefill: allocations, thread pools (all configs alike)
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    # CPU seconds of the process (every thread): with --threads 1 on a box that other jobs load, the
    # wall clock also counts the time the row waited for a core; the CPU time does not.
    return {"tok_s": batch * steps / dt, "decode_s": dt, "decode_cpu_s": dc, "tok_per_cpu_s": batch * steps / dc,
            "peak_rss_delta_MiB": mem.delta_mib,
            "cache_MiB": cache_nbytes(cache) / 2**20}


@torch.no_grad()
def _warm(model):
    """One short forward before any measured row: the first forward of a process allocates ~0.5 GiB of
    lasting buffers (measured: a fresh process's first row showed +507 MiB even at 32 tokens)."""
    model(input_ids=torch.ones(1, 8, dtype=torch.long), use_cache=False)


def is_config_file(name: str) -> bool:
    """Whether a ``--configs`` entry names a ``KiviConfig`` JSON file rather than a built-in row."""
    return name.endswith(".json")


def row_name(name: str) -> str:
    """The row's name in the table: a config file's stem, a built-in row's own name."""
    return Path(name).stem if is_config_file(name) else name


def _prepare(model, name):
    """Set the model up for row ``name``; returns the cache spec for :func:`run_one`."""
    dequantize_model(model)
    if is_config_file(name):  # a KiviConfig file, with the backend it names
        cfg = KiviConfig.from_json(name)
        quantize_model(model, cfg)
        return cfg
    # position tiers (docs/python.md, "Position tiers"): 128 FP, 1024 at 4 bits, the rest 2 bits
    if name.startswith("kivitiers"):
        cfg = KiviConfig(k_bits=4, v_bits=4, sink_tokens=4, tiers=[(128, None), (1024, 4), (None, 2)],
                         attention_backend=name.split("-")[1])
        quantize_model(model, cfg)
        return cfg
    # quantize_after beyond any context: the full-precision phase
    # (docs/python.md, "Precision chosen from the request's length")
    if name.startswith("kivifp"):
        cfg = KiviConfig(k_bits=2, v_bits=2, quantize_after=2**31, attention_backend=name.split("-")[1])
        quantize_model(model, cfg)
        return cfg
    if name.startswith("kivi"):
        bits, backend = int(name[4]), name.split("-")[1]
        cfg = KiviConfig(k_bits=bits, v_bits=bits, attention_backend=backend)
        quantize_model(model, cfg)
        return cfg
    return BASELINE_SPECS[name]


def _row(model, name, ctx, bs, steps, warmup_steps, *, fill="prefill", prefill_chunk=0, max_context=None):
    spec = _prepare(model, name)
    floor = name == "floor"
    try:
        r = run_one(model, spec, FLOOR_CONTEXT if floor else ctx, bs, steps, model.config.vocab_size,
                    warmup_steps, fill="prefill" if floor else fill, prefill_chunk=prefill_chunk)
    except Exception as e:  # noqa: BLE001 - report (e.g. quanto missing)
        r = {"error": f"{type(e).__name__}: {e}"[:200]}
    r.update(config=row_name(name), context=ctx, batch=bs, fill="prefill" if floor else fill)
    if max_context is not None and not floor and ctx > max_context:
        r.update(beyond_max_context=True, max_context=max_context)
    if is_config_file(name):
        r.update(config_file=name)
    return r


def _row_isolated(name, ctx, bs, steps, warmup_steps, threads, pin, a):
    """The row in a fresh interpreter (nothing left over from other rows: allocator state, caches)."""
    args = [__file__, "--one-row", name, str(ctx), str(bs), "--steps", str(steps),
            "--warmup-steps", str(warmup_steps), "--threads", str(threads), "--model", a.model,
            "--fill", a.fill, "--prefill-chunk", str(a.prefill_chunk)] + (["--pin-allocator"] if pin else [])
    args += ["--ignore-max-context"] if a.ignore_max_context else []
    out = run_fresh(args)
    if out.returncode or out.result is None:
        return {"error": f"row process failed ({out.returncode}): {out.stderr.strip()[-300:]}",
                "config": row_name(name), "context": ctx, "batch": bs}
    return out.result


def _summarise(runs):
    """Median over repeats of one row's runs (errors: the first error)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(runs[0])
    out = dict(ok[0])
    for k in ("tok_s", "decode_s", "decode_cpu_s", "tok_per_cpu_s", "peak_rss_delta_MiB"):
        if all(k in r for r in ok):
            out[k] = statistics.median([r[k] for r in ok])
    out["tok_s_all"] = [round(r["tok_s"], 3) for r in ok]
    out["ms_per_step"] = 1e3 * out["decode_s"] / out["steps"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps after the prefill")
    ap.add_argument("--configs", nargs="+",
                    default=["dynamic", "quanto2", "quanto4", "kivi2-reference", "kivi2-cpu", "kivi4-reference",
                             "kivi4-cpu"],
                    help="dynamic, floor, quanto2, quanto4, kivi{2,4}-{reference,cpu,triton}, kivitiers-{cpu,...} "
                         "(K4V4 + 4 sinks, tiers 128 FP / 1024 at 4 bits / the rest at 2 bits), kivifp-{cpu,...} "
                         "(K2V2 with quantize_after past the context: the full-precision phase), or a KiviConfig "
                         "JSON file (FILE.json: row named after the file's stem, the backend the file names)")
    ap.add_argument("--threads", type=int, default=0, help="torch and numba threads (0 = their defaults)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every row, interleaved; the table shows medians")
    ap.add_argument("--isolate", action="store_true", help="run every row in a fresh process")
    ap.add_argument("--pin-allocator", action="store_true",
                    help="call kivi.malloc_pin.reduce_fragmentation() first (as the kivi CLI does). Off by default: "
                         "the pinned mmap threshold makes every large temporary a fresh mapping, which slowed "
                         "DynamicCache decoding (a torch.cat of the whole cache per layer and step) by ~35%% at 2K")
    ap.add_argument("--model", default="smollm2",
                    help="the model (any name kivi.load_model accepts: an alias, a .gguf file, a checkpoint folder)")
    ap.add_argument("--ignore-max-context", action="store_true",
                    help="allow contexts beyond the model's max_position_embeddings (SmolLM2: 8192): for decode "
                         "speed only, the model's outputs there mean nothing; such rows carry "
                         "\"beyond_max_context\": true")
    ap.add_argument("--fill", choices=FILLS, default="prefill",
                    help="how the context gets into the cache: 'prefill' runs the model on random token ids; "
                         "'random' appends random keys/values without a forward (kivi.eval.fill_random: fast, "
                         "for long contexts; decode speed does not depend on the numbers). Decode is timed alike")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                    help="with --fill prefill: feed the prompt N tokens per forward, bounding the prefill's "
                         "activations (0: the whole prompt in one forward)")
    ap.add_argument("--one-row", nargs=3, metavar=("CONFIG", "CONTEXT", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--json-out", metavar="FILE",
                    help="also write the results as JSON to FILE (the table still prints)")
    a = ap.parse_args()
    if a.pin_allocator:
        from kivi.malloc_pin import reduce_fragmentation

        reduce_fragmentation()
    if a.repeat < 1:
        ap.error(f"--repeat={a.repeat} must be at least 1")
    if a.prefill_chunk < 0:
        ap.error(f"--prefill-chunk={a.prefill_chunk} must be 0 (whole prompt) or a positive number of tokens")
    contexts = a.contexts + ([int(a.one_row[1])] if a.one_row else [])
    if min(contexts) < 1 or (a.one_row and int(a.one_row[2]) < 1) or min(a.batches) < 1:
        ap.error(f"--contexts {a.contexts} and --batches {a.batches} must be positive")
    max_context = model_spec(a.model).max_context  # reads only the model's config
    if max_context and max(contexts) > max_context and not a.ignore_max_context:
        print(f"bench_decode.py: error: --contexts {max(contexts)} is longer than {a.model}'s max_position_embeddings "
              f"({max_context}); add --ignore-max-context to measure decode speed there anyway", file=sys.stderr)
        raise SystemExit(2)
    import re

    for name in a.configs + ([a.one_row[0]] if a.one_row else []):
        if is_config_file(name):
            try:
                KiviConfig.from_json(name)
            except (OSError, ValueError, TypeError) as e:
                ap.error(f"--configs: {name!r} is not a readable KiviConfig JSON file: {e}")
        elif not re.fullmatch(r"dynamic|floor|quanto[24]|kivi([12348]|tiers|fp)-(reference|cpu|triton)", name):
            ap.error(f"--configs: {name!r} is not one of dynamic, floor, quanto2, quanto4, "
                     "kivi<bits>-<backend> (bits 1/2/3/4/8, 'tiers' or 'fp', backend reference/cpu/triton), "
                     "or a KiviConfig file ending in .json")
    names = [row_name(n) for n in a.configs]
    if len(set(names)) != len(names):
        ap.error(f"--configs: two rows would share a name ({names}); rename a config file")
    model = None
    if not a.isolate:
        model = load_model(a.model)[0]
        _warm(model)
    row_kw = dict(fill=a.fill, prefill_chunk=a.prefill_chunk, max_context=max_context)
    set_threads(a.threads, SINGLE_SEQUENCE)  # the numba kernels load now, not inside the first timed decode
    if a.one_row:
        name, ctx, bs = a.one_row[0], int(a.one_row[1]), int(a.one_row[2])
        r = _row(model, name, ctx, bs, a.steps, a.warmup_steps, **row_kw)
        r.update(steps=a.steps)
        print(json.dumps(r))
        return
    rows = [(ctx, bs, name) for ctx in a.contexts for bs in a.batches for name in a.configs]
    runs: dict = {row: [] for row in rows}
    for rep in range(a.repeat):
        for ctx, bs, name in rows:
            if a.isolate:
                r = _row_isolated(name, ctx, bs, a.steps, a.warmup_steps, a.threads, a.pin_allocator, a)
            else:
                r = _row(model, name, ctx, bs, a.steps, a.warmup_steps, **row_kw)
            r.update(steps=a.steps, round=rep)
            runs[(ctx, bs, name)].append(r)
            if a.repeat > 1 and not a.json:
                shown = r.get("error") or f"{r['tok_s']:.2f} tok/s"
                print(f"  round {rep + 1}/{a.repeat} ctx={ctx} bs={bs} {row_name(name)}: {shown}", flush=True)
        if a.json_out and rep + 1 < a.repeat:  # an interrupted run keeps its finished rounds
            _write_json(a.json_out, _results(runs, a.contexts, a.batches, a.configs), a, rounds_done=rep + 1)
    results = _results(runs, a.contexts, a.batches, a.configs)
    if not a.json:
        for r in results:
            _print_row(r, a.repeat)
    if model is not None:
        dequantize_model(model)
    if a.json:
        print(json.dumps(_document(results, a, a.repeat), indent=2))
    if a.json_out:
        _write_json(a.json_out, results, a, rounds_done=a.repeat)


def _document(results, a, rounds_done: int) -> dict:
    return {"threads": torch.get_num_threads(), "steps": a.steps, "warmup_steps": a.warmup_steps,
            "repeat": a.repeat, "rounds_done": rounds_done, "isolate": a.isolate, "model": a.model,
            "fill": a.fill, "prefill_chunk": a.prefill_chunk, "ignore_max_context": a.ignore_max_context,
            "configs": a.configs, "results": results}


def _write_json(path, results, a, *, rounds_done: int) -> None:
    write_json(path, _document(results, a, rounds_done))


def _kivi2_row(configs):
    """The KIVI-2 row the others are compared with: ``kivi2-cpu`` if present, else the first ``kivi2-*``."""
    names = [n for n in configs if n.startswith("kivi2-")]
    return "kivi2-cpu" if "kivi2-cpu" in names else (names[0] if names else None)


def _results(runs, contexts, batches, configs):
    """One summary per (context, batch, config) over the rounds run so far, with the in-run ratios."""
    results = []
    k2name = _kivi2_row(configs)
    for ctx in contexts:
        for bs in batches:
            group = {name: _summarise(runs[(ctx, bs, name)]) for name in configs if runs[(ctx, bs, name)]}
            base, q2, floor, k2 = (group.get(n) for n in ("dynamic", "quanto2", "floor", k2name))
            base = base if base and "error" not in base else None
            q2 = q2 if q2 and "error" not in q2 else None
            floor = floor if floor and "error" not in floor else None
            k2 = k2 if k2 and "error" not in k2 else None
            for name in configs:
                r = group.get(name)
                if r is None:
                    continue
                if "error" not in r and name != "floor":
                    if base:
                        r["speed_vs_dynamic"] = r["tok_s"] / base["tok_s"]
                        r["rss_vs_dynamic"] = r["peak_rss_delta_MiB"] / max(base["peak_rss_delta_MiB"], 1e-9)
                    if k2:
                        r["speed_vs_kivi2"] = r["tok_s"] / k2["tok_s"]
                        if "tok_per_cpu_s" in r and "tok_per_cpu_s" in k2:
                            r["cpu_speed_vs_kivi2"] = r["tok_per_cpu_s"] / k2["tok_per_cpu_s"]
                    if q2:
                        r["speed_vs_quanto2"] = r["tok_s"] / q2["tok_s"]
                    if floor:
                        r["cache_attention_ms_per_step"] = r["ms_per_step"] - floor["ms_per_step"]
                        qa = q2["ms_per_step"] - floor["ms_per_step"] if q2 else 0.0
                        if qa > 0.5 and r["cache_attention_ms_per_step"] > 0.5:  # below that: noise
                            r["cache_attention_vs_quanto2"] = qa / r["cache_attention_ms_per_step"]
                results.append(r)
    return results


def _print_row(r, repeat):
    name, ctx, bs = r["config"], r["context"], r["batch"]
    if "error" in r:
        print(f"ctx={ctx:6d} bs={bs} {name:28s} ERROR {r['error']}{_marks(r)}", flush=True)
        return
    spread = f" [{min(r['tok_s_all']):.2f}-{max(r['tok_s_all']):.2f}]" if repeat > 1 else ""
    vq = f"  x{r['speed_vs_kivi2']:5.2f} vs kivi2" if "speed_vs_kivi2" in r else ""
    vq += f" (CPU time x{r['cpu_speed_vs_kivi2']:5.2f})" if "cpu_speed_vs_kivi2" in r else ""
    vq += f"  x{r['speed_vs_quanto2']:5.2f} vs quanto2" if "speed_vs_quanto2" in r else ""
    ca = ""
    if "cache_attention_ms_per_step" in r:
        ca = f"  cache+attn {r['cache_attention_ms_per_step']:6.1f} ms/step"
        if "cache_attention_vs_quanto2" in r:
            ca += f" (quanto2 / this x{r['cache_attention_vs_quanto2']:5.2f})"
    ctx_s = f"{FLOOR_CONTEXT:6d}" if name == "floor" else f"{ctx:6d}"
    print(f"ctx={ctx_s} bs={bs} {name:28s} {r['tok_s']:8.2f} tok/s{spread}  {r['ms_per_step']:7.1f} ms/step  "
          f"x{r.get('speed_vs_dynamic', 1):5.2f}{vq}{ca}  peakRSSΔ {r['peak_rss_delta_MiB']:8.1f} MiB  "
          f"cache {r['cache_MiB']:.1f} MiB{_marks(r)}",
          flush=True)


def _marks(r):
    """What the table line must say about how a row was measured: a random fill, a context past the model's."""
    marks = ["random K/V fill"] if r.get("fill") == "random" else []
    if r.get("beyond_max_context"):
        marks.append(f"beyond max context {r['max_context']}: speed only")
    return f"  [{'; '.join(marks)}]" if marks else ""


if __name__ == "__main__":
    main()
