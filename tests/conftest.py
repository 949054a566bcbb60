"""Shared fixtures: the embedded SmolLM2 (session-scoped) and the `slow` marker rule.

Tiny random models come from :func:`tests.helpers.tiny_model` (the suite's one model factory).
"""

from __future__ import annotations

import os

# Triton picks interpreter mode when first imported (transformers may import it early): set it first,
# so the Triton kernels run on CPU tensors in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_cache_root():
    """The cache root the session's SmolLM2 loads share (fixed once, so env patches can't move it)."""
    from kivi.models import kivi_cache_dir

    return kivi_cache_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_cache_root):
    """(model, tokenizer) of the embedded default model; converted once per machine, loaded once per session."""
    from kivi.models import load_model

    return load_model("smollm2", cache_dir=smollm2_cache_root)


@pytest.fixture(scope="session")
def wikitext_ids(smollm2):
    from kivi.data import load_text

    _, tok = smollm2
    text = load_text()[:200_000]
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only with KIVI_SLOW=1 or an explicit `-m` expression."""
    if os.environ.get("KIVI_SLOW") == "1" or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow: set KIVI_SLOW=1 or pass -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
