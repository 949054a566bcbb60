"""Saved KIVI caches (kivi/cache/persist.py, KiviCache.save / load, kivi/prefix.py): bit-identical round
trips that continue exactly, and one clear error per kind of bad file."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import kivi
from kivi.cache.kivi_cache import KiviCache
from kivi.cache.persist import PrefixFileError, read_header
from kivi.config import KiviConfig
from kivi.prefix import load_prefix, model_fingerprint, prefill, save_prefix, tokenizer_sha256, weights_sha256
from tests.helpers import tiny_model

MODELS = {
    "llama-gqa": dict(model_type="llama"),
    "mistral-sliding": dict(model_type="mistral", sliding_window=48),
    "qwen2-mixed": dict(model_type="qwen2", use_sliding_window=True, sliding_window=48, max_window_layers=1),
}


def _config(k_bits=2, v_bits=2, sink_tokens=0, backend="cpu", **kw):
    return KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=16, residual_length=32, block_size=64,
                      sink_tokens=sink_tokens, attention_backend=backend, **kw)


def _model(name="llama-gqa", cfg=None, seed=0, **overrides):
    spec = dict(MODELS[name])
    model = tiny_model(spec.pop("model_type"), seed=seed, weight_scale=4.0, **spec, **overrides)
    return kivi.quantize_model(model, cfg if cfg is not None else _config())


def _ids(n, batch=1, seed=1):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, cache, ids, steps):
    """Greedy one-token steps after ``ids`` (the tokens the cache does not hold yet); every step's logits."""
    logits, x = [], ids
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=x, cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            x = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


def _same_state(a: KiviCache, b: KiviCache) -> None:
    """Every tensor and counter of two caches equal (read straight from the layers, not via persist)."""
    assert a.config.to_dict() == b.config.to_dict() and len(a.layers) == len(b.layers)
    assert a.nbytes == b.nbytes and a.memory_breakdown() == b.memory_breakdown()
    for la, lb in zip(a.layers, b.layers):
        assert (la.seen, la.dtype, la.sliding_window, la.kv_offset, la.is_initialized) == \
               (lb.seen, lb.dtype, lb.sliding_window, lb.kv_offset, lb.is_initialized)
        assert type(la) is type(lb) and len(la.parts) == len(lb.parts) and la.due == lb.due
        sides = [(getattr(pa, n), getattr(pb, n)) for pa, pb in zip(la.parts, lb.parts) for n in ("k", "v")]
        for sa, sb in sides:
            for t, u in ((sa.window, sb.window), (sa.window_valid, sb.window_valid), (sa.sink, sb.sink),
                         (sa.stored_valid, sb.stored_valid)):
                assert (t is None) == (u is None) and (t is None or (t.dtype == u.dtype and torch.equal(t, u)))
            assert type(sa.store) is type(sb.store) and len(sa.chain) == len(sb.chain)
        for x, y in ((x, y) for sa, sb in sides for x, y in zip(sa.chain, sb.chain)):
            assert (x.start, x.length, x.starts, x.caps, x.block_size) == (y.start, y.length, y.starts, y.caps,
                                                                          y.block_size)
            assert [blk is None for blk in x.blocks] == [blk is None for blk in y.blocks]
            assert type(x.template) is type(y.template)
            if x.template is not None:
                assert {k: (t.dtype, t.shape) for k, t in x.template.tensors().items()} == \
                       {k: (t.dtype, t.shape) for k, t in y.template.tensors().items()}
            got = [(t0, seg.tensors()) for t0, seg in y.iter_blocks()]
            want = [(t0, seg.tensors()) for t0, seg in x.iter_blocks()]
            assert [t0 for t0, _ in got] == [t0 for t0, _ in want]
            for (_, g), (_, w) in zip(got, want):
                assert g.keys() == w.keys()
                assert all(g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]) for k in g)


@pytest.mark.parametrize("extra", [
    dict(tiers=[(32, None), (48, 4), (None, 2)], k_bits=4, v_bits=4),
    dict(tiers=[(32, None), (32, 8), (48, 4), (None, 2)], k_bits=8, v_bits=8, sink_tokens=4),
    dict(head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 2]}, 1: {"k_bits": [2, 2], "v_bits": [4, 2]}}),
    dict(head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 3]}}, sink_tokens=3),
], ids=["tiers", "tiers4-sink", "per-head", "per-head-sink"])
def test_saved_mid_generation_continues_as_the_uninterrupted_run(tmp_path, extra):
    """Position tiers and per-head widths save and load: a generation saved half way, loaded into a new
    cache and continued gives the logits of the run that never stopped, bit for bit."""
    cfg = _config(**{"k_bits": 2, "v_bits": 2, **extra})
    model = _model("llama-gqa", cfg)
    ids, steps, stop = _ids(90), 60, 25  # 90 + 60 tokens: tokens reach every tier
    whole = prefill(model, ids)
    tokens = []
    with torch.inference_mode():  # the uninterrupted greedy run, recording its tokens
        logits = []
        out = model(input_ids=_ids(1, seed=3), cache=whole, use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            x = out.logits[:, -1:].argmax(-1)
            tokens.append(x)
            out = model(input_ids=x, cache=whole, use_cache=True)
        want = torch.stack(logits, 1)
    half = prefill(model, ids)
    with torch.inference_mode():
        logits = []
        out = model(input_ids=_ids(1, seed=3), cache=half, use_cache=True)
        for t in range(stop):
            logits.append(out.logits[:, -1])
            out = model(input_ids=tokens[t], cache=half, use_cache=True)
    path = tmp_path / "mid.safetensors"
    half.save(path, fingerprint=model_fingerprint(model, None))
    loaded = KiviCache.load(path, fingerprint=model_fingerprint(model, None), model=model)
    _same_state(half, loaded)
    with torch.inference_mode():
        for t in range(stop, steps):
            logits.append(out.logits[:, -1])
            out = model(input_ids=tokens[t], cache=loaded, use_cache=True)
    assert torch.equal(torch.stack(logits, 1), want)
    assert len(loaded.layers[0].parts[0].k.chain) > 1 if "tiers" in extra else len(loaded.layers[0].parts) == 2


CASES = [
    pytest.param("llama-gqa", 2, 2, 0, "cpu", 203, id="llama-k2v2-cpu"),
    pytest.param("llama-gqa", 4, 2, 4, "cpu", 150, id="llama-k4v2-sink4-cpu"),
    pytest.param("llama-gqa", 2, 4, 4, "reference", 77, id="llama-k2v4-sink4-reference"),
    pytest.param("mistral-sliding", 2, 2, 0, "cpu", 211, id="mistral-sliding-k2v2-cpu"),
    pytest.param("qwen2-mixed", 4, 4, 4, "cpu", 181, id="qwen2-mixed-k4v4-sink4-cpu"),
    pytest.param("qwen2-mixed", 2, 2, 0, "reference", 197, id="qwen2-mixed-k2v2-reference"),
]


@pytest.mark.parametrize("name,kb,vb,sinks,backend,n", CASES)
def test_round_trip_is_bit_identical_and_continues_exactly(tmp_path, name, kb, vb, sinks, backend, n):
    cfg = _config(kb, vb, sinks, backend)
    model = _model(name, cfg)
    ids = _ids(n)
    cache = prefill(model, ids[:, :60])
    for s in range(60, n, 19):  # then forwards of 19 tokens: blocks written after the prefill, partly filled
        _decode(model, cache, ids[:, s : s + 19], 1)
    path = tmp_path / "p.safetensors"
    save_prefix(path, cache, model, None, ids)
    loaded = load_prefix(path, model, None)
    _same_state(cache, loaded.cache)
    assert torch.equal(loaded.input_ids, ids) and loaded.cache.attention_backend == cache.attention_backend
    if name != "llama-gqa":  # the sliding layers have dropped blocks by now
        assert any(blk is None for layer in cache.layers for blk in layer.k.store.blocks)
        assert any(layer.kv_offset > 0 for layer in loaded.cache.layers)
    assert path.stat().st_size <= cache.nbytes + 64 * 1024  # packed: about nbytes, plus the JSON header
    # Continuing: 40 greedy steps after a 3-token question give bit-identical logits from both caches.
    q = _ids(3, seed=7)
    want = _decode(model, cache, q, 40)
    got = _decode(model, loaded.cache, q, 40)
    assert torch.equal(got, want)
    _same_state(cache, loaded.cache)


@pytest.mark.parametrize("fields", [{"quantize_value": False}, {"residual_bits": 2}, {"symmetric": True},
                                    {"layer_specific_config": {1: {"k_bits": 4, "group_size": 32}}}],
                         ids=["fp-values", "compensation", "symmetric", "per-layer"])
def test_other_storage_fields_round_trip(tmp_path, fields, request):
    """Unquantized values (FpSegment blocks), compensation codes, no zero-points, per-layer configs."""
    name = request.node.callspec.id
    model = _model("llama-gqa", _config(2, 2, 0, "cpu", **fields))
    ids = _ids(157)
    cache = prefill(model, ids[:, :100])
    _decode(model, cache, ids[:, 100:], 1)
    stored = {side: sorted(getattr(cache.layers[1], side).store.template.tensors()) for side in ("k", "v")}
    assert stored == {"fp-values": {"k": ["offset", "packed", "scale"], "v": ["data"]},
                      "compensation": {"k": ["comp", "offset", "packed", "scale"],
                                       "v": ["comp", "offset", "packed", "scale"]},
                      "symmetric": {"k": ["packed", "scale"], "v": ["packed", "scale"]},
                      "per-layer": {"k": ["offset", "packed", "scale"], "v": ["offset", "packed", "scale"]}}[name]
    save_prefix(tmp_path / "p.safetensors", cache, model, None, ids)
    loaded = load_prefix(tmp_path / "p.safetensors", model, None)
    _same_state(cache, loaded.cache)
    assert [la.config.k_bits for la in loaded.cache.layers] == [la.config.k_bits for la in cache.layers]
    q = _ids(2, seed=4)
    assert torch.equal(_decode(model, loaded.cache, q, 12), _decode(model, cache, q, 12))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_round_trip(tmp_path, dtype):
    model = _model("llama-gqa", _config(2, 4, 4, scale_dtype="auto")).to(dtype)
    ids = _ids(131)
    cache = prefill(model, ids)
    assert cache.layers[0].k.window.dtype == dtype == cache.layers[0].k.store.template.scale.dtype
    save_prefix(tmp_path / "p.safetensors", cache, model, None, ids)
    assert read_header(tmp_path / "p.safetensors").fingerprint["dtype"] == str(dtype).removeprefix("torch.")
    loaded = load_prefix(tmp_path / "p.safetensors", model, None)
    _same_state(cache, loaded.cache)
    q = _ids(2, seed=9)
    assert torch.equal(_decode(model, loaded.cache, q, 20), _decode(model, cache, q, 20))
    with pytest.raises(PrefixFileError, match=r"dtype (bfloat16|float16) vs float32"):
        load_prefix(tmp_path / "p.safetensors", model.float(), None)


def test_generate_after_loading_equals_generate_in_the_saving_process(tmp_path):
    model = _model("llama-gqa", _config(2, 2, 4))
    ids = _ids(171)
    cache = prefill(model, ids)
    save_prefix(tmp_path / "p.safetensors", cache, model, None, ids)
    loaded = load_prefix(tmp_path / "p.safetensors", model, None)
    full = loaded.continuation_ids(_ids(4, seed=3))
    kw = dict(max_new_tokens=48, do_sample=False, attention_mask=torch.ones_like(full), pad_token_id=0)
    a = model.generate(full, cache=cache, **kw)
    b = model.generate(full, cache=loaded.cache, **kw)
    assert torch.equal(a, b) and a.shape[-1] == full.shape[-1] + 48


def test_padded_batch_round_trip(tmp_path):
    """A left-padded batch of 2: the window's padding mask travels with the cache."""
    model = _model("llama-gqa", _config(2, 2, 0, "reference"))
    ids = _ids(20, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = KiviCache.from_model(model)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    assert cache.layers[0].k.window_valid is not None
    cache.save(tmp_path / "p.safetensors", fingerprint={"m": 1})
    loaded = KiviCache.load(tmp_path / "p.safetensors", fingerprint={"m": 1}, model=model)
    _same_state(cache, loaded)


def test_load_without_a_model_reads_with_reference(tmp_path):
    model = _model("llama-gqa", _config(2, 2, 0, "cpu"))
    cache = prefill(model, _ids(90))
    fp = model_fingerprint(model)
    cache.save(tmp_path / "p.safetensors", fingerprint=fp)
    loaded = KiviCache.load(tmp_path / "p.safetensors", fingerprint=fp)
    assert loaded.attention_backend == "reference" and loaded.layers[0].device == torch.device("cpu")
    _same_state(cache, loaded)


def test_empty_and_sink_only_caches_round_trip(tmp_path):
    cfg = _config(2, 2, 4)
    cache = KiviCache(cfg)
    cache.save(tmp_path / "empty.safetensors", fingerprint={})
    assert KiviCache.load(tmp_path / "empty.safetensors", fingerprint={}).get_seq_length() == 0
    model = _model("llama-gqa", cfg)
    cache = prefill(model, _ids(36))  # 4 sink tokens, 32 in the window, nothing stored yet
    assert cache.layers[0].k.store.template is None and cache.layers[0].k.sink is not None
    cache.save(tmp_path / "sink.safetensors", fingerprint={})
    _same_state(cache, KiviCache.load(tmp_path / "sink.safetensors", fingerprint={}, model=model))


# ---------------------------------------------------------------------------------------------- fingerprint
def test_fingerprint_tells_models_apart():
    a, b = _model(seed=0), _model(seed=1)
    assert model_fingerprint(a) == model_fingerprint(_model(seed=0))
    assert model_fingerprint(a)["weights_sha256"] != model_fingerprint(b)["weights_sha256"]
    with torch.no_grad():  # one changed weight: the full hash sees it
        next(a.parameters())[3, 5] += 1e-3
    assert weights_sha256(a) != weights_sha256(_model(seed=0))
    assert weights_sha256(a, "sample") != weights_sha256(b, "sample")
    assert model_fingerprint(_model(num_hidden_layers=3))["num_hidden_layers"] == 3
    with pytest.raises(ValueError, match=r"weights='some' is not allowed"):
        weights_sha256(a, "some")


def _word_tokenizer(extra: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, extra: 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_fingerprint_tells_tokenizers_apart(tmp_path):
    assert tokenizer_sha256(_word_tokenizer("b")) == tokenizer_sha256(_word_tokenizer("b"))
    assert tokenizer_sha256(_word_tokenizer("b")) != tokenizer_sha256(_word_tokenizer("c"))
    model = _model()
    cache = prefill(model, _ids(40))
    save_prefix(tmp_path / "p.safetensors", cache, model, _word_tokenizer("b"), _ids(40))
    with pytest.raises(PrefixFileError, match=r"different model or tokenizer; differs \(file vs this\): "
                                              r"tokenizer_sha256 [0-9a-f]{12}… vs [0-9a-f]{12}…$"):
        load_prefix(tmp_path / "p.safetensors", model, _word_tokenizer("c"))
    with pytest.raises(PrefixFileError, match=r"tokenizer_sha256 [0-9a-f]{12}… vs none$"):
        load_prefix(tmp_path / "p.safetensors", model, None)


@pytest.mark.slow
def test_smollm2_prefix_answers_questions_like_the_saving_process(tmp_path, smollm2, wikitext_ids):
    import copy

    model, tok = smollm2
    kivi.quantize_model(model, KiviConfig.preset("balanced"))
    try:
        ids = wikitext_ids[None, :700]
        cache = prefill(model, ids)
        snapshot = copy.deepcopy(cache)  # before first use: see docs/python.md, "Saved quantized prefixes"
        save_prefix(tmp_path / "doc.kivi", cache, model, tok, ids)
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
        for q in ("\n\nQuestion: What is this about?\nAnswer:", "\n\nSummary:"):
            q_ids = tok(q, return_tensors="pt", add_special_tokens=False).input_ids
            loaded = load_prefix(tmp_path / "doc.kivi", model, tok)
            full = loaded.continuation_ids(q_ids)
            a = model.generate(full, attention_mask=torch.ones_like(full), cache=copy.deepcopy(snapshot), **kw)
            b = model.generate(full, attention_mask=torch.ones_like(full), cache=loaded.cache, **kw)
            assert torch.equal(a, b)
    finally:
        kivi.dequantize_model(model)


# ---------------------------------------------------------------------------------------------- bad files
@pytest.fixture
def saved(tmp_path):
    model = _model("llama-gqa", _config(2, 2))
    ids = _ids(150)
    cache = prefill(model, ids)
    path = tmp_path / "p.safetensors"
    save_prefix(path, cache, model, None, ids)
    return model, cache, path


def test_wrong_model_is_refused(saved):
    _, _, path = saved
    other = _model(seed=5)
    with pytest.raises(
        PrefixFileError,
        match=r"prefix file was saved for model LlamaForCausalLM \(weights [0-9a-f]{12}…\), "
        r"this model is LlamaForCausalLM \(weights [0-9a-f]{12}…\)",
    ):
        load_prefix(path, other, None)


def test_model_with_other_layers_is_refused(saved):
    _, _, path = saved
    with pytest.raises(PrefixFileError, match=r"num_hidden_layers 2 vs 3"):
        load_prefix(path, _model(num_hidden_layers=3), None)


def test_other_tokenizer_is_refused(saved):
    model, _, path = saved
    fp = {**model_fingerprint(model), "tokenizer_sha256": "ab" * 32}
    with pytest.raises(PrefixFileError, match=r"different model or tokenizer; differs \(file vs this\): "
                                              r"tokenizer_sha256 none vs abababababab…"):
        KiviCache.load(path, fingerprint=fp)


def test_layers_are_checked_against_the_model(saved):
    _, _, path = saved
    fp = read_header(path).fingerprint  # a fingerprint that passes; the model's layers do not
    with pytest.raises(PrefixFileError, match=r"the prefix has 2 layers, the model has 3"):
        KiviCache.load(path, fingerprint=fp, model=_model(num_hidden_layers=3))


def test_other_config_is_refused(saved):
    model, _, path = saved
    with pytest.raises(PrefixFileError, match=r"config differs \(file vs given\): k_bits 2 vs 4$"):
        load_prefix(path, model, None, config=_config(4, 2))
    kivi.quantize_model(model, _config(2, 2, 4))  # the model's own config is the default
    with pytest.raises(PrefixFileError, match=r"config differs \(file vs given\): sink_tokens 0 vs 4$"):
        load_prefix(path, model, None)
    # how attention reads the cache is not part of what it holds
    assert (
        load_prefix(path, model, None, config=_config(2, 2, backend="reference")).cache.attention_backend == "reference"
    )


def _flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_payload_byte_names_the_tensor(saved):
    model, _, path = saved
    h = read_header(path)
    name = "layer1.parts.0.v.store.blocks.0.scale"
    lo, hi = h.offsets[name]
    _flip(path, h.data_start + (lo + hi) // 2)
    with pytest.raises(PrefixFileError, match=rf"checksum mismatch in tensor {name.replace('.', '[.]')}$"):
        load_prefix(path, model, None)


def test_flipped_header_byte_is_caught(saved):
    model, _, path = saved
    data = path.read_bytes()
    pos = data.index(b'k_bits\\": 2')  # inside the kivi_meta JSON string: still valid JSON after the flip
    _flip(path, pos + len('k_bits\\": '))  # "2" -> "3"
    with pytest.raises(PrefixFileError, match=r"metadata checksum mismatch"):
        load_prefix(path, model, None)


def test_truncated_file_says_how_much_is_there(saved):
    model, _, path = saved
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[: full - 1000])
    with pytest.raises(PrefixFileError, match=rf"file is truncated: {full - 1000} of {full} bytes$"):
        load_prefix(path, model, None)
    path.write_bytes(path.read_bytes()[:100])  # cut inside the header
    with pytest.raises(PrefixFileError, match=r"file is truncated: 100 bytes, its header alone needs \d+$"):
        load_prefix(path, model, None)


def test_trailing_bytes_are_refused(saved):
    model, _, path = saved
    path.write_bytes(path.read_bytes() + b"\0" * 10)
    with pytest.raises(PrefixFileError, match=r"file has 10 bytes after its data"):
        load_prefix(path, model, None)


def test_non_kivi_files_are_refused(tmp_path, saved):
    model, _, _ = saved
    text = tmp_path / "notes.txt"
    text.write_text("just some text, certainly not a safetensors file\n")
    with pytest.raises(PrefixFileError, match=r"not a kivi prefix file \(not a safetensors file"):
        load_prefix(text, model, None)
    from safetensors.torch import save_file

    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(3)}, str(other))
    with pytest.raises(PrefixFileError, match=r"a safetensors file but not a kivi prefix file"):
        load_prefix(other, model, None)
    with pytest.raises(PrefixFileError, match=r"does not exist"):
        load_prefix(tmp_path / "missing.safetensors", model, None)
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"abc")
    with pytest.raises(PrefixFileError, match=r"3 bytes, too short"):
        load_prefix(tiny, model, None)


def test_newer_format_version_is_refused(tmp_path, saved):
    model, _, path = saved
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for version, message in (("3", r"format version '3'; this kivi reads versions up to 2"),
                             ("1", r"format version '1' \(an older kivi's layout\); this kivi reads version 2")):
        header["__metadata__"]["kivi_format_version"] = version
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
        with pytest.raises(PrefixFileError, match=message):
            load_prefix(path, model, None)


# ---------------------------------------------------------------------------------------------- saving
def test_failed_save_leaves_the_old_file_and_no_temporary(saved, monkeypatch):
    model, cache, path = saved
    before = path.read_bytes()
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_prefix(path, cache, model, None, _ids(150))
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_save_checks_its_arguments(saved, tmp_path):
    model, cache, _ = saved
    with pytest.raises(TypeError, match="fingerprint must be a dict"):
        cache.save(tmp_path / "x", fingerprint="llama")
    with pytest.raises(ValueError, match=r"input_ids of shape \(1, 3\) must be \[batch, 150\]"):
        cache.save(tmp_path / "x", fingerprint={}, input_ids=_ids(3))
    with pytest.raises(FileNotFoundError, match=r"folder '.*/no' does not exist"):
        cache.save(tmp_path / "no" / "x", fingerprint={})
    assert not (tmp_path / "x").exists()
    import os

    umask = os.umask(0)
    os.umask(umask)
    cache.save(tmp_path / "y", fingerprint={})
    assert (tmp_path / "y").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_quantize_after_round_trip_below_n_continues_past_n(tmp_path):
    """A prefix saved while the cache is still full precision (quantize_after) loads and crosses N exactly
    as the saving process's cache does."""
    cfg = _config(4, 2, 4, quantize_after=90)
    model = _model("llama-gqa", cfg)
    ids = _ids(70)
    cache = prefill(model, ids)
    assert cache.layers[0].k.store.length == 0 and cache.nbytes == 2 * 2 * 2 * 70 * 32 * 4
    path = tmp_path / "p.safetensors"
    save_prefix(path, cache, model, None, ids)
    loaded = load_prefix(path, model, None)
    _same_state(cache, loaded.cache)
    q = _ids(3, seed=7)
    want = _decode(model, cache, q, 40)
    got = _decode(model, loaded.cache, q, 40)
    assert torch.equal(got, want) and cache.layers[0].k.store.length > 0
    _same_state(cache, loaded.cache)


def test_past_recording_state_round_trips(tmp_path):
    """A cache saved right after a recorded forward (its window still holds what is due to move) loads with
    that pending move, so the next forward stores exactly what the saving cache stores."""
    cfg = _config(sink_tokens=2)
    cache = KiviCache(cfg)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 2, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g)
    cache.update(k[:, :, :50], v[:, :, :50], 0)
    cache.layers[0].activate_past_recording()
    cache.update(k[:, :, 50:60], v[:, :, 50:60], 0)
    assert cache.layers[0].due
    cache.save(tmp_path / "due.safetensors", fingerprint={})
    loaded = KiviCache.load(tmp_path / "due.safetensors", fingerprint={})
    _same_state(cache, loaded)
    loaded.layers[0].activate_past_recording()
    for c in (cache, loaded):
        c.update(k[:, :, 60:], v[:, :, 60:], 0)
    _same_state(cache, loaded)
