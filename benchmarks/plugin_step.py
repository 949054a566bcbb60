"""The vLLM plugin's layer step on a device, for the device script (``benchmarks/bench_triton_gpu.py``).

:func:`kivi.vllm.paged.paged_step` with the ``"triton"`` page reader (the plugin's opt-in GPU path: SDPA prefill,
chunks through kivi's Triton attention, decode rows through the batched paged Triton kernel, torch writes) over one
layer's cache laid out as vLLM allocates it (:class:`LayerCache`). No vLLM is needed: ``paged_step`` is what the
plugin's attention impl calls with vLLM's block tables.

* :func:`check`: one schedule (prefills of odd lengths, a request joining later, a chunk into a request that holds
  tokens, decode steps wrapping the window rings) run on ``device`` with ``"triton"`` and on the CPU with
  ``"reference"`` (kivi's ground truth); the largest output difference over all steps, and whether pages and
  rings end byte-identical (reported, not required: a GPU's float rounding may differ from the CPU's).
* :func:`timing`: ``N`` requests of ``T`` tokens prefilled on ``device``, then decode steps: each step's wall time
  (synchronised) and the decode kernel's share of it (the rest: the writes, the indices, the Python around them).
"""

from __future__ import annotations

import statistics
import time

import torch

from kivi.config import KiviConfig
from kivi.vllm.decode import decode_kernel
from kivi.vllm.geometry import build_geometry
from kivi.vllm.paged import StepBatch, paged_step


class LayerCache:
    """One layer's KIVI pages ``[nblocks, H, P, C]`` and its ``k`` window rings as vLLM allocates them (the rings
    overlay one allocation, ring ``r``'s block ``b`` at ``(b * k + r)`` block bytes, as vLLM packs its groups), and
    block tables handed out per request from shuffled free lists (block 0 is vLLM's null block)."""

    def __init__(self, geo, nblocks: int, dtype: torch.dtype, device, seed: int = 0) -> None:
        H, P, D, k = geo.num_kv_heads, geo.page_size, geo.head_dim, geo.window_rings
        self.geo, self.device = geo, torch.device(device)
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(nblocks - 1, generator=g).add(1).tolist()
        self.rfree = [torch.randperm(nblocks - 1, generator=g).add(1).tolist() for _ in range(k)]
        size = dtype.itemsize
        self.pages = torch.zeros(nblocks, H, P, geo.state_bytes // size, dtype=dtype, device=device)
        bb = geo.block_bytes // size
        rbuf = torch.zeros(nblocks * k * bb, dtype=dtype, device=device)
        self.rings = [rbuf.as_strided((nblocks, H, geo.window_tokens, 2 * D),
                                      (k * bb, geo.window_tokens * 2 * D, 2 * D, 1), r * bb) for r in range(k)]
        self.ptab: dict[int, list[int]] = {}
        self.rtab: dict[int, list[int]] = {}

    def batch(self, rows) -> StepBatch:
        """``rows``: ``[(request, past, q_len)]`` -> the step's :class:`StepBatch` (tables on the cache's device)."""
        P = self.geo.page_size
        qs, seqs = [0], []
        for rid, past, q in rows:
            pt = self.ptab.setdefault(rid, [])
            while len(pt) * P < past + q:
                pt.append(self.free.pop())
            if rid not in self.rtab:
                self.rtab[rid] = [f.pop() for f in self.rfree]
            qs.append(qs[-1] + q)
            seqs.append(past + q)
        width = max(len(self.ptab[r]) for r, _, _ in rows) + 1
        pt = [self.ptab[r] + [0] * (width - len(self.ptab[r])) for r, _, _ in rows]
        return StepBatch(qs, seqs, torch.tensor(pt, dtype=torch.int32, device=self.device),
                         torch.tensor([self.rtab[r] for r, _, _ in rows], dtype=torch.int32, device=self.device))


def schedule(page_size: int, decode_steps: int) -> list[list[tuple[int, int, int]]]:
    """Prefills of 3, 2P + 5, P - 1 and 3P + 17 tokens; then a fifth request's prefill of 40 joins, its next step
    a chunk of 9; every other request decodes one token a step."""
    P = page_size
    held = {0: 3, 1: 2 * P + 5, 2: P - 1, 3: 3 * P + 17}
    steps = [[(rid, 0, n) for rid, n in held.items()]]
    for s in range(1, decode_steps + 1):
        rows = []
        for rid in sorted(held):
            q = 9 if (rid == 4 and s == 2) else 1
            rows.append((rid, held[rid], q))
            held[rid] += q
        if s == 1:
            rows.insert(2, (4, 0, 40))
            held[4] = 40
        steps.append(rows)
    return steps


def check(cfg: KiviConfig, device, dtype: torch.dtype, hq: int, hkv: int, d: int, *, page_size: int,
          decode_steps: int | None = None, seed: int = 0) -> dict:
    """:func:`schedule` through ``paged_step`` on ``device`` (``"triton"``) and on the CPU (``"reference"``);
    ``decode_steps=None``: enough for the first request to wrap its window ring twice."""
    geo = build_geometry(cfg, page_size=page_size, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    ring_part = geo.window_rings * geo.window_tokens - geo.sink_tokens
    if decode_steps is None:
        decode_steps = 2 * ring_part + geo.sink_tokens + 8
    steps = schedule(page_size, decode_steps)
    longest = max(past + q for rows in steps for _, past, q in rows)
    nblocks = 5 * (-(-longest // page_size) + 1) + 1
    fast, slow = LayerCache(geo, nblocks, dtype, device, seed), LayerCache(geo, nblocks, dtype, "cpu", seed)
    g = torch.Generator().manual_seed(seed + 1)
    scale, err = d ** -0.5, 0.0
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        got = paged_step(cfg, geo, "triton", q.to(device), k.to(device), v.to(device), fast.pages, fast.rings,
                         fast.batch(rows), scale, torch.empty(n, hq, d, dtype=dtype, device=device))
        want = paged_step(cfg, geo, "reference", q, k, v, slow.pages, slow.rings, slow.batch(rows), scale,
                          torch.empty(n, hq, d, dtype=dtype), batched_decode=False)
        err = max(err, (got.cpu().float() - want.float()).abs().max().item())
    same = [torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
            for a, b in zip([fast.pages, *fast.rings], [slow.pages, *slow.rings])]
    return dict(config=cfg.to_dict(), page_size=page_size, steps=len(steps),
                rings_wrapped=3 + decode_steps - geo.sink_tokens > 2 * ring_part, max_abs_err=err,
                pages_equal=same[0], rings_equal=all(same[1:]), ok=err < (2e-5 if dtype == torch.float32 else 2e-2))


def timing(cfg: KiviConfig, device, dtype: torch.dtype, hq: int, hkv: int, d: int, *, requests: int, context: int,
           page_size: int, decode_steps: int, seed: int = 0) -> dict:
    """``requests`` prompts of ``context`` tokens prefilled in one step on ``device``, then ``decode_steps`` decode
    steps through ``paged_step`` (``"triton"``, the layer's decode kernel made once as the plugin's impl keeps it):
    median ms of a step and of its decode kernel call."""
    from kivi.kernels import triton_paged

    geo = build_geometry(cfg, page_size=page_size, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    nblocks = requests * (-(-(context + decode_steps) // page_size)) + 2
    cache = LayerCache(geo, nblocks, dtype, device, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    scale = d ** -0.5
    n = requests * context
    q, k, v = (torch.randn(n, h, d, generator=g, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    paged_step(cfg, geo, "triton", q, k, v, cache.pages, cache.rings, cache.batch([(i, 0, context)
               for i in range(requests)]), scale, torch.empty(n, hq, d, dtype=dtype, device=device))
    calls = []
    kernel_fn = triton_paged.triton_paged_decode

    def timed(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = kernel_fn(*args, **kwargs)
        sync(device)
        calls.append(time.perf_counter() - t0)
        return out

    triton_paged.triton_paged_decode = timed
    try:
        kernel = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
    finally:
        triton_paged.triton_paged_decode = kernel_fn
    if kernel is None:
        raise RuntimeError("the batched paged decode kernel does not apply to this cache")
    step_ms = []
    for s in range(decode_steps):
        q, k, v = (torch.randn(requests, h, d, generator=g, device=device, dtype=dtype) for h in (hq, hkv, hkv))
        batch = cache.batch([(i, context + s, 1) for i in range(requests)])
        out = torch.empty(requests, hq, d, dtype=dtype, device=device)
        sync(device)
        t0 = time.perf_counter()
        paged_step(cfg, geo, "triton", q, k, v, cache.pages, cache.rings, batch, scale, out, kernel=kernel)
        sync(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    step, kern = statistics.median(step_ms), statistics.median(calls) * 1e3
    return dict(config=cfg.to_dict(), requests=requests, context=context, page_size=page_size, steps=decode_steps,
                kernel_calls=len(calls), step_ms=step, kernel_ms=kern, rest_ms=step - kern)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
