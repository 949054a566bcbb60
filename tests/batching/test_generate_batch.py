"""generate_batch / init_continuous_batching over KIVI pages: tokens, budget, refusals, prefix sharing."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from kivi import KiviConfig, quantize_model
from kivi.batching import build_layout, fp_block_bytes, generate_batch, init_continuous_batching
from kivi.batching.version import check_transformers_version, transformers_version_problem
from tests.helpers import tiny_model

CFG = dict(k_bits=2, v_bits=2, group_size=16, residual_length=32)
CB = dict(page_size=64, max_batch_tokens=512)
MEM = 4 * 1024**2
LENGTHS = (5, 70, 150, 33, 97, 200, 64, 1)


def _inputs(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


def _single(model_kwargs: dict, cfg: KiviConfig, prompt: list[int], new: int, **qkw) -> list[int]:
    m = quantize_model(tiny_model(**model_kwargs), cfg, **qkw)
    return m.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_greedy_tokens_equal_single_request_generate(backend, monkeypatch):
    """Many requests of different lengths in one batch engine = one generate() each with a KiviCache, the
    same attention backend on both sides ("kivi_paged" attention: the paged core's step; "reference" dequantizes,
    "auto" reads packed pages with kivi's CPU kernels). The scheduler splits a prompt when the step's
    token budget runs out (here the 70-token one, 26 + 44): it equals a generate() whose prefill's first chunk is
    the same (later chunks follow the one-token rule)."""
    from kivi.batching.paged_cache import KiviPagedCache

    first_chunk: dict[str, int] = {}
    record = KiviPagedCache.extend_read_and_write_indices

    def spy(self, request_id, past_length, query_length, read_index, write_index):
        if past_length == 0:
            first_chunk[request_id] = query_length
        record(self, request_id, past_length, query_length, read_index, write_index)

    monkeypatch.setattr(KiviPagedCache, "extend_read_and_write_indices", spy)
    from kivi.paged import decode_call

    per_call: list[int] = []  # requests read by each paged decode kernel call
    run = decode_call.run_paged_decode
    monkeypatch.setattr(decode_call, "run_paged_decode",
                        lambda call, q, **kw: per_call.append(call.counts.shape[0]) or run(call, q, **kw))
    inputs = _inputs()
    cfg = KiviConfig(**CFG, attention_backend=backend)
    model = tiny_model()
    manager = init_continuous_batching(model, cfg, cache_memory=MEM, **CB)
    assert model.config._attn_implementation == "kivi_paged"
    manager.restore_attention()
    assert model.config._attn_implementation == "sdpa"
    out = generate_batch(model, inputs, cfg, cache_memory=MEM, max_new_tokens=24, **CB)
    assert list(out) == [f"req_{i}" for i in range(len(inputs))]
    split = [rid for rid, x in zip(out, inputs) if first_chunk[rid] < len(x)]
    assert split  # the comparison covers a split prompt
    for (rid, o), x in zip(out.items(), inputs):
        if rid not in split:
            assert o.generated_tokens == _single({}, cfg, x, 24), len(x)
        else:
            assert o.generated_tokens == _single({}, cfg, x, 24, prefill_chunk_size=first_chunk[rid]), len(x)
    # packed pages: the decoding requests holding quantized tokens (6 of 8 here) are read by one call per layer
    assert (max(per_call) >= 5) if backend == "auto" else not per_call


def _single_scored(cfg: KiviConfig, prompt: list[int], new: int, **qkw) -> tuple[list[int], list[float]]:
    """Greedy tokens of one generate() and the log-probability of each (what return_logprobs reports)."""
    m = quantize_model(tiny_model(), cfg, **qkw)
    r = m.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, output_scores=True,
                   return_dict_in_generate=True)
    tokens = r.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(r.scores, tokens)]


@pytest.mark.parametrize("cfg", [CFG, dict(k_bits=4, v_bits=2, group_size=16, residual_length=32, sink_tokens=4)],
                         ids=["K2V2", "K4V2-sink4"])
def test_chunked_prompt_equals_kivi_cache_chunked_prefill(cfg):
    """A prompt longer than max_batch_tokens is prefilled in chunks of 64: its later chunks' queries read the
    tokens that left the window during the chunk as one-token decoding would (per-query boundary), as kivi's
    own chunked prefill does: tokens and log-probabilities equal a KiviCache generate() with
    prefill_chunk_size=64 (without the boundary the log-probabilities differ by ~0.03 on this model)."""
    prompt = _inputs((200,))[0]
    kivi_cfg = KiviConfig(**cfg)
    out = generate_batch(tiny_model(), [prompt], kivi_cfg, cache_memory=MEM, max_new_tokens=12, page_size=64,
                         max_batch_tokens=64, return_logprobs=True)
    got = next(iter(out.values()))
    tokens, logprobs = _single_scored(kivi_cfg, prompt, 12, prefill_chunk_size=64)
    assert got.generated_tokens == tokens
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_sliding_window_model_equals_single_request_generate(backend, monkeypatch):
    """Mistral with a 48-token sliding window (prompts up to 200 tokens + 16 new, pages of 16): the "kivi_paged"
    attention applies each request's window, the sliding layers keep no sink
    (sink_tokens=4 is ignored there, as in KiviLayer), and pages that left the window are freed (at 200
    tokens, the first 112); tokens and log-probs equal one generate() per request with a KiviCache."""
    from kivi.batching.allocator import KiviPageAllocator

    evicted = []
    evict = KiviPageAllocator.evict_pages

    def spy(self, request_id, past):
        free = self.pool.count_free_blocks(self.index)
        evict(self, request_id, past)
        if request_id in self.requests and self.requests[request_id].evicted:
            evicted.append((self.requests[request_id].evicted, free, self.pool.count_free_blocks(self.index)))

    monkeypatch.setattr(KiviPageAllocator, "evict_pages", spy)
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16, sink_tokens=4, attention_backend=backend)
    inputs = _inputs((70, 150, 33, 200))
    out = generate_batch(tiny_model("mistral", sliding_window=48), inputs, cfg, cache_memory=MEM, max_new_tokens=16,
                         return_logprobs=True, page_size=16, max_batch_tokens=512)
    assert max(e for e, _, _ in evicted) >= 112
    assert any(after > before for _, before, after in evicted)  # the freed pages went back to the pool
    for x, o in zip(inputs, out.values()):
        m = quantize_model(tiny_model("mistral", sliding_window=48), cfg)
        r = m.generate(torch.tensor([x]), max_new_tokens=16, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)
        tokens = r.sequences[0, len(x):].tolist()
        logprobs = [torch.log_softmax(sc[0].float(), -1)[t].item() for sc, t in zip(r.scores, tokens)]
        assert o.generated_tokens == tokens, len(x)
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(logprobs), atol=1e-5, rtol=0)


@pytest.mark.triton
def test_triton_backend_equals_the_cpu_backend(monkeypatch):
    """``attention_backend="triton"`` (opt-in; CPU pages under ``TRITON_INTERPRET=1`` here): the same requests give
    the tokens and log-probabilities of the ``"cpu"`` backend; without the interpreter, the manager refuses it
    before anything runs, naming what is missing."""
    from tests.helpers import triton_skip_reason

    if triton_skip_reason():
        pytest.skip(triton_skip_reason())
    inputs = _inputs((70, 150, 5))
    out = {}
    for backend in ("cpu", "triton"):
        cfg = KiviConfig(**CFG, attention_backend=backend)
        out[backend] = list(generate_batch(tiny_model(), inputs, cfg, cache_memory=MEM, max_new_tokens=10,
                                           return_logprobs=True, **CB).values())
    for a, b in zip(out["cpu"], out["triton"]):
        assert a.generated_tokens == b.generated_tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delitem(__import__("sys").modules, "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG, attention_backend="triton"), cache_memory=MEM, **CB)


def test_kivi_pages_are_not_float_pages():
    """The comparison above can fail: the float paged cache gives other tokens on this model."""
    inputs = _inputs()
    kivi = generate_batch(tiny_model(), inputs, KiviConfig(**CFG), cache_memory=MEM, max_new_tokens=24, **CB)
    fp = generate_batch(tiny_model(), inputs, None, cache_memory=MEM, max_new_tokens=24, **CB)
    assert sum(a.generated_tokens != b.generated_tokens for a, b in zip(kivi.values(), fp.values())) >= 3


def test_budget_accounting_and_capacity():
    model = tiny_model()
    cfg = KiviConfig(**CFG)
    manager = init_continuous_batching(model, cfg, cache_memory=MEM, **CB)
    manager.start()
    try:
        rid = manager.add_request(_inputs((40,))[0], max_new_tokens=4)
        assert manager.get_result(rid, timeout=60).is_finished()
        cache = manager.batch_processor.cache
        lay = cache.layout
        assert cache.num_blocks * lay.block_bytes == cache.cache_tensor.numel() <= MEM
        assert cache.num_blocks == MEM // lay.block_bytes
        assert all(g.page_bytes <= lay.unit for g in lay.geometries) and lay.unit % 128 == 0
        hp = lay.num_kv_heads * lay.page_size  # the geometry's state bytes are per (kv head, token)
        assert lay.unit < max(g.page_bytes for g in lay.geometries) + hp + math.lcm(128, hp)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    fpm = init_continuous_batching(tiny_model(), None, cache_memory=MEM, **CB)
    assert fpm.continuous_batching_config.num_blocks * fp_block_bytes(model.config, model.dtype, 64) <= MEM


def test_smollm2_shape_holds_4x_the_4k_requests_of_float16():
    """Capacity from page sizes: SmolLM2-135M's shape (30 layers, 3 KV heads of 64), fp16, pages of 256."""
    cfg = transformers.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                                   intermediate_size=1536, vocab_size=49152)
    budget = 4 * 1024**3
    fp = (budget // fp_block_bytes(cfg, torch.float16, 256)) // (4096 // 256)
    kivi = build_layout(cfg, KiviConfig(), 256, torch.float16).requests_that_fit(budget, 4096)
    assert kivi >= 4 * fp, (kivi, fp)


def test_request_that_does_not_fit_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"request of 3000 prompt tokens \+ max_new_tokens=10 needs \d+ KIVI blocks"):
        generate_batch(model, [[1] * 3000], KiviConfig(**CFG), cache_memory=256 * 1024, max_new_tokens=10, **CB)
    assert model.config._attn_implementation == "sdpa"  # given back
    manager = init_continuous_batching(model, None, cache_memory=64 * 1024, **CB)
    with pytest.raises(ValueError, match="float blocks"):
        manager.add_request([1] * 3000, max_new_tokens=10)


def test_budget_below_one_request_is_refused():
    with pytest.raises(ValueError, match="cache_memory=1000 bytes holds 0 KIVI blocks"):
        m = init_continuous_batching(tiny_model(), KiviConfig(**CFG), cache_memory=1000, **CB)
        m._create_batch_processor()


def test_version_pin_message():
    assert transformers_version_problem() is None  # the installed one is tested
    for tested in ("5.24.0", "5.25.3"):
        assert transformers_version_problem(tested) is None
    msg = transformers_version_problem("5.26.1")
    assert "installed transformers is 5.26.1" in msg and "5.24.x, 5.25.x" in msg and "\n" not in msg
    assert "install transformers~=5.25.0" in msg
    with pytest.raises(RuntimeError, match="installed transformers is 4.57.0"):
        check_transformers_version("4.57.0")


def test_untested_version_is_refused_at_init(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.30.0")
    with pytest.raises(RuntimeError, match="installed transformers is 5.30.0"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG), cache_memory=MEM, **CB)


def test_refusals_name_what_is_unsupported():
    with pytest.raises(ValueError, match="cannot run this model with KIVI pages: .* logit softcapping"):  # Gemma 2
        init_continuous_batching(tiny_model("gemma2", sliding_window=64), KiviConfig(**CFG), cache_memory=MEM, **CB)
    with pytest.raises(ValueError, match="page_size=40 must be a multiple of group_size=16"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG), cache_memory=MEM, page_size=40)
    with pytest.raises(ValueError, match="quantize_key=False"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG, quantize_key=False), cache_memory=MEM, **CB)
    with pytest.raises(ValueError, match="use_async_batching"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG), cache_memory=MEM, use_async_batching=True, **CB)
    with pytest.raises(ValueError, match="cache_memory=None"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG), **CB)
    with pytest.raises(TypeError, match="unexpected keyword"):
        init_continuous_batching(tiny_model(), KiviConfig(**CFG), cache_memory=MEM, nonsense=1)


def test_quantized_model_runs_sdpa_and_gets_kivi_attention_back():
    model = quantize_model(tiny_model(), KiviConfig(**CFG))
    assert model.config._attn_implementation == "kivi"
    x = _inputs((90,))[0]
    out = generate_batch(model, [x], KiviConfig(**CFG), cache_memory=MEM, max_new_tokens=12, **CB)
    assert model.config._attn_implementation == "kivi"
    assert next(iter(out.values())).generated_tokens == model.generate(
        torch.tensor([x]), max_new_tokens=12, do_sample=False)[0, 90:].tolist()


def test_prefix_sharing_reuses_quantized_pages():
    """B reuses A's quantized pages of their common prefix; B then equals a single-request generate whose
    prefill is cut at the shared length (its suffix attends to the prefix as stored: quantized)."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32)
    prefix = _inputs((150,), seed=1)[0]
    a = prefix + _inputs((50,), seed=2)[0]
    b = prefix + _inputs((60,), seed=3)[0]
    manager = init_continuous_batching(tiny_model(), cfg, cache_memory=MEM, page_size=64, max_batch_tokens=512)
    manager.start()
    try:
        ra = manager.add_request(a, max_new_tokens=8)
        manager.get_result(ra, timeout=60)
        rb = manager.add_request(b, max_new_tokens=16)
        out_b = manager.get_result(rb, timeout=60)
        cache = manager.batch_processor.cache
        assert cache.shared_tokens == 128  # two pages of 64: what B's own schedule quantizes of the prefix
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    ref = _single({}, KiviConfig(**CFG, attention_backend="reference"), b, 16, prefill_chunk_size=128)
    assert out_b.generated_tokens == ref


def test_prefix_sharing_with_sink_tokens():
    """With 4 sink tokens page i holds tokens [4 + 64i, 4 + 64(i+1)): B (same 150-token prefix as A) takes the
    sink and two pages (132 tokens); C, equal to A only up to token 130, takes the sink and one page (68):
    page 1 depends on tokens up to 132, which transformers' block hash of [0, 128) does not cover. Each
    gives the tokens of a single-request generate whose prefill is cut at its shared length; log-probs
    differ by what sharing changes by design, with or without sinks (the suffix's first queries read the
    prefix's last R tokens quantized; measured 0.003 here, 0.003-0.006 without sinks): a request given a
    wrong sink (zeros) is off by 0.02-0.28."""
    cfg = KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=32, sink_tokens=4)
    prefix = _inputs((150,), seed=1)[0]
    a = prefix + _inputs((50,), seed=2)[0]
    b = prefix + _inputs((60,), seed=3)[0]
    c = prefix[:130] + [(t % 127) + 1 for t in prefix[130:]] + _inputs((60,), seed=4)[0]
    manager = init_continuous_batching(tiny_model(), cfg, cache_memory=MEM, page_size=64, max_batch_tokens=512,
                                       return_logprobs=True)
    manager.start()
    try:
        manager.get_result(manager.add_request(a, max_new_tokens=8), timeout=60)
        cache = manager.batch_processor.cache
        assert cache.use_prefix_sharing
        shared = []
        outs = []
        for prompt in (b, c):
            before = cache.shared_tokens
            outs.append(manager.get_result(manager.add_request(prompt, max_new_tokens=12), timeout=60))
            shared.append(cache.shared_tokens - before)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    assert shared == [132, 68]
    for prompt, out, n in zip((b, c), outs, shared):
        tokens, logprobs = _single_scored(cfg, prompt, 12, prefill_chunk_size=n)
        assert out.generated_tokens == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-2, rtol=0)


def test_cancelled_request_gives_its_pages_back():
    """What `kivi serve` relies on for a client that disconnects: cancel_request frees pages and window blocks."""
    manager = init_continuous_batching(tiny_model(), KiviConfig(**CFG), cache_memory=MEM, **CB)
    manager.start()
    try:
        rid = manager.add_request(_inputs((300,))[0], max_new_tokens=400, streaming=True)
        first = manager.get_result(rid, timeout=60)  # a streamed token: the request holds its cache now
        assert first is not None and not first.is_finished()
        cache = manager.batch_processor.cache
        assert rid in cache.allocator.requests
        manager.cancel_request(rid)
        import time

        def reclaimable() -> int:  # free, or kept only as a hashed prefix page (evicted under memory pressure)
            return cache.free_block_count() + len(cache.allocator.ledger.cached_blocks)

        deadline = time.time() + 30
        while (rid in cache.allocator.requests or reclaimable() < cache.num_blocks) and time.time() < deadline:
            time.sleep(0.05)
        assert rid not in cache.allocator.requests
        assert reclaimable() == cache.num_blocks
        cache.evict_cached_blocks()
        assert cache.free_block_count() == cache.num_blocks
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()


@pytest.mark.parametrize("kivi_cfg", [None, KiviConfig(**CFG)], ids=["float-pages", "kivi-pages"])
def test_a_temperature_below_greedy_below_decodes_greedily(kivi_cfg):
    """kivi.sampling's rule: sampling at 1e-300 (0 in float32) is greedy, not inf/nan probabilities."""
    from transformers import GenerationConfig

    model = tiny_model()
    x = _inputs((40,))[0]
    greedy = model.generate(torch.tensor([x]), max_new_tokens=10, do_sample=False)[0, 40:].tolist()
    sampling = GenerationConfig(do_sample=True, temperature=1e-300, max_new_tokens=10)
    out = generate_batch(model, [x], kivi_cfg, cache_memory=MEM, generation_config=sampling, **CB)
    assert next(iter(out.values())).generated_tokens == greedy
    assert sampling.do_sample and sampling.temperature == 1e-300  # the caller's config is left as it was
