"""Shared fixtures: tiny random models (no download) and the embedded SmolLM2 (session-scoped)."""

from __future__ import annotations

import os

# Triton picks interpreter mode when first imported (transformers may import it early): set it first,
# so the Triton kernels run on CPU tensors in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

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


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised decoder-only model of ``model_type`` (fp32, eval mode)."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded default model; converted once per machine."""
    from kivi.models import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def wikitext_ids(smollm2):
    from kivi.data import load_text

    _, tok = smollm2
    text = load_text()[:200_000]
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only with KIVI_SLOW=1 or an explicit `-m` expression."""
    import os

    if os.environ.get("KIVI_SLOW") == "1" or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow: set KIVI_SLOW=1 or pass -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
