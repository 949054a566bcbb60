"""tests.helpers.assert_greedy_close / assert_decode_close: what they accept (rounding, a near-tie) and
what they refuse (logits apart, a changed token with a clear winner, a broken kernel, another config)."""

from __future__ import annotations

import pytest
import torch

import kivi.attention.fused_cpu as fused
from kivi import KiviConfig, quantize_model
from kivi.attention.reference import view_geometry
from tests.helpers import LOGIT_ATOL, Greedy, assert_decode_close, assert_greedy_close, tiny_model

ATOL = 0.1


def _run(scores: list[list[float]], prompt=(5, 6)) -> Greedy:
    """A one-row run whose tokens are the argmax of each step's ``scores``."""
    s = torch.tensor([scores])  # [1, n, V]
    seq = torch.cat([torch.tensor([prompt]), s.argmax(-1)], dim=1)
    return Greedy(seq, s, None, len(prompt))


def test_equal_runs_and_rounding_compare_every_step():
    want = _run([[1.0, 0.0, 0.5], [0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    got = _run([[1.05, 0.0, 0.5], [0.0, 2.0, 1.08], [3.0, 0.0, -0.09]])
    assert assert_greedy_close(got, want, atol=ATOL) == [3]


def test_a_near_tie_may_change_the_token_and_ends_the_comparison():
    want = _run([[1.0, 0.0, 0.5], [0.0, 2.0, 1.96], [3.0, 0.0, 0.0]])
    # token 2 instead of 1 at step 1 (a tie within ATOL); step 2 is no longer compared (other inputs)
    got = _run([[1.0, 0.0, 0.5], [0.0, 1.97, 1.99], [0.0, 9.0, 0.0]])
    assert assert_greedy_close(got, want, atol=ATOL) == [2]


def test_a_changed_token_with_a_clear_winner_fails():
    want = _run([[1.0, 1.0 - 1.5 * ATOL, 0.0]])
    got = _run([[1.0 - 0.8 * ATOL, 1.0 - 0.7 * ATOL, 0.0]])  # every logit within ATOL, but want's gap is 1.5 ATOL
    with pytest.raises(AssertionError, match="clear winner"):
        assert_greedy_close(got, want, atol=ATOL)


def test_logits_apart_fail_even_when_the_tokens_agree():
    want = _run([[1.0, 0.0], [2.0, 0.0]])
    got = _run([[1.0, 0.0], [2.0, 0.5]])
    with pytest.raises(AssertionError, match="new token 1: scores differ by 0.5 > atol"):
        assert_greedy_close(got, want, atol=ATOL)


def test_tokens_that_are_not_the_argmax_of_their_scores_fail():
    want = _run([[1.0, 0.0]])
    got = Greedy(torch.tensor([[5, 6, 1]]), want.scores, None, 2)
    with pytest.raises(AssertionError, match="not its argmax"):
        assert_greedy_close(got, want, atol=ATOL)


# ----------------------------------------------------------------------------- real models, real bugs

CFG = dict(group_size=8, residual_length=16, block_size=32)


def _pair(dtype, **cpu_cfg):
    """The same peaked tiny model with the cpu backend (``cpu_cfg`` on top of CFG) and with the reference
    backend (CFG)."""
    def make(backend, **kw):
        model = tiny_model(weight_scale=3.0).to(dtype)
        return quantize_model(model, KiviConfig(**CFG, **kw, attention_backend=backend))
    return make("cpu", **cpu_cfg), make("reference")


def _ids():
    return torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(5))


def _broken_kernel(monkeypatch, kind: str, skipped: int = 1):
    real = fused.fused_decode_attention

    def scaled(q, k_view, v_view, **kw):  # every output 5% too large
        return real(q, k_view, v_view, **kw) * 1.05

    def skips_first_tokens(q, k_view, v_view, *, attention_mask=None, **kw):  # never reads the first kv positions
        T = view_geometry(q, k_view, v_view)[1]
        mask = torch.ones(q.shape[0], 1, 1, T, dtype=torch.bool) if attention_mask is None else attention_mask.clone()
        mask[..., :skipped] = False
        return real(q, k_view, v_view, attention_mask=mask, **kw)

    monkeypatch.setattr(fused, "fused_decode_attention", {"scaled": scaled, "skips": skips_first_tokens}[kind])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpu_backend_passes(dtype):
    fast, ref = _pair(dtype)
    assert_decode_close(fast, ref, _ids(), new_tokens=30, atol=LOGIT_ATOL[dtype])


# A 5% error or one token left out hides in bf16 rounding on this model (logits below 3); a key group does not.
@pytest.mark.parametrize("dtype,kind,skipped", [(torch.float32, "scaled", 0), (torch.float32, "skips", 1),
                                                (torch.bfloat16, "skips", 8)],
                         ids=["fp32-scaled", "fp32-skips-a-token", "bf16-skips-a-group"])
def test_a_broken_kernel_fails(monkeypatch, dtype, kind, skipped):
    fast, ref = _pair(dtype)
    _broken_kernel(monkeypatch, kind, skipped)
    with pytest.raises(AssertionError, match="differ"):
        assert_decode_close(fast, ref, _ids(), new_tokens=30, atol=LOGIT_ATOL[dtype])


def test_another_config_fails():
    fast, ref = _pair(torch.float32, k_bits=4)  # the cpu model keeps 4-bit keys, the reference 2-bit ones
    with pytest.raises(AssertionError, match="differ"):
        assert_decode_close(fast, ref, _ids(), new_tokens=30, atol=LOGIT_ATOL[torch.float32])
