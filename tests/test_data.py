"""Tests of kivi.data: the shipped WikiText-2 file, load_text and token_windows."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import kivi.data as data
from kivi.data import DATA_DIR, default_text_path, load_text, token_windows


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per known word (others -> [UNK]); built in memory, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(100)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]")


def words(n: int) -> str:
    """Text whose i-th token has id i % 100 + 2 under word_tokenizer()."""
    return " ".join(f"w{i % 100}" for i in range(n))


# --------------------------------------------------------------------------- shipped file


def test_shipped_text_and_attribution_present():
    assert default_text_path() == DATA_DIR / "wikitext-2-raw-test.txt"
    assert default_text_path().stat().st_size > 1_000_000
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    for needle in ("WikiText-2", "Merity", "Pointer Sentinel Mixture Models", "Wikipedia", "CC BY-SA 3.0"):
        assert needle in readme


def test_load_text_default_is_wikitext():
    text = load_text()
    assert text.startswith(" = Robert Boulter = \n")
    assert "\r" not in text  # CRLF normalised
    assert len(text) > 1_000_000


# --------------------------------------------------------------------------- load_text errors


def test_load_text_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text(missing)


def test_load_text_empty_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    with pytest.raises(ValueError, match="empty"):
        load_text(str(empty))


def test_load_text_unreadable(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_text(tmp_path)  # a folder
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="bin.txt"):
        load_text(binary)


# --------------------------------------------------------------------------- token_windows


def test_windows_shape_and_consecutive():
    out = token_windows(word_tokenizer(), words(50), context=8, num_windows=5)
    assert out.shape == (5, 8) and out.dtype == torch.long
    expected = torch.arange(40).reshape(5, 8) + 2  # no special tokens, windows back to back
    assert torch.equal(out, expected)


def test_windows_stride_and_exact_fit():
    tok = word_tokenizer()
    out = token_windows(tok, words(10), context=4, num_windows=4, stride=2)  # needs exactly 3*2+4 = 10
    assert torch.equal(out[:, 0], torch.tensor([2, 4, 6, 8]))
    assert torch.equal(out[1, :2], out[0, 2:])  # overlapping windows


def test_windows_deterministic_and_independent_of_cache():
    tok, text = word_tokenizer(), words(300)
    a = token_windows(tok, text, context=16, num_windows=10)
    a[0, 0] = -1  # returned tensors are fresh: mutating one must not poison the cache
    b = token_windows(tok, text, context=16, num_windows=10)
    c = token_windows(word_tokenizer(), text, context=16, num_windows=10)
    assert b[0, 0] == 2
    assert torch.equal(b, c)
    assert not torch.equal(token_windows(tok, words(300)[3:], context=16, num_windows=10), b)


def test_windows_first_skips_whole_windows():
    tok, text = word_tokenizer(), words(60)
    all_ = token_windows(tok, text, context=8, num_windows=7)
    later = token_windows(tok, text, context=8, num_windows=2, first=5)
    assert torch.equal(later, all_[5:7])
    with pytest.raises(ValueError, match="after skipping 6 window"):
        token_windows(tok, text, context=8, num_windows=2, first=6)  # 6*8 + 2*8 = 64 > 60 tokens
    with pytest.raises(ValueError, match="first must be a non-negative integer"):
        token_windows(tok, text, context=8, num_windows=1, first=-1)


def test_windows_too_short_says_counts():
    with pytest.raises(ValueError) as info:
        token_windows(word_tokenizer(), words(20), context=8, num_windows=3)
    message = str(info.value)
    assert "20 tokens" in message and "3 window(s) of 8 tokens" in message and "need 24" in message


@pytest.mark.parametrize("kwargs", [dict(context=0, num_windows=1), dict(context=4, num_windows=-1),
                                    dict(context=4, num_windows=1, stride=0), dict(context=2.5, num_windows=1)])
def test_windows_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="positive integer"):
        token_windows(word_tokenizer(), words(20), **kwargs)


def test_tokenization_cache_is_bounded():
    tok = word_tokenizer()
    for n in range(data._TOKEN_CACHE_SIZE + 3):
        token_windows(tok, words(10 + n), context=4, num_windows=1)
    assert len(data._TOKEN_CACHE) <= data._TOKEN_CACHE_SIZE


# --------------------------------------------------------------------------- real tokenizer on WikiText-2


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    """The tokenizer of the session's SmolLM2 (tests/conftest.py), so the model is loaded once."""
    return smollm2[1]


def test_wikitext_windows_with_smollm2(smollm2_tokenizer):
    text = load_text()
    out = token_windows(smollm2_tokenizer, text, context=256, num_windows=4)
    assert out.shape == (4, 256)
    assert torch.equal(out, token_windows(smollm2_tokenizer, text, context=256, num_windows=4))
    assert smollm2_tokenizer.decode(out[0]).startswith(" = Robert Boulter =")
    with pytest.raises(ValueError, match="text too short"):
        token_windows(smollm2_tokenizer, text, context=8192, num_windows=100)
