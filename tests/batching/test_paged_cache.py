"""KiviPagedCache's step against kivi's one-request cache (KiviLayer).

Several requests with different lengths and chunkings share one paged cache; every layer's step (``update`` then
``attend``, as the ``"kivi_paged"`` attention runs them) must give each request the attention ``KiviLayer`` gives
it alone (bit for bit through ``"reference"``; within float32 rounding through ``"cpu"``, whose decode rows go
through the paged decode kernel), and leave the same tokens quantized.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi import KiviConfig, KiviLayer
from kivi.batching.layout import build_layout
from kivi.batching.paged_attention import StepInput
from kivi.batching.paged_cache import KiviPagedCache
from kivi.optional import numba_available
from kivi.paged import decode_call
from kivi.paged.counts import side_counts
from kivi.paged.ring import ring_slot, slot_place
from tests.helpers import tiny_model
from tests.paged.test_forward import reference_step

H, HQ, D = 2, 4, 32


class _Req:
    """The two things transformers' cache asks of a request state."""

    def __init__(self, rid: str):
        self.request_id = rid
        self.position_offset = 0

    def current_len(self) -> int:
        return self.position_offset


def _cache(cfg: KiviConfig, dtype: torch.dtype, backend: str = "reference", page_size: int = 32,
           memory: int = 2 * 1024**2) -> KiviPagedCache:
    model = tiny_model()
    layout = build_layout(model.config, cfg, page_size, dtype)
    cb = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=512)
    return KiviPagedCache(model.config, cb, "cpu", layout=layout, cache_memory=memory, packed_backend=backend)


def _forward(cache: KiviPagedCache, reqs: dict, step: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Admit ``step`` (``(request, new tokens)`` each) as transformers does: blocks, then the batch plan."""
    batch = []
    for rid, q in step:
        r = reqs.setdefault(rid, _Req(rid))
        assert cache.can_store_request_tokens(r, q)
        batch.append((rid, r.position_offset, q))
        cache.extend_read_and_write_indices(rid, r.position_offset, q, None, [])
    return batch


def _layer(cache: KiviPagedCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One layer's step on ``[n, H*, D]`` inputs: ``update`` then ``attend`` (what "kivi_paged" runs)."""
    key, value = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer, {})
    assert isinstance(key, StepInput) and value is key
    return cache.attend(layer, q, key.key, key.value, D**-0.5)


def _run(cfg: KiviConfig, dtype: torch.dtype, backend: str, schedule, seed: int = 0) -> int:
    """``schedule``: steps, each a list of ``(request, new tokens)``; compares every layer of every step with each
    request's own ``KiviLayer``. Returns how many paged decode kernel calls ran."""
    g = torch.Generator().manual_seed(seed)
    cache = _cache(cfg, dtype, backend)
    reqs: dict[str, _Req] = {}
    refs: dict[str, list[KiviLayer]] = {}
    tol = dict(atol=0, rtol=0) if backend == "reference" else dict(atol=2e-5, rtol=1e-4)
    for step in schedule:
        batch = _forward(cache, reqs, step)
        n = sum(q for _, q in step)
        for layer in range(2):
            k = (torch.randn(n, H, D, generator=g) * 3 + torch.randn(1, 1, D, generator=g)).to(dtype)
            v = torch.randn(n, H, D, generator=g).to(dtype)
            q = torch.randn(n, HQ, D, generator=g).to(dtype)
            out = _layer(cache, layer, q, k, v)
            lo = 0
            for rid, past, ql in batch:
                ref = refs.setdefault(rid, [KiviLayer(cfg.for_layer(i)) for i in range(2)])[layer]
                assert ref.get_seq_length() == past
                want = reference_step(ref, q[lo:lo + ql], k[lo:lo + ql], v[lo:lo + ql], D**-0.5)
                torch.testing.assert_close(out[lo:lo + ql], want, **tol, msg=f"{rid} layer {layer} {past}+{ql}")
                st = cache.allocator.requests[rid]
                held = [side_counts(cache.layout.layer_configs[layer], side, past + ql, st.shared) for side in "kv"]
                assert [h[1] for h in held] == [ref.k.store.length - ref.k.store.start,
                                                ref.v.store.length - ref.v.store.start]
                assert [h[0] for h in held] == [ref.k.sink_len, ref.v.sink_len]
                lo += ql
        for rid, q in step:
            reqs[rid].position_offset += q


SCHEDULE = (
    [[("a", 45), ("b", 3)]]  # prefills of odd lengths
    + [[("a", 1), ("b", 70 if i == 0 else 1)] for i in range(40)]  # b's chunk, then decodes
    + [[("c", 100), ("a", 1)]]  # a request joins mid-way
    + [[("a", 1), ("b", 1), ("c", 1)] for _ in range(37)]
)

CONFIGS = {
    "K2V2": KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32),
    "balanced-sink4": KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=32, sink_tokens=4),
    "K2V2-clip-sink2": KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32, sink_tokens=2, clip=True),
    "balanced-clip-keys": KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=32, clip="keys"),
    "layer-override-comp": KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16, residual_bits=2,
                                      layer_specific_config={1: {"k_bits": 4, "residual_length": 48}}),
    "R0-sym-fp32-scales": KiviConfig(k_bits=4, v_bits=4, group_size=8, residual_length=0, symmetric=True,
                                     scale_dtype="float32"),
}


def _config_dtype_cases():
    """Every config in float32 and in one half dtype (bf16 and fp16 alternating) for the default suite; its other
    half dtype is `long` (CI step 1c): the half dtypes share the pages' code, they differ in rounding only."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    cases = []
    for i, name in enumerate(CONFIGS):
        half = ("bf16", "fp16")[i % 2]
        for d, dtype in dtypes.items():
            marks = () if d in ("fp32", half) else (pytest.mark.long,)
            cases.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{d}"))
    return cases



@pytest.mark.parametrize("name,dtype", _config_dtype_cases())
def test_paged_step_equals_kivi_layer(name, dtype):
    _run(CONFIGS[name], dtype, "reference", SCHEDULE)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("name", ["K2V2", "balanced-sink4", "layer-override-comp"])
def test_cpu_backend_equals_kivi_layer_and_decodes_in_one_kernel_call(name, monkeypatch):
    """The "cpu" backend: every decode row with something stored is read by one paged decode kernel call per
    layer (rows in place in the window rings, long after they wrapped); outputs within float32 rounding."""
    calls = []
    run = decode_call.run_paged_decode
    monkeypatch.setattr(decode_call, "run_paged_decode",
                        lambda call, q, **kw: calls.append(call.counts.shape[0]) or run(call, q, **kw))
    _run(CONFIGS[name], torch.float32, "cpu", SCHEDULE)
    if name != "layer-override-comp":  # compensation codes: the kernel declines them (kivi.capabilities)
        assert len(calls) > 100 and max(calls) == 3


SHORT_SCHEDULE = (  # SCHEDULE's shape in fewer steps (the Triton interpreter runs a kernel call in ~0.1 s)
    [[("a", 45), ("b", 3)]]
    + [[("a", 1), ("b", 70 if i == 0 else 1)] for i in range(8)]
    + [[("c", 100), ("a", 1)]]
    + [[("a", 1), ("b", 1), ("c", 1)] for _ in range(8)]
)


@pytest.mark.triton
@pytest.mark.parametrize("name", ["balanced-sink4", pytest.param("K2V2", marks=pytest.mark.long)])
def test_triton_backend_equals_kivi_layer_and_decodes_in_one_kernel_call(name, monkeypatch):
    """The "triton" backend (the vLLM plugin's GPU path, here on CPU pages under ``TRITON_INTERPRET=1``): the same
    step, its decode rows read by one Triton paged decode call per layer and a decode-only step written by the Triton
    page writes; outputs within float32 rounding of each request's own KiviLayer."""
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)
    from kivi.paged import write

    calls, writes = [], []
    run, write_step = decode_call.run_paged_decode, write.write_step
    monkeypatch.setattr(decode_call, "run_paged_decode",
                        lambda call, q, **kw: calls.append((call.backend, call.counts.shape[0])) or run(call, q, **kw))
    import kivi.paged.forward as forward

    monkeypatch.setattr(forward, "write_step", lambda writer, *a, **kw: writes.append(type(writer).__name__)
                        or write_step(writer, *a, **kw))
    _run(CONFIGS[name], torch.float32, "triton", SHORT_SCHEDULE)
    assert {b for b, _ in calls} == {"triton"} and len(calls) >= 20 and max(n for _, n in calls) == 3
    assert writes and set(writes) == {"TritonWriter"}


def test_freed_request_gives_back_window_and_pages():
    cache = _cache(CONFIGS["K2V2"], torch.float32)
    free0 = cache.free_block_count()
    _forward(cache, {}, [("x", 100)])
    _layer(cache, 0, torch.randn(100, HQ, D), torch.randn(100, H, D), torch.randn(100, H, D))
    assert free0 - cache.free_block_count() == cache.layout.request_blocks(100)
    cache.free_blocks("x")
    assert cache.free_block_count() == free0
    assert "x" not in cache.allocator.requests


def test_refused_value_leaves_pages_unchanged():
    cfg = CONFIGS["K2V2"]
    cache = _cache(cfg, torch.float32)
    _forward(cache, {}, [("x", 80)])
    q, k, v = torch.randn(80, HQ, D), torch.randn(80, H, D), torch.randn(80, H, D)
    v[3, 0, 5] = float("nan")
    before = cache.cache_tensor.clone()
    with pytest.raises(ValueError):
        _layer(cache, 0, q, k, v)
    assert torch.equal(cache.cache_tensor, before)
    v[3, 0, 5] = 0.0  # the same step, now finite, goes through
    cache.extend_read_and_write_indices("x", 0, 80, None, [])
    _layer(cache, 0, q, k, v)
    assert [side_counts(cfg, side, 80)[1] for side in "kv"] == [48, 48]
    assert not torch.equal(cache.cache_tensor, before)


def test_the_layout_is_the_paged_cores_geometry():
    """A block is one unit per layer; layer l's pages and rings are views of unit l of every block (no unit
    shared by two layers), ring rows inside their unit, and every layer's geometry is one unit a block."""
    cache = _cache(CONFIGS["balanced-sink4"], torch.float16)
    lay, pool = cache.layout, cache.cache_tensor
    assert lay.block_bytes == lay.unit * lay.num_layers and all(g.block_bytes == lay.unit for g in lay.geometries)
    for layer in range(lay.num_layers):
        pages, rings = lay.pages(pool, layer), lay.rings(pool, layer)
        base = pool.data_ptr()
        first = (pages.data_ptr() - base, rings.data_ptr() - base)
        assert first == (layer * lay.unit, layer * lay.unit)
        assert pages.stride(0) == lay.block_bytes and rings.stride(0) * 2 == lay.block_bytes
        assert rings[0].numel() * 2 <= lay.unit and rings.shape[2] == lay.window_tokens


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", ["K2V2", "balanced-sink4"])
def test_a_step_writes_only_its_new_row(name, backend):
    """The window is a ring in its slots (kivi.paged.ring): a decode step writes one row per request, its new
    token's (a sink slot below ``S``, else its ring slot); the tokens that stay in the window are not rewritten,
    those that leave not moved, the sink's not copied (120 steps: the rings wrap twice)."""
    if backend == "cpu" and not numba_available():
        pytest.skip("numba not installed")
    cfg = CONFIGS[name]
    cache = _cache(cfg, torch.float32, backend)
    lay, geo = cache.layout, cache.layout.geometries[0]
    rings = lay.rings(cache.cache_tensor, 0)
    reqs: dict[str, _Req] = {}
    torch.manual_seed(0)
    for step in range(121):
        batch = _forward(cache, reqs, [("a", 20 if step == 0 else 1), ("b", 3 if step == 0 else 1)])
        n = sum(q for _, _, q in batch)
        before = rings.clone()
        _layer(cache, 0, torch.randn(n, HQ, D), torch.randn(n, H, D), torch.randn(n, H, D))
        if step:
            want = set()
            for rid, past, _ in batch:
                j, row = slot_place(ring_slot(past, geo.window_rings * geo.window_tokens - cfg.sink_tokens,
                                              cfg.sink_tokens), geo.window_tokens)
                want.add((cache.allocator.requests[rid].window_blocks[j], row))
            held = sorted({b for rid, _, _ in batch for b in cache.allocator.requests[rid].window_blocks})
            changed = {(b, r) for b in held for r in range(geo.window_tokens)
                       if not torch.equal(rings[b, :, r], before[b, :, r])}
            assert changed == want, (step, changed, want)
        for rid, _, q in batch:
            reqs[rid].position_offset += q


@pytest.mark.parametrize("backend", ["cpu", "reference", pytest.param("triton", marks=pytest.mark.triton)])
def test_refused_value_in_a_decode_step_leaves_rings_and_pages_unchanged(backend):
    """A NaN value enters the window (nothing quantizes it yet) and is refused when it leaves, R steps later:
    that step writes nothing — no page, no ring slot (its new token's neither); "triton": the Triton page writes'
    finiteness flag, read back before anything is written."""
    if backend == "cpu" and not numba_available():
        pytest.skip("numba not installed")
    if backend == "triton":
        from tests.helpers import triton_skip_reason

        if triton_skip_reason():
            pytest.skip(triton_skip_reason())
    cfg = CONFIGS["K2V2"]
    cache = _cache(cfg, torch.float32, backend)
    torch.manual_seed(0)
    reqs: dict[str, _Req] = {}
    for step in range(cfg.residual_length + 2):
        q = 40 if step == 0 else 1
        past = reqs["x"].position_offset if "x" in reqs else 0
        _forward(cache, reqs, [("x", q)])
        k, v = torch.randn(q, H, D), torch.randn(q, H, D)
        if step == 1:
            v[0, 0, 3] = float("nan")  # the token at position 40, in the window for R steps
        before = cache.cache_tensor.clone()
        if past - cfg.residual_length == 40:  # the NaN token leaves the window in this step
            with pytest.raises(ValueError):
                _layer(cache, 0, torch.randn(q, HQ, D), k, v)
            assert torch.equal(cache.cache_tensor, before)
            break
        _layer(cache, 0, torch.randn(q, HQ, D), k, v)
        reqs["x"].position_offset += q
    else:
        raise AssertionError("the NaN token never left the window")
