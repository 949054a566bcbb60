import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    # Larger weights make the random model's predictions peaked, so quantization error is visible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 192), generator=g)


@pytest.fixture(scope="module")
def model_text(tiny_model):
    """Windows the FP model predicts well (its own greedy continuation), so a broken cache must
    raise the perplexity."""
    g = torch.Generator().manual_seed(2)
    start = torch.randint(0, 256, (2, 64), generator=g)
    with torch.inference_mode():
        out = tiny_model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=128, do_sample=False,
                                  pad_token_id=0)
    return out[:, :192]
