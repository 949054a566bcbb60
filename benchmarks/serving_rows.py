"""The rows of ``bench_serving.py``: one continuous-batching run over a byte budget, or the same requests
served one at a time by ``generate()``; and the workloads they serve.

A row returns a dict of measurements (generated tokens/s first) and the greedy tokens of every request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from kivi import KiviConfig
from kivi.batching import init_continuous_batching

#: continuous-batching rows: name -> the pages' KiviConfig (None: transformers' float paged cache)
ROWS = {"float": None, "kivi-2/2": KiviConfig(k_bits=2, v_bits=2), "balanced": KiviConfig.preset("balanced"),
        # the materialized path: pages dequantized one layer at a time, transformers' SDPA (not run by default)
        "kivi-2/2-sdpa": KiviConfig(k_bits=2, v_bits=2, attention_backend="reference"),
        # a 32-token window: a short request's window blocks, not its pages, bound how many fit a tight budget
        "kivi-2/2-r32": KiviConfig(k_bits=2, v_bits=2, residual_length=32)}
#: one-at-a-time rows: name -> the cache generate() builds (None: DynamicCache; a KiviConfig: quantize_model's)
BASELINES = {"dynamic": None, "kivi-2/2": ROWS["kivi-2/2"], "balanced": ROWS["balanced"]}


@dataclass
class Workload:
    """Requests submitted at once: ``prompts[i]`` (token ids) generating ``new_tokens[i]`` greedy tokens (no EOS)."""

    name: str
    prompts: list[list[int]]
    new_tokens: list[int]


def uniform(n: int, length: int, new_tokens: int, shared: float, vocab: int, seed: int) -> Workload:
    """``n`` random-id prompts of ``length`` tokens; the first ``shared`` fraction is one common prefix."""
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 4)  # above the special tokens of a real vocabulary (and of a tiny one)
    common = torch.randint(low, vocab - 1, (int(length * shared),), generator=g).tolist()
    prompts = [common + torch.randint(low, vocab - 1, (length - len(common),), generator=g).tolist() for _ in range(n)]
    return Workload(f"shared_prefix_{shared:.2f}", prompts, [new_tokens] * n)


def spread(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` integers spread evenly over ``[lo, hi]``, in an order shuffled by ``seed``."""
    values = [lo + round((hi - lo) * i / max(1, n - 1)) for i in range(n)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [values[i] for i in order]


def decode_heavy(n: int, prompt_range: tuple[int, int], new_range: tuple[int, int], ids: list[int] | None,
                 vocab: int, seed: int) -> Workload:
    """``n`` prompts of lengths spread over ``prompt_range``, each cut from consecutive text ``ids``
    (WikiText-2 tokens; ``None``: random ids, for a model without a tokenizer), with ``new_range`` new tokens."""
    lengths, news = spread(n, *prompt_range, seed), spread(n, *new_range, seed + 1)
    prompts, at = [], 0
    g = torch.Generator().manual_seed(seed)
    for length in lengths:
        if ids is None:
            prompts.append(torch.randint(min(100, vocab // 4), vocab - 1, (length,), generator=g).tolist())
            continue
        if at + length > len(ids):
            at = 0
        prompts.append(ids[at:at + length])
        at += length
    return Workload("decode_heavy", prompts, news)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def latency_columns(t0: float, stamps: list[list[float]], prompts: list[list[int]], wall: float) -> dict:
    """Throughput and latency from each request's token times (``stamps[i]``: seconds of each generated token)."""
    ttft = [s[0] - t0 for s in stamps if s]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    return summary(ttft, tpot, sum(len(s) for s in stamps), prompts, wall)


def summary(ttft: list[float], tpot: list[float], gen: int, prompts: list[list[int]], wall: float) -> dict:
    """The columns every row reports: ``gen`` generated tokens in ``wall`` seconds, the percentiles of the
    requests' times to first token (``ttft``) and per-token latencies (``tpot``)."""
    return {"generated_tokens_per_s": gen / wall, "wall_s": wall, "generated_tokens": gen,
            "total_tokens_per_s": (gen + sum(len(p) for p in prompts)) / wall,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "per_token_p50_s": _pct(tpot, 0.5), "per_token_p95_s": _pct(tpot, 0.95)}


def batch_row(model, cfg: KiviConfig | None, work: Workload, cache_memory: int, cb_kwargs: dict) -> dict:
    """All requests submitted at once to one continuous-batching manager over ``cache_memory`` bytes."""
    gen = GenerationConfig(max_new_tokens=max(work.new_tokens), do_sample=False, eos_token_id=-1)
    manager = init_continuous_batching(model, cfg, cache_memory=cache_memory, generation_config=gen, **cb_kwargs)
    for p, n in zip(work.prompts, work.new_tokens):
        manager.check_request_fits(len(p), n)
    held, results = 0, {}
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = [manager.add_request(p, f"req_{i}", n, record_timestamps=True)
               for i, (p, n) in enumerate(zip(work.prompts, work.new_tokens))]
        while len(results) < len(ids):
            out = manager.get_result(timeout=0.02)
            bp = manager.batch_processor
            if bp is not None:
                held = max(held, len(bp.scheduler.active_requests))
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("the continuous-batching loop stopped")
        wall = time.perf_counter() - t0
        cache = manager.batch_processor.cache
        resolved = manager.batch_processor.scheduler
        transient = getattr(cache, "max_dequantized_bytes", None)
        shared = getattr(cache, "shared_tokens", None)
        blocks = cache.num_blocks
        cb = manager.continuous_batching_config
        settings = {"max_batch_tokens": cb.max_batch_tokens, "scheduler": cb.scheduler_type,
                    "safety_margin": resolved.safety_margin, "attention": model.config._attn_implementation}
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    row = latency_columns(t0, [results[i].timestamps for i in ids], work.prompts, wall)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.new_tokens))
    row.update({"requests_held_at_once": held, "capacity_requests": blocks // manager.request_blocks(longest),
                "cache_blocks": blocks, "block_bytes": manager.block_bytes, "settings": settings,
                "dequantized_transient_bytes": transient, "shared_prompt_tokens": shared,
                "tokens": [results[i].generated_tokens for i in ids]})
    return row


class _Stamps:
    """A ``generate()`` streamer that records the time of every generated token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_row(model, cfg: KiviConfig | None, work: Workload, limit: int | None = None) -> dict:
    """The requests served one after another by ``generate()`` (``cfg``: on a ``quantize_model``-ed model), all
    counted as submitted at the start: request i's first token waits for the requests before it."""
    from kivi import dequantize_model, quantize_model

    prompts = work.prompts[:limit]
    if cfg is not None:
        quantize_model(model, cfg)
    try:
        stamps, tokens = [], []
        t0 = time.perf_counter()
        for p, n in zip(prompts, work.new_tokens):
            s = _Stamps()
            out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=-1,
                                 pad_token_id=0, streamer=s)
            tokens.append(out[0, len(p):].tolist())
            stamps.append(s.times)
        wall = time.perf_counter() - t0
    finally:
        if cfg is not None:
            dequantize_model(model)
    row = latency_columns(t0, stamps, prompts, wall)
    row.update({"requests_held_at_once": 1, "tokens": tokens})
    return row


def identical(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How many requests got the same greedy tokens as ``reference`` (and where each first differs)."""
    first = [next((j for j, (a, b) in enumerate(zip(t, r)) if a != b),
                  None if len(t) == len(r) else min(len(t), len(r))) for t, r in zip(tokens, reference)]
    return {"requests": len(first), "identical": sum(f is None for f in first), "first_differing_token": first}
