"""Helpers shared by the test suite (a regular module: import it as ``from tests.helpers import ...``).

Conftest files hold fixtures only; anything a test module imports lives here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import transformers

#: The one default size of a tiny random model: 2 layers, 4 query / 2 KV heads of head_dim 32 (GQA).
TINY = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
)


def tiny_model(model_type: str = "llama", seed: int = 0, *, weight_scale: float = 1.0, **overrides):
    """A randomly initialised decoder-only transformers model (fp32, eval mode, no download).

    ``model_type`` is any ``AutoConfig`` model type ("llama", "mistral", "gemma2", ...); ``overrides``
    replace fields of :data:`TINY` or set other config fields (``sliding_window=64``, ``head_dim=32``,
    ``attn_implementation="eager"``, ``pad_token_id=None`` for an embedding without a zeroed row, ...).
    The same arguments give the same weights. ``weight_scale`` multiplies every 2-D weight: larger
    weights make the random model's predictions peaked, so quantization error shows in its outputs.
    """
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if weight_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(weight_scale)
    return model


class ByteTokenizer:
    """A tokenizer whose ids are the UTF-8 bytes of the text (0-255) and 256 the end of a sequence: exact,
    instant, and fits a tiny model of ``vocab_size=257``. No chat template, no BOS."""

    name_or_path = "bytes"
    eos_token_id = 256
    chat_template = None

    def __len__(self) -> int:
        return 257

    def __call__(self, text, add_special_tokens=False, **kw):
        return {"input_ids": list(str(text).encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", "replace")


def triton_skip_reason() -> str | None:
    """Why Triton kernel tests cannot run here (None when they can): CPU tests need the interpreter."""
    from kivi.kernels import triton_available

    if not triton_available():
        return "triton is not installed (pip install 'kivi[triton]')"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1; CPU kernel tests need the interpreter"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        return "triton was imported before TRITON_INTERPRET=1 was set (run as: TRITON_INTERPRET=1 pytest ...)"
    return None


def forward_in_steps(model, ids, chunks, mask=None):
    """``model`` over ``ids`` in forwards of ``chunks`` tokens through one ``KiviCache.from_model(model)``
    (``mask``: 2-D padding mask, positions from it); ``(logits of every token, the cache)``."""
    from kivi import KiviCache

    cache = KiviCache.from_model(model)
    outs, pos = [], 0
    with torch.no_grad():
        for n in chunks:
            kw = {} if mask is None else {"attention_mask": mask[:, : pos + n]}
            if mask is not None:
                kw["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, pos : pos + n]
            outs.append(model(input_ids=ids[:, pos : pos + n], cache=cache, use_cache=True, **kw).logits)
            pos += n
    return torch.cat(outs, dim=1), cache


def recording_bar(seen: list):
    """A stand-in for ``progress_bar`` (monkeypatched into the module under test) that appends every
    description it is given to ``seen``, and ``("done", count, total)`` when closed."""

    class Bar:
        def __init__(self, total, *a, **k):
            self.total, self.n = total, 0

        def set_description(self, d):
            seen.append(d)

        def update(self, n=1):
            self.n += n

        def set_postfix_str(self, s):
            pass

        def close(self):
            seen.append(("done", self.n, self.total))

    return Bar


# ------------------------------------------------------------- greedy decoding of two numerically different paths
# Two paths that compute the same function with different arithmetic (the cpu kernel vs the reference
# backend, bf16 vs float32 reads of a cache, a verify forward vs one-token decoding, ...) give logits
# that differ in the last bits, by an amount that depends on the machine's CPU kernels. Their greedy
# tokens are equal only until a step whose two best logits are closer than that difference (a near-tie):
# there either token is a correct greedy choice. Comparing such runs token for token makes the test
# depend on the machine; :func:`assert_greedy_close` bounds what it checks instead.

#: Logit tolerance (absolute) between two paths that read the same quantized cache, by the dtype the model
#: computes in, for the tiny test models (logits below ~8). float32 paths differ by summation order
#: (~1e-5 here); bf16 paths by the rounding of activations and of dequantized keys/values to bf16 (one
#: bf16 ulp at a logit of 4 is 1/32; the cpu kernel rounds its float32 result once, the reference backend
#: rounds the dequantized cache first, then attends in bf16).
LOGIT_ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.25}


@dataclass
class Greedy:
    """One greedy ``generate()`` run: ``sequences [B, P + n]``, ``scores [B, n, V]`` (float32, what each new
    token was chosen from: the logits after generate's processors), the cache generate built, the prompt
    length ``P``."""

    sequences: torch.Tensor
    scores: torch.Tensor
    cache: object
    prompt_length: int

    def row(self, i: int) -> "Greedy":
        """Batch row ``i`` alone (to compare a batched run with a run of that prompt alone)."""
        return Greedy(self.sequences[i : i + 1], self.scores[i : i + 1], self.cache, self.prompt_length)


def greedy(model, ids, *, new_tokens: int, mask=None, **generate_kwargs) -> Greedy:
    """``model.generate`` greedily for exactly ``new_tokens`` tokens (``min_new_tokens`` too: no row stops
    at EOS), keeping the scores of every step."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              return_dict_in_generate=True, output_scores=True, **generate_kwargs)
    if mask is not None:
        kw["attention_mask"] = mask
    with torch.no_grad():
        out = model.generate(ids, **kw)
    return Greedy(out.sequences, torch.stack(out.scores, 1).float(), out.cache, ids.shape[1])


def assert_greedy_close(got: Greedy, want: Greedy, *, atol: float) -> list[int]:
    """Two greedy runs of the same prompt by numerically different paths agree: per batch row, step by step
    in lockstep while their tokens are equal (both paths then saw the same input), the scores differ by at
    most ``atol`` (absolute, every finite entry; the same entries masked); a step whose tokens differ is
    accepted only as a near-tie — each run's token is within ``atol`` of the other's in that run's own
    scores — and the row's comparison stops there (the inputs differ after it). Returns, per row, the
    number of steps compared. A real divergence (logits apart by more than ``atol``, or a token changed
    at a step with a clear winner) fails with the row, step and numbers."""
    P = want.prompt_length
    assert got.prompt_length == P and torch.equal(got.sequences[:, :P], want.sequences[:, :P]), "different prompts"
    assert got.scores.shape == want.scores.shape, (
        f"scores of shape {tuple(got.scores.shape)} vs {tuple(want.scores.shape)}")
    compared = []
    for row in range(want.scores.shape[0]):
        n = want.scores.shape[1]
        for i in range(want.scores.shape[1]):
            a, b = want.scores[row, i], got.scores[row, i]
            finite = torch.isfinite(a)
            assert torch.equal(finite, torch.isfinite(b)), f"row {row}, new token {i}: different entries masked"
            diff = (a[finite] - b[finite]).abs().max().item()
            assert diff <= atol, f"row {row}, new token {i}: scores differ by {diff:.4g} > atol {atol}"
            tw, tg = int(want.sequences[row, P + i]), int(got.sequences[row, P + i])
            for run, scores, tok in (("want", a, tw), ("got", b, tg)):
                assert scores[tok] == scores.max(), f"row {row}, new token {i}: {run}'s token is not its argmax"
            if tw != tg:
                gaps = (a[tw] - a[tg]).item(), (b[tg] - b[tw]).item()
                assert max(gaps) <= atol, (
                    f"row {row}, new token {i}: tokens {tg} (got) and {tw} (want) differ at a clear winner: "
                    f"logit gaps {gaps[0]:.4g} (want) / {gaps[1]:.4g} (got) > atol {atol}")
                n = i + 1
                break
        compared.append(n)
    return compared


def teacher_forced_logits(model, sequences, prompt_length: int, mask=None) -> torch.Tensor:
    """``[B, n, V]`` float32: the logits ``model`` gives for each of the ``n`` tokens after the prompt when it
    is fed ``sequences [B, P + n]`` (the prompt in one forward, then one token per forward, through
    ``KiviCache.from_model(model)``; ``mask``: the prompt's padding mask, the new tokens are real)."""
    n = sequences.shape[1] - prompt_length
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], n)], dim=1)
    logits, _ = forward_in_steps(model, sequences[:, :-1], [prompt_length] + [1] * (n - 1), mask)
    return logits[:, prompt_length - 1 :].float()


def assert_decode_close(model, reference, ids, *, new_tokens: int, atol: float, mask=None, **generate_kwargs):
    """Greedy decoding of ``model`` against ``reference`` (the same weights read by another path):
    :func:`assert_greedy_close` on their ``generate()`` runs, then, when a near-tie stopped a row early, both
    models teacher-forced on the reference's tokens (one token per forward, the path generate's decode
    steps take) with logits within ``atol`` at every step, so that every step is still checked.
    Returns ``(got, want)`` (:class:`Greedy`)."""
    want = greedy(reference, ids, new_tokens=new_tokens, mask=mask, **generate_kwargs)
    got = greedy(model, ids, new_tokens=new_tokens, mask=mask, **generate_kwargs)
    if min(assert_greedy_close(got, want, atol=atol)) < new_tokens:
        P = want.prompt_length
        lw = teacher_forced_logits(reference, want.sequences, P, mask)
        lg = teacher_forced_logits(model, want.sequences, P, mask)
        diff = (lw - lg).abs().amax(dim=-1)  # [B, n]
        worst = int(diff.argmax())
        assert diff.max() <= atol, (f"teacher-forced on the reference's tokens: logits differ by {diff.max():.4g} > "
                                    f"atol {atol} (row {worst // new_tokens}, new token {worst % new_tokens})")
    return got, want
