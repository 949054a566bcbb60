import pytest
import torch

from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def peaked_model():
    """The default tiny Llama (256-token vocabulary) with weights scaled by 3: its predictions are
    peaked, so quantization error is visible in perplexity and KL."""
    return tiny_model("llama", vocab_size=256, weight_scale=3.0)


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 192), generator=g)


@pytest.fixture(scope="module")
def model_text(peaked_model):
    """Windows the FP model predicts well (its own greedy continuation), so a broken cache must
    raise the perplexity."""
    g = torch.Generator().manual_seed(2)
    start = torch.randint(0, 256, (2, 64), generator=g)
    with torch.inference_mode():
        out = peaked_model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=128,
                                    do_sample=False, pad_token_id=0)
    return out[:, :192]
