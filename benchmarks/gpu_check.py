"""kivi on a GPU, one run (``bash scripts/gpu-check.sh``; docs/kernels.md, "Checking on a GPU").

Four parts, each with its own time budget (a part stops starting new work after its ``--*-seconds``):

a. correctness, in float16 and bfloat16: every Triton kernel against its torch reference (decode attention over
   one packed segment, quantize + pack, the backend's cache layouts: plain ``extreme``, sinks ``balanced`` /
   ``high``, a sliding layer that evicted its front; the batched paged decode over shuffled page blocks and
   wrapping window rings; the vLLM plugin's layer step, whose page and ring writes must equal the CPU
   reference's byte for byte), then ``quantize_model(...).generate()`` on small random-weight models
   (Llama: ``extreme``, ``balanced``, per-head widths; Mistral with a sliding window): greedy tokens of the
   ``"triton"`` backend against the ``"reference"`` backend's, under the near-tie rule of
   ``tests/helpers.py`` (:func:`assert_greedy_close`);
b. kernel timings: ``benchmarks/bench_triton_gpu.py`` (decode attention vs the faster of SDPA / flash, contexts
   4K-128K, batch 1-16, GB/s);
c. the spec's table at LLaMA-2-13B's shape (40 layers, 40 heads, head dim 128; random bf16 weights built from a
   ``LlamaConfig``): ``generate()`` with ``min_new_tokens`` = ``max_new_tokens`` at 32K first, then 4K / 16K
   (64K last), batch 1, 4 and the largest batch that fits, per cache (bf16 ``DynamicCache``, transformers'
   ``QuantizedCache`` (quanto, 2 bits) where it runs, kivi ``extreme`` and ``balanced``): KV bytes (GPU memory
   the finished cache holds), peak GPU memory, prefill tokens/s, decode tokens/s. The largest batch is
   estimated from the batch-1 run's peak (linear in the batch) and then run; an OOM steps it down;
d. ``gpu_check.json`` and ``gpu_check.txt`` in ``--out-dir``, rewritten after every part and table row. The JSON's
   top level holds ``device`` and ``ratio_32k`` (kivi ``extreme``'s decode tokens/s at the largest batch it fits
   at 32K over bf16 ``DynamicCache``'s at the largest batch it fits; ``None`` until both ran).

``--dry-run``: tiny shapes on CPU under ``TRITON_INTERPRET=1`` (a 2-layer stand-in for the 13B shape), every
part end to end, to check the script, not to time. Exit code 1 when a correctness check failed.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # triton reads this when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]  # bench_triton_gpu / plugin_step; tests.helpers

import bench_triton_gpu as bench  # noqa: E402
import plugin_step  # noqa: E402
from kivi.attention.reference import reference_attention  # noqa: E402
from kivi.attention.triton_backend import triton_view_attention  # noqa: E402
from kivi.cache.sliding import new_layer  # noqa: E402
from kivi.config import KiviConfig  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: the spec's rows (LLaMA-2-13B, A100-80GB, batch 4): KV bytes and generated tokens/s at 32K, speedups by context
SPEC = dict(kv_gb_32k=dict(bf16=25.6, kivi=3.2), tokens_per_s_32k=dict(bf16=1240, kivi=4300), ratio_32k=3.47,
            speedup=dict(zip(("4K", "16K", "32K", "64K"), (1.8, 2.9, 3.47, 3.5))))
SHAPE_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                 num_key_value_heads=40, head_dim=128, vocab_size=32000)
SHAPE_DRY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=32, vocab_size=128)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def environment(device) -> dict:
    import transformers

    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               torch_cuda=torch.version.cuda)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # pragma: no cover - triton is needed for every part
        env["triton"] = f"not importable: {e}"
    try:
        env["kivi_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["kivi_commit"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}",
                   gpu_memory_bytes=p.total_memory)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:
            env["driver"] = f"nvidia-smi failed: {e}"
    else:
        env.update(device="cpu (TRITON_INTERPRET=1, dry run)", driver=None)
    return env


# ------------------------------------------------------------------------------------------ a. correctness
def _row(kind, dtype_name, err, ok, **extra) -> dict:
    row = dict(kind=kind, dtype=dtype_name, max_abs_err=err, ok=bool(ok), **extra)
    print(f"check {kind:<34} {dtype_name}: max|err| {err:.2e} -> {'OK' if ok else 'FAIL'}"
          + (f" ({extra['error']})" if "error" in extra else ""), flush=True)
    return row


def _guarded(kind, dtype_name, fn) -> list[dict]:
    """``fn()`` -> rows; an exception (a compile error on the device, an OOM) becomes one failed row."""
    try:
        return fn()
    except Exception as e:
        return [_row(kind, dtype_name, float("nan"), False, error=f"{type(e).__name__}: {e}"[:400])]


def layout_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """The backend's kernel path over a KiviLayer's views against ``reference_attention``: per preset (plain,
    sinks), and a sliding layer whose store evicted its front."""
    geometry = (dict(block_size=32, group_size=16, residual_length=16) if dry
                else dict(block_size=256, group_size=32, residual_length=128))
    B, hq, hkv, d = (2, 4, 2, 32) if dry else (2, 32, 8, 128)
    T, extra = (150, 60) if dry else (4096 + 37, 1024)
    rows = []
    for preset in bench.LAYOUT_PRESETS:
        def one(preset=preset):
            _, kv, vv = bench.layered_views(B, hkv, d, T, extra, preset, dtype, device, **geometry)
            q = torch.randn(B, hq, 1, d, device=device, dtype=dtype)
            got = triton_view_attention(q, kv, vv, scaling=d ** -0.5, attention_mask=None)
            ref = reference_attention(q, kv, vv, scaling=d ** -0.5)
            err = (got.float() - ref.float()).abs().max().item()
            return [_row(f"layout {preset} (sinks {kv.sink is not None})", dtype_name, err, err < 2e-2,
                         context=T, batch=B)]
        rows += _guarded(f"layout {preset}", dtype_name, one)

    def sliding():
        cfg = KiviConfig(**geometry)
        window = 2 * geometry["block_size"]
        g = torch.Generator(device=device).manual_seed(3)
        k = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
        layer = new_layer(cfg, window)
        pos = T - extra
        layer.append(k[:, :, :pos], v[:, :, :pos])
        for t in range(pos, T - 1, max(1, extra // 8)):
            layer.append(k[:, :, t : min(T - 1, t + extra // 8)], v[:, :, t : min(T - 1, t + extra // 8)])
        kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
        q = torch.randn(B, hq, 1, d, device=device, dtype=dtype)
        got = triton_view_attention(q, kv, vv, scaling=d ** -0.5, attention_mask=None)
        ref = reference_attention(q, kv, vv, scaling=d ** -0.5)
        err = (got.float() - ref.float()).abs().max().item()
        return [_row("layout sliding (front evicted)", dtype_name, err, err < 2e-2 and kv.start > 0,
                     context=T, evicted=kv.start)]

    return rows + _guarded("layout sliding", dtype_name, sliding)


def paged_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """The batched paged decode (shuffled page blocks, window rings) against ``torch_paged_decode``, and the vLLM
    plugin's layer step (paged writes, rings wrapped twice) against the CPU reference."""
    hq, hkv, d = (4, 2, 32) if dry else (32, 8, 128)
    N, T = (3, 301) if dry else (4, 4096 + 37)

    def paged():
        q, pool, lay, table, counts, kr, vr, w0, _, _ = bench.paged_batch(N, hq, hkv, d, T, dtype, device)
        got = bench.triton_paged_decode(q, pool, lay, table, counts, kr, vr, w0, scaling=d ** -0.5)
        ref = bench.torch_paged_decode(q, pool, lay, table, counts, kr, vr, w0, scaling=d ** -0.5)
        err = (got.float() - ref.float()).abs().max().item()
        return [_row("paged decode (shuffled blocks, rings)", dtype_name, err, err < 2e-2, requests=N, context=T)]

    rows = _guarded("paged decode", dtype_name, paged)
    if dry:  # the fewest steps that still wrap the rings twice (one interpreted step takes ~2 s), fp16 only
        configs, page, steps = [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, sink_tokens=2)], 16, 32
        if dtype != torch.float16:
            return rows
    else:
        configs, page, steps = [KiviConfig.preset("balanced"), KiviConfig.preset("extreme")], 128, None
    for cfg in configs:
        name = f"plugin step K{cfg.k_bits}V{cfg.v_bits} S{cfg.sink_tokens} (paged write)"

        def step(cfg=cfg, name=name):
            r = plugin_step.check(cfg, device, dtype, hq, hkv, d, page_size=page, decode_steps=steps)
            ok = r["ok"] and r["pages_equal"] and r["rings_equal"] and r["rings_wrapped"]
            return [_row(name, dtype_name, r["max_abs_err"], ok, pages_equal=r["pages_equal"],
                         rings_equal=r["rings_equal"], rings_wrapped=r["rings_wrapped"], steps=r["steps"])]
        rows += _guarded(name, dtype_name, step)
    return rows


def generate_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """``quantize_model(model, cfg).generate()`` greedily with the ``"triton"`` backend against ``"reference"``:
    tokens equal up to a near-tie (``tests/helpers.py``), on small random-weight models."""
    from kivi import KiviCache, quantize_model
    from kivi.integration import generate_cache_key
    from tests.helpers import LOGIT_ATOL, assert_greedy_close, greedy, tiny_model

    atol = LOGIT_ATOL[torch.bfloat16]  # the half-precision bound (fp16 rounds finer than bf16)
    small = dict(group_size=8, residual_length=16, block_size=16)
    cases = [("llama", "extreme", {}), ("llama", "balanced", {}),
             ("llama", "per-head", dict(head_bits={0: {"k_bits": [2, 4, 2], "v_bits": [2, 2, 4]}}, sink_tokens=2)),
             ("mistral", "balanced", dict(sliding_window=24))]
    shape = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_key_value_heads=3,
                 num_hidden_layers=1 if dry else 2)
    P, n = (40, 4) if dry else (300, 24)
    rows = []
    if dry and dtype != torch.bfloat16:  # ~30 s per dtype in the interpreter: the dry run checks bf16's
        return rows
    for model_type, preset, extra in cases:
        name = f"generate {model_type} {preset}"

        def one(model_type=model_type, preset=preset, extra=extra, name=name):
            extra = dict(extra)
            window = extra.pop("sliding_window", None)
            kw = dict(shape, **({"sliding_window": window} if window else {}))
            model = tiny_model(model_type, weight_scale=2.0, **kw).to(device=device, dtype=dtype)
            cfg = (KiviConfig(**small, **extra) if preset == "per-head" else KiviConfig.preset(preset, **small))
            model = quantize_model(model, cfg)
            ids = torch.randint(0, model.config.vocab_size, (2, P), generator=torch.Generator().manual_seed(0))
            ids = ids.to(device)
            runs = {}
            for backend in ("triton", "reference"):
                cache = KiviCache.from_model_config(model.config, cfg, attention_backend=backend)
                runs[backend] = greedy(model, ids, new_tokens=n, **{generate_cache_key(model): cache})
            a, b = runs["triton"].scores, runs["reference"].scores
            both = torch.isfinite(a) & torch.isfinite(b)
            err = (a[both] - b[both]).abs().max().item()
            try:
                compared = assert_greedy_close(runs["triton"], runs["reference"], atol=atol)
                ok, note = True, {}
            except AssertionError as e:
                compared, ok, note = None, False, dict(error=str(e)[:400])
            same = bool(torch.equal(runs["triton"].sequences, runs["reference"].sequences))
            return [_row(name, dtype_name, err, ok, tokens_equal=same, steps_compared=compared, atol=atol,
                         prompt=P, new_tokens=n, **note)]
        rows += _guarded(name, dtype_name, one)
    return rows


def part_correctness(device, dry: bool, budget: float) -> dict:
    t0, rows, skipped = time.time(), [], []
    models = bench.DRY_MODELS if dry else bench.MODELS
    check_T = 229 if dry else 4096 + 37
    for dtype_name, dtype in DTYPES.items():
        for what, fn in (("packed", None), ("layouts", layout_checks), ("paged", paged_checks),
                         ("generate", generate_checks)):
            if time.time() - t0 > budget:
                skipped.append(f"{what} {dtype_name}")
                continue
            if fn is None:
                for r in _guarded("packed decode + quantize", dtype_name,
                                  lambda dtype=dtype: bench.correctness(models, device, dtype, check_T)):
                    rows.append(dict(r, kind=r.get("kind", f"packed decode + quantize {r.get('model')}"),
                                     dtype=dtype_name, max_abs_err=r.get("attn_max_abs_err", r.get("max_abs_err"))))
            else:
                rows += fn(device, dtype, dtype_name, dry)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return dict(rows=rows, skipped=skipped, ok=all(r["ok"] for r in rows), seconds=time.time() - t0)


# ------------------------------------------------------------------------------------------ b. kernel timings
def part_kernels(device, dry: bool, budget: float, out_dir: Path) -> dict:
    t0 = time.time()
    path = out_dir / "bench_triton_gpu.json"
    argv = ["--out", str(path), "--max-seconds", str(budget), "--no-plugin"]  # the plugin step is checked in a.
    if dry:
        argv += ["--dry-run", "--models", "smollm2-tiny", "--contexts", "160", "--batches", "1", "--warmup", "1",
                 "--iters", "1", "--no-layouts", "--paged-contexts", "160", "--paged-batches", "2"]
    try:
        rc = bench.main(argv)
        data = json.loads(path.read_text())
    except Exception as e:
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[:400], seconds=time.time() - t0)
    keep = ("results", "paged", "layouts", "skipped")
    return dict(ok=rc == 0, json=path.name, seconds=time.time() - t0, **{k: data.get(k) for k in keep})


# ------------------------------------------------------------------------------------------ c. the 13B table
class _Clock:
    """A logits processor that records when ``generate`` has the prefill's logits (its first call)."""

    def __init__(self, device):
        self.device, self.first = device, None

    def __call__(self, input_ids, scores):
        if self.first is None:
            _sync(self.device)
            self.first = time.perf_counter()
        return scores


def build_model(shape: dict, device, dtype, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


def _cache_for(name: str, model, dry: bool):
    """``(kivi config or None, cache object or None)``; ``None`` cache: generate's own (bf16 DynamicCache or
    kivi's via quantize_model)."""
    from kivi import quantize_model
    from kivi.integration import dequantize_model

    dequantize_model(model)
    if name == "bf16":
        return None, None
    if name == "quantized":
        from transformers import QuantizedCache

        return None, QuantizedCache(backend="quanto", config=model.config, nbits=2, q_group_size=64,
                                    residual_length=128)
    if not dry:
        cfg = KiviConfig.preset(name)  # attention_backend "auto": "triton" on CUDA
        quantize_model(model, cfg)
        return cfg, None
    # the dry run: "kivi" attention through a "reference" model config, the cache reading with "triton" (the
    # interpreter; "auto" would pick the numba kernel on CPU, and "triton" refuses a CPU model)
    from kivi import KiviCache

    cfg = KiviConfig.preset(name, group_size=16, residual_length=16, block_size=32, attention_backend="reference")
    quantize_model(model, cfg)
    return cfg, KiviCache.from_model_config(model.config, cfg, attention_backend="triton")


def generate_row(model, name: str, T: int, B: int, new_tokens: int, device, dry: bool) -> dict:
    from transformers import LogitsProcessorList

    from kivi.integration import generate_cache_key

    row = dict(cache=name, context=T, batch=B, new_tokens=new_tokens)
    cfg, cache = _cache_for(name, model, dry)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(T + B))
    ids = ids.to(device)
    clock = _Clock(device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
              logits_processor=LogitsProcessorList([clock]), attention_mask=torch.ones_like(ids))
    if cache is not None:
        kw[generate_cache_key(model)] = cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    _sync(device)
    t1 = time.perf_counter()
    held = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    prefill_s, decode_s = clock.first - t0, t1 - clock.first
    row.update(prefill_s=prefill_s, decode_s=decode_s, prefill_tokens_per_s=B * T / prefill_s,
               decode_tokens_per_s=B * (new_tokens - 1) / decode_s if new_tokens > 1 else None,
               generated_tokens_per_s=B * new_tokens / (t1 - t0))
    if device.type == "cuda":
        row.update(kv_bytes=torch.cuda.memory_allocated(device) - base - out.sequences.nbytes,
                   peak_bytes=torch.cuda.max_memory_allocated(device), weights_bytes=base)
    if cfg is not None:
        row["attention_backend"] = str(getattr(getattr(held, "backend", None), "name", model.kivi_attention_backend))
        n = getattr(held, "nbytes", None)
        row["kivi_nbytes"] = n() if callable(n) else n
    if "kv_bytes" not in row:  # CPU (dry run): what the cache's tensors hold
        row["kv_bytes"] = row.get("kivi_nbytes") or _tensor_bytes(held)
    del out, held
    return row


def _tensor_bytes(cache) -> int:
    n = 0
    for layer in getattr(cache, "layers", []):
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor):
                n += v.nbytes
    return n


def _fmt(row: dict) -> str:
    if "error" in row:
        return f"{row['cache']:>9} {row['context']:>6} {row['batch']:>4} | {row['error'][:90]}"
    gb = lambda x: f"{x / 1e9:8.2f}" if x is not None else f"{'-':>8}"  # noqa: E731
    dec = row.get("decode_tokens_per_s")
    return (f"{row['cache']:>9} {row['context']:>6} {row['batch']:>4} | {gb(row.get('kv_bytes'))} "
            f"{gb(row.get('peak_bytes'))} | {row['prefill_tokens_per_s']:9.0f} "
            f"{(f'{dec:9.1f}' if dec else '-'):>9} {row['generated_tokens_per_s']:9.1f}")


TABLE_HEADER = (f"{'cache':>9} {'ctx':>6} {'B':>4} | {'KV GB':>8} {'peak GB':>8} | {'prefill/s':>9} "
                f"{'decode/s':>9} {'gen/s':>9}")


def plan(contexts: list[int], caches: list[str]) -> list[tuple[str, int, object]]:
    """Runs in priority order: 32K (or the middle context) first — batch 1, the largest batch per cache —, then
    batch 1 / 4 / largest at the other contexts, 64K (or the longest) last."""
    key = 32768 if 32768 in contexts else sorted(contexts)[len(contexts) // 2]
    order = [key] + [c for c in sorted(contexts) if c != key]
    runs = []
    for T in order:
        for name in caches:
            runs += [(name, T, 1), (name, T, "max")]
        runs += [(name, T, 4) for name in caches]
    return runs


def part_table(device, dry: bool, budget: float, contexts: list[int], new_tokens: int, max_batch: int,
               caches: list[str], on_row) -> dict:
    t0 = time.time()
    shape = SHAPE_DRY if dry else SHAPE_13B
    dtype = torch.bfloat16
    rows, skipped = [], []
    try:
        model = build_model(shape, device, dtype, max(contexts) + new_tokens + 16)
    except Exception as e:
        return dict(ok=False, error=f"model: {type(e).__name__}: {e}"[:400], rows=[], seconds=time.time() - t0)
    weights = sum(p.nbytes for p in model.parameters())
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    print(f"\n13B-shape table: {shape}, weights {weights / 1e9:.1f} GB (random bf16), {new_tokens} new tokens")
    print(TABLE_HEADER)
    print("-" * len(TABLE_HEADER))
    per_seq = {}  # (cache, T) -> peak bytes above the weights at batch 1
    seconds_1 = {}  # (cache, T) -> batch 1's generate() seconds
    done = set()
    for name, T, B in plan(contexts, caches):
        if time.time() - t0 > budget:
            skipped.append(dict(cache=name, context=T, batch=B))
            continue
        label, b_mem = B, None
        if B == "max":
            if (name, T) not in per_seq:
                skipped.append(dict(cache=name, context=T, batch=B, reason="batch 1 did not run"))
                continue
            if total is None:  # dry run: the memory model cannot be measured on CPU; a small batch stands in
                B = 3
            else:
                B = b_mem = max(1, min(max_batch, int((0.92 * total - weights) // per_seq[(name, T)])))
                # one generate() cannot be stopped: a batch whose estimated time (batch 1's, times B) does not
                # fit in what is left of the budget is cut to one that does, and says so
                left = budget - (time.time() - t0)
                fits = int(left // max(seconds_1[(name, T)], 1e-3))
                if fits < B:
                    print(f"{name} T={T}: largest batch {B} by memory, {max(fits, 1)} by the time left", flush=True)
                    B = max(1, fits)
        if (name, T, B) in done:
            continue
        if label == 4 and (name, T) in seconds_1 and 4 * seconds_1[(name, T)] > budget - (time.time() - t0):
            skipped.append(dict(cache=name, context=T, batch=B, reason="batch 1's time x 4 exceeds the budget left"))
            continue
        while True:
            try:
                row = generate_row(model, name, T, B, new_tokens, device, dry)
                row["plan"] = label  # 1, 4 or "max" (the largest batch that fits, estimated then run)
                row["max_batch_by_memory"] = b_mem  # "max" rows: the memory estimate (None: batch 1 / 4, dry run)
                break
            except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                row = dict(cache=name, context=T, batch=B, error=f"OOM: {str(e)[:150]}")
                torch.cuda.empty_cache()
                if B > 1 and time.time() - t0 < budget:
                    print(_fmt(row), flush=True)
                    rows.append(row)
                    B = max(1, int(B * 0.8))
                    continue
                break
            except Exception as e:  # QuantizedCache without its backend, a kernel failure: reported, the rest runs
                row = dict(cache=name, context=T, batch=B, error=f"{type(e).__name__}: {e}"[:300])
                break
        done.add((name, T, B))
        if B == 1 and "error" not in row:
            per_seq[(name, T)] = row.get("peak_bytes", weights) - weights
            seconds_1[(name, T)] = row["prefill_s"] + row["decode_s"]
        rows.append(row)
        print(_fmt(row), flush=True)
        on_row(rows)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(ok=True, shape=shape, weights_bytes=weights, new_tokens=new_tokens, rows=rows, skipped=skipped,
                seconds=time.time() - t0)


def largest(rows: list[dict], cache: str, T: int) -> dict | None:
    ok = [r for r in rows if r["cache"] == cache and r["context"] == T and "error" not in r]
    return max(ok, key=lambda r: (r["batch"], r["decode_tokens_per_s"] or 0), default=None)


def ratio_32k(rows: list[dict], T: int = 32768) -> dict | None:
    """kivi extreme's decode tokens/s at the largest batch it ran at ``T`` over bf16 DynamicCache's."""
    a, b = largest(rows, "extreme", T), largest(rows, "bf16", T)
    if not a or not b or not a["decode_tokens_per_s"] or not b["decode_tokens_per_s"]:
        return None
    return dict(ratio=a["decode_tokens_per_s"] / b["decode_tokens_per_s"], context=T,
                kivi_batch=a["batch"], bf16_batch=b["batch"],
                kivi_decode_tokens_per_s=a["decode_tokens_per_s"], bf16_decode_tokens_per_s=b["decode_tokens_per_s"],
                generated_ratio=a["generated_tokens_per_s"] / b["generated_tokens_per_s"])


# ------------------------------------------------------------------------------------------ d. results
def text_report(result: dict) -> str:
    lines = [f"device: {result['device']}", f"env: {json.dumps(result['env'])}", ""]
    a = result.get("correctness") or {}
    lines.append(f"a. correctness: {'OK' if a.get('ok') else 'FAIL'} ({len(a.get('rows', []))} checks)")
    for r in a.get("rows", []):
        lines.append(f"   {r['kind']:<44} {r['dtype']}  max|err| {r['max_abs_err']:.2e}  {'OK' if r['ok'] else 'FAIL'}")
    b = result.get("kernels") or {}
    lines.append(f"\nb. kernel timings: {len(b.get('results') or [])} decode rows, {len(b.get('paged') or [])} paged "
                 f"rows ({b.get('json')})")
    for r in b.get("results") or []:
        if "kivi_ms" in r:
            lines.append(f"   {r['model']:>13} B={r['batch']:>3} T={r['context']:>7}: kivi {r['kivi_ms']:.3f} ms "
                         f"({r['kivi_gbps']:.0f} GB/s), sdpa {r['sdpa_ms']:.3f} ms, {r['speedup']:.2f}x")
    c = result.get("table") or {}
    lines += ["", f"c. 13B-shape table ({c.get('new_tokens')} new tokens; tokens/s)", "   " + TABLE_HEADER]
    lines += ["   " + _fmt(r) for r in c.get("rows", [])]
    lines.append(f"\nratio_32k: {result.get('ratio_32k')} (spec: {SPEC['ratio_32k']})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "results/tmp/gpu-check")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--check-seconds", type=float, default=None, help="part a (correctness): s; 90, dry run 3600")
    ap.add_argument("--kernel-seconds", type=float, default=None, help="part b (kernel timings): s; 100, dry run 3600")
    ap.add_argument("--table-seconds", type=float, default=None, help="part c (13B-shape table): s; 210, dry run 3600")
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="part c's contexts")
    ap.add_argument("--new-tokens", type=int, default=None, help="part c: min_new_tokens = max_new_tokens")
    ap.add_argument("--max-batch", type=int, default=64, help="part c: the largest batch tried")
    ap.add_argument("--caches", nargs="*", default=["bf16", "extreme", "balanced", "quantized"])
    ap.add_argument("--parts", default="abc", help="which of the parts a, b, c run")
    args = ap.parse_args(argv)
    t_start = time.time()
    # the dry run checks that every part runs to its end (the interpreter's speed varies with the machine's load)
    for name, val in (("check", 90.0), ("kernel", 100.0), ("table", 210.0)):
        if getattr(args, f"{name}_seconds") is None:
            setattr(args, f"{name}_seconds", 3600.0 if args.dry_run else val)
    if args.dry_run:
        device = torch.device("cpu")
        contexts, new_tokens = args.contexts or [48, 96], args.new_tokens or 3
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        contexts, new_tokens = args.contexts or [4096, 16384, 32768, 65536], args.new_tokens or 32
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    print(f"device: {env['device']}; driver {env.get('driver')}; torch {env['torch']} (CUDA {env['torch_cuda']}); "
          f"triton {env['triton']}; transformers {env['transformers']}; kivi {env['kivi_commit']}", flush=True)
    result = dict(device=env["device"], ratio_32k=None, env=env, dry_run=args.dry_run, spec=SPEC,
                  correctness=None, kernels=None, table=None, argv=sys.argv[1:] if argv is None else argv)

    def write():
        result["wall_s"] = time.time() - t_start
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out_dir / "gpu_check.txt").write_text(text_report(result))

    write()
    if "a" in args.parts:
        print("\n== a. correctness (fp16, bf16) ==", flush=True)
        result["correctness"] = part_correctness(device, args.dry_run, args.check_seconds)
        write()
    if "b" in args.parts:
        print("\n== b. kernel timings (benchmarks/bench_triton_gpu.py) ==", flush=True)
        result["kernels"] = part_kernels(device, args.dry_run, args.kernel_seconds, out_dir)
        write()
    if "c" in args.parts:
        print("\n== c. the spec's table at LLaMA-2-13B's shape ==", flush=True)

        def on_row(rows):
            result["table"] = dict(rows=rows, partial=True)
            write()

        result["table"] = part_table(device, args.dry_run, args.table_seconds, contexts, new_tokens, args.max_batch,
                                     args.caches, on_row)
        key = 32768 if 32768 in contexts else sorted(contexts)[len(contexts) // 2]
        r = ratio_32k(result["table"]["rows"], key)
        result["ratio_32k"] = r["ratio"] if r else None
        result["ratio_32k_detail"] = r
    write()
    print("\n" + text_report(result))
    print(f"wrote {out_dir / 'gpu_check.json'} and gpu_check.txt ({time.time() - t_start:.1f} s)")
    ok = (result["correctness"] or {"ok": True})["ok"] and (result["kernels"] or {"ok": True})["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
