"""A step's exact prefills in one call of vLLM's CPU attention kernel (imports vLLM: loaded by the plugin).

A request's first chunk attends to itself in full precision (:mod:`kivi.paged.forward`, step 4). vLLM's CPU
kernel (``cpu_attention_with_kv_cache``) serves every such request of a step in one call, where torch SDPA
runs request by request, and it is faster per request: one layer of a 1536-token prompt (9 query heads, 3
key / value heads, head size 64, 1 thread) 16 ms against SDPA's 41 ms, in bf16 and in float32. The kernel
reads keys and values from paged storage, so the step's rows are first written to a scratch paged cache
of its own (not vLLM's: the plugin's pages hold packed KIVI data) with vLLM's own cache write.

Results agree with :func:`kivi.paged.forward.sdpa_prefill` to rounding (its accumulation order is its own),
``tests/vllm/test_prefill.py``.
"""

from __future__ import annotations

import functools

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

from .scratch import scratch_pages

SCRATCH_BLOCK = 32  # tokens per scratch block (the CPU kernel takes multiples of 32)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU attention kernel takes this head size and dtype."""
    return head_dim in CPUAttentionBackend.get_supported_head_sizes() and dtype in CPUAttentionBackend.supported_dtypes


@functools.cache
def _isa(dtype: torch.dtype, head_dim: int) -> str:
    return _get_attn_isa(dtype, SCRATCH_BLOCK, head_dim)


def vllm_cpu_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[tuple[int, int]],
                     scale: float, out: torch.Tensor) -> None:
    """:data:`kivi.paged.forward.ExactPrefill` through vLLM's CPU attention kernel: every span's rows, causal."""
    n_q, d = query.shape[1], query.shape[2]
    h, dtype = key.shape[1], query.dtype
    s = scratch_pages(spans, SCRATCH_BLOCK, query.device)
    q, k, v = (s.take(x).to(dtype) for x in (query, key, value))
    # zeros: the kernel reads a block's rows past a request's last token (masked, but NaN * 0 is NaN), and vLLM
    # zeroes its own blocks when it allocates them
    cache = torch.zeros(s.num_blocks, h, 2 * SCRATCH_BLOCK, d, dtype=dtype, device=query.device)
    key_cache, value_cache = cache.chunk(2, dim=2)
    isa = _isa(dtype, d)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, s.slots, isa)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(spans), num_heads=n_q, num_kv_heads=h, head_dim=d, seq_lens=s.seq_lens, dtype=dtype,
        query_start_loc=s.query_start, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    o = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=o, query_start_loc=s.query_start,
        seq_lens=s.seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=s.table,
        softcap=0.0, scheduler_metadata=meta, s_aux=None)
    s.put(out, o)


__all__ = ["SCRATCH_BLOCK", "supports", "vllm_cpu_prefill"]
