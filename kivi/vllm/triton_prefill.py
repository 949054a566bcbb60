"""A step's exact prefills in one call of vLLM's Triton attention kernel: the GPU path's prefill (imports vLLM's
Triton kernels: loaded by the plugin only with ``"attention_backend": "triton"``, on a GPU platform).

On a GPU vLLM's ``TRITON_ATTN`` backend, the one the plugin's GPU path sits beside (:mod:`kivi.vllm.select`),
attends with ``unified_attention``: varying-length queries reading keys and values through a block table. Every
request's first chunk of a step (:data:`kivi.paged.forward.ExactPrefill`) goes through it in one launch per layer,
where :func:`kivi.paged.forward.sdpa_prefill` (the reference) launches torch SDPA once per request and layer. As on
the CPU (:mod:`kivi.vllm.prefill`) the step's rows are first written to a scratch paged cache of their own
(:mod:`kivi.vllm.scratch`; the plugin's pages hold packed KIVI data): one indexed write per side.

Results agree with :func:`kivi.paged.forward.sdpa_prefill` to rounding, ``tests/vllm/test_triton_prefill.py``
(run on the CPU through Triton's interpreter; never on a GPU yet).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.ops.triton_unified_attention import unified_attention

from .scratch import scratch_pages

SCRATCH_BLOCK = 16  # tokens per scratch block: vLLM's default GPU block size (TRITON_ATTN takes multiples of 16)
# the kernel reads a whole key tile's block ids unmasked (tiles of up to 128 tokens): a request's last tile may
# read ids past its last block, and the last request's past the table's row, so the table has this many more
SPARE_COLUMNS = 128 // SCRATCH_BLOCK


def vllm_triton_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[tuple[int, int]],
                        scale: float, out: torch.Tensor) -> None:
    """:data:`kivi.paged.forward.ExactPrefill` through vLLM's Triton attention kernel: every span's rows, causal."""
    d, h, dtype = query.shape[2], key.shape[1], query.dtype
    s = scratch_pages(spans, SCRATCH_BLOCK, query.device, spare=SPARE_COLUMNS)
    q = s.take(query).contiguous()
    # a block's rows past a request's last token are never read (the kernel masks its key / value loads at
    # seq_lens); zeros all the same, as vLLM's blocks start
    cache = torch.zeros(2, s.num_blocks * SCRATCH_BLOCK, h, d, dtype=dtype, device=query.device)
    cache[0, s.slots] = s.take(key).to(dtype)
    cache[1, s.slots] = s.take(value).to(dtype)
    key_cache, value_cache = cache.view(2, s.num_blocks, SCRATCH_BLOCK, h, d).unbind(0)
    o = torch.empty_like(q)
    unified_attention(
        q=q, k=key_cache, v=value_cache, out=o, cu_seqlens_q=s.query_start, max_seqlen_q=s.max_len,
        seqused_k=s.seq_lens, max_seqlen_k=s.max_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
        block_table=s.table, softcap=0.0, q_descale=None, k_descale=None, v_descale=None)
    s.put(out, o)


__all__ = ["SCRATCH_BLOCK", "vllm_triton_prefill"]
