"""The "kivi" attention's routing (kivi.attention.interface): which queries go to SDPA, which to the backend.

The first forward of speculative decoding holds the prompt and the first candidates. Its prompt queries
must get the very output a plain prefill of the prompt gets (transformers' SDPA over the prompt), bit for
bit; the candidates read what one-token decoding gives them (the backend, per-query boundary).
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kivi.attention.interface import kivi_attention_forward
from kivi.attention.reference import reference_attention
from kivi.cache.heads import HeadSplitLayer
from kivi.cache.layer import KiviLayer
from kivi.cache.view import HeadRange, PackedStates, exact_queries
from kivi.config import KiviConfig

CFG = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=2, v_bits=2)


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _forward(prompt: int | None, n: int, backend: str, dtype=torch.float32, mask=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen).to(dtype) for h in (6, 2, 2))
    layer = KiviLayer(CFG)
    layer.prompt_length = prompt
    kv, vv = layer.append(k, v)
    attn_mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] if mask else None
    out, _ = kivi_attention_forward(_Attention(), q, PackedStates(kv, backend), PackedStates(vv, backend), attn_mask,
                                    scaling=0.25)
    return q, k, v, kv, vv, attn_mask, out


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prompt,n,mask", [(50, 61, False), (37, 45, True), (200, 211, False)])
def test_prompt_queries_get_the_plain_prefill_output_bit_for_bit(backend, dtype, prompt, n, mask):
    q, k, v, kv, vv, attn_mask, out = _forward(prompt, n, backend, dtype, mask)
    assert exact_queries(n, kv) == exact_queries(n, vv) == prompt  # the candidates carry a boundary
    plain, _ = sdpa_attention_forward(_Attention(), q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt],
                                      None if attn_mask is None else attn_mask[..., :prompt, :prompt], scaling=0.25)
    assert torch.equal(out[:, :prompt], plain)
    # the candidates: what the reference gives the same queries (one-token rule)
    want = reference_attention(q, kv, vv, scaling=0.25, attention_mask=attn_mask).transpose(1, 2)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:, prompt:], want[:, prompt:], atol=tol, rtol=tol)


def test_exact_queries():
    _, _, _, kv, vv, _, _ = _forward(None, 40, "cpu")
    assert exact_queries(40, kv) == exact_queries(40, vv) == 40  # a plain prefill: all of them
    layer = KiviLayer(CFG)
    layer.append(*(torch.randn(1, 2, 30, 16) for _ in range(2)))
    kv, vv = layer.append(*(torch.randn(1, 2, 5, 16) for _ in range(2)))
    assert exact_queries(5, kv) == exact_queries(5, vv) == 0  # tokens are stored: nothing is exact


TIERED = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=4, v_bits=4, sink_tokens=3,
                    tiers=[(16, None), (16, 4), (None, 2)])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_candidates_after_a_tiered_prompt_read_what_one_token_decoding_gives(backend, dtype):
    """The prompt (61 tokens) and 9 candidates in one forward into a tiered layer (16 tokens at 4 bits):
    the prompt's flush demotes most of the prompt within the forward; candidate ``i`` gets the output of
    one-token decoding after the prompt and the candidates before it (the rows of its tier state)."""
    prompt, n = 61, 70
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen).to(dtype) for h in (6, 2, 2))
    layer = KiviLayer(TIERED)
    layer.prompt_length = prompt
    kv, vv = layer.append(k, v)
    out, _ = kivi_attention_forward(_Attention(), q, PackedStates(kv, backend), PackedStates(vv, backend), None,
                                    scaling=0.25)
    steps = KiviLayer(TIERED)
    steps.append(k[:, :, :prompt], v[:, :, :prompt])
    want = []
    for i in range(prompt, n):
        ks, vs = steps.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
        one, _ = kivi_attention_forward(_Attention(), q[:, :, i:i + 1], PackedStates(ks, backend),
                                        PackedStates(vs, backend), None, scaling=0.25)
        want.append(one)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:, prompt:].float(), torch.cat(want, dim=1).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("widths", [([2, 4], [2, 2]), ([2, 2], [2, 2])], ids=["two-groups", "one-group"])
def test_per_head_prompt_queries_get_the_plain_prefill_output_bit_for_bit(backend, widths):
    """A layer with per-head widths is read as a sequence of head groups like a plain layer (one group), so
    a prefill holding speculative candidates splits alike: the prompt's queries take the plain prefill's
    SDPA call, and the whole output equals the plain layer's where the widths are the plain layer's."""
    prompt, n = 50, 61
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen) for h in (6, 2, 2))
    layer = HeadSplitLayer(CFG, *widths)
    layer.prompt_length = prompt
    kv, vv = layer.append(k, v)
    assert exact_queries(n, kv, vv) == prompt
    out, _ = kivi_attention_forward(_Attention(), q, PackedStates(kv, backend), PackedStates(vv, backend), None,
                                    scaling=0.25)
    plain, _ = sdpa_attention_forward(_Attention(), q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], None,
                                      scaling=0.25)
    assert torch.equal(out[:, :prompt], plain)
    if widths == ([2, 2], [2, 2]):
        ref = KiviLayer(CFG)
        ref.prompt_length = prompt
        rk, rv = ref.append(k, v)
        want, _ = kivi_attention_forward(_Attention(), q, PackedStates(rk, backend), PackedStates(rv, backend), None,
                                         scaling=0.25)
        assert torch.equal(out, want)


def test_a_plain_view_is_one_head_group():
    """Attention reads every side as head groups (``groups`` / ``views``): a plain view is one, over all heads."""
    layer = KiviLayer(CFG)
    kv, _ = layer.append(*(torch.randn(1, 2, 40, 16) for _ in range(2)))
    assert kv.groups == (HeadRange(0, 2),) and kv.views == (kv,)
    split = HeadSplitLayer(CFG, [2, 4], [2, 2])
    sk, _ = split.append(*(torch.randn(1, 2, 40, 16) for _ in range(2)))
    assert [(g.start, g.stop) for g in sk.groups] == [(0, 1), (1, 2)] and len(sk.views) == 2
    assert exact_queries(40, kv) == exact_queries(40, sk) == 40
