"""Helpers shared by the test suite (a regular module: import it as ``from tests.helpers import ...``).

Conftest files hold fixtures only; anything a test module imports lives here.
"""

from __future__ import annotations

import os

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
