"""kivi's own decoding of what a vLLM run computed, and the comparison of the two (used by tests/vllm).

A vLLM request's tokens depend on how its KV cache was built: kivi's schedule gives a prefill's first forward
full precision for every query (an exact prefill) and every later forward of the request the precision
one-token decoding would have (:func:`kivi.cache.schedule.prefill_exact_queries`). So a request whose prefill
vLLM chunked (first chunk ``c`` tokens, the rest in chunks of any size, mixed with other requests' decode
rows) equals ``quantize_model(model, cfg, prefill_chunk_size=c).generate()`` of its prompt; and after a
preemption, vLLM recomputes prompt + output so far from an empty cache, which equals kivi's ``generate()``
started afresh on that longer prompt. :func:`segments` reads those restarts from the scheduler's steps
(``tests/vllm/_engine_runs.py``), :func:`kivi_generate` decodes one, :func:`assert_request_matches` compares.

Two float32 paths (vLLM's layers and transformers') differ in the last bits: a token may differ only at a
near-tie (the two best logits closer than ``atol`` in both runs), and each equal token's logprob must agree
within ``atol`` (the approach of tests/helpers.py ``assert_greedy_close``).
"""

from __future__ import annotations

import copy

import torch

#: logprob tolerance between vLLM's float32 model and transformers' float32 model reading the same KIVI cache
#: (both greedy). At 2 bits a last-bit difference in a key or value can move it to the next code, so the two
#: drift apart more than float noise: measured on SmolLM2, K2 V2, 4 prompts x 256 tokens
#: (test_engine_behaviour's batch), equal tokens' logprobs differed by at most 0.043, and one near-tie had
#: gaps of 0.018 (vLLM) / 0.110 (kivi). A reference that is not the same computation is further away: kivi's
#: one-shot prefill against vLLM's chunked one differed by 0.28 within 3 tokens, K4 V4 against K2 V2 by 0.34.
LOGPROB_ATOL = 0.15


def segments(steps: list[dict], req: int) -> list[tuple[int, int, int]]:
    """``[(computed, tokens, first_chunk)]``: each time request ``req`` started (its first scheduling, and again
    after each preemption: a step whose ``computed`` is not where the request's previous step left it), the
    tokens vLLM already had for it (0: an empty cache; more: a prefix-cache hit), how many tokens it then had,
    and how many vLLM computed in that first forward."""
    out, at = [], None
    for step in steps:
        for r, (computed, scheduled, tokens) in step.items():
            if int(r) != req:
                continue
            if computed != at:
                out.append((computed, tokens, scheduled))
            at = computed + scheduled
    return out


def mixed_steps(steps: list[dict]) -> int:
    """How many steps ran a prefill chunk (a request with more than one scheduled token) and a decode row
    (one token into a request whose prompt was computed) together."""
    n = 0
    for step in steps:
        kinds = {"prefill" if v[1] > 1 or v[0] + v[1] < v[2] else "decode" for v in step.values()}
        n += kinds == {"prefill", "decode"}
    return n


def kivi_generate(model, cfg, ids: list[int], first_chunk: int, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """kivi's own greedy ``generate()`` of ``ids``: the prefill's first forward is ``first_chunk`` tokens
    (``quantize_model(..., prefill_chunk_size=first_chunk)`` when that is shorter than the prompt). Returns the
    new tokens and the logprobs of their raw logits ``[new_tokens, V]`` (float32)."""
    from kivi import KiviCache, dequantize_model, quantize_model

    quantize_model(model, cfg, prefill_chunk_size=first_chunk if first_chunk < len(ids) else None)
    try:
        gen = copy.deepcopy(model.generation_config)  # after quantize_model: it sets the chunk size here
        gen.eos_token_id = []  # as vLLM's ignore_eos (None would fall back to pad_token_id's end token)
        gen.pad_token_id = None
        gen.max_new_tokens, gen.min_new_tokens, gen.do_sample = new_tokens, None, False
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), generation_config=gen, return_dict_in_generate=True,
                                 output_logits=True)
    finally:
        dequantize_model(model)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    assert isinstance(cache, KiviCache), f"generate decoded with {type(cache).__name__}, not kivi's cache"
    return out.sequences[0, len(ids):].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def _lookup(logprobs, i: int, token: int) -> float | None:
    """Logprob of ``token`` at new token ``i``: from a ``[n, V]`` tensor, or from vLLM's top-k dicts (``None``
    when it is not among them)."""
    if isinstance(logprobs, torch.Tensor):
        return logprobs[i, token].item()
    return {int(t): lp for t, lp in logprobs[i].items()}.get(token)


def compare_tokens(got: list[int], got_logprobs: list[dict], want: list[int], want_logprobs,
                   atol: float = LOGPROB_ATOL) -> tuple[int, float]:
    """vLLM's tokens ``got`` (with its top logprobs per token) against ``want`` (with its logprobs: a ``[n, V]``
    tensor, or another vLLM run's top-k dicts), in lockstep while equal; stops after a near-tie. Returns
    (tokens compared, largest logprob difference). Fails on a token that differs at a clear winner, or an
    equal token whose logprobs differ by more than ``atol``."""
    assert len(got) == len(want) == len(want_logprobs) == len(got_logprobs), "lengths differ"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            a, b = _lookup(got_logprobs, i, g), _lookup(want_logprobs, i, g)
            assert abs(a - b) <= atol, f"new token {i} ({g}): logprob {a:.5f} (vLLM) vs {b:.5f} (reference)"
            worst = max(worst, abs(a - b))
            continue
        gaps = []
        for lps, mine, other in ((got_logprobs, g, w), (want_logprobs, w, g)):
            theirs = _lookup(lps, i, other)
            gaps.append(float("inf") if theirs is None else _lookup(lps, i, mine) - theirs)
        assert max(gaps) <= atol, (
            f"new token {i}: vLLM chose {g}, the reference {w} at a clear winner: logprob gaps {gaps[0]:.4g} "
            f"(vLLM) / {gaps[1]:.4g} (reference) > {atol}")
        return i + 1, worst
    return len(got), worst


def assert_request_matches(model, cfg, prompt: list[int], got: list[int], got_logprobs: list[dict],
                           starts: list[tuple[int, int, int]]) -> dict:
    """One vLLM request against kivi's own ``generate()`` of each of its starts (:func:`segments`): the tokens
    vLLM produced between a start and the next (or the end) equal kivi's from that start. Returns
    ``{"compared": tokens checked, "worst": largest logprob difference, "stopped": near-ties}``."""
    assert starts and starts[0][1] == len(prompt), f"the request started with {starts[:1]}, prompt {len(prompt)}"
    assert all(c == 0 for c, _, _ in starts), f"a start from a prefix-cache hit (computed, tokens, chunk): {starts}"
    seq = prompt + got
    ends = [t for _, t, _ in starts[1:]] + [len(seq)]
    report = dict(compared=0, worst=0.0, stopped=0)
    for (_, t, chunk), end in zip(starts, ends):
        n = end - t
        if n == 0:  # preempted again before producing a token
            continue
        want, logprobs = kivi_generate(model, cfg, seq[:t], chunk, n)
        a, b = t - len(prompt), end - len(prompt)
        done, worst = compare_tokens(got[a:b], got_logprobs[a:b], want, logprobs)
        report["compared"] += done
        report["worst"] = max(report["worst"], worst)
        report["stopped"] += done < n
    return report
