"""KiviPagedCache's forward against kivi's one-request cache (KiviLayer), bit for bit.

Several requests with different lengths and chunkings share one paged cache; each layer's
``layer_forward`` must hand attention exactly what ``KiviLayer.update`` returns for that request
alone (sink + dequantized store + window + new tokens), and leave the same tokens quantized.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi import KiviConfig, KiviLayer
from kivi.batching.decode import decode_step
from kivi.batching.layout import build_layout
from kivi.batching.paged_cache import KiviPagedCache
from kivi.cache.view import materialize
from kivi.optional import numba_available
from kivi.paged.counts import side_counts
from kivi.paged.decode import run_paged_decode
from tests.helpers import tiny_model

H, D = 2, 32


class _Attn(torch.nn.Module):
    """What transformers' SDPA function reads from an attention module (GQA: 4 query heads, 2 kv heads)."""

    is_causal = True
    num_key_value_groups = 2


_ATTN = _Attn()


class _Req:
    """The two things transformers' cache asks of a request state."""

    def __init__(self, rid: str):
        self.request_id = rid
        self.position_offset = 0

    def current_len(self) -> int:
        return self.position_offset


def _cache(cfg: KiviConfig, dtype: torch.dtype, page_size: int = 32, memory: int = 2 * 1024**2,
           sharing: bool = False, packed_backend: str | None = None) -> KiviPagedCache:
    model = tiny_model()
    layout = build_layout(model.config, cfg, page_size, dtype)
    cb = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=512, allow_block_sharing=sharing)
    return KiviPagedCache(model.config, cb, "cpu", layout=layout, cache_memory=memory, packed_backend=packed_backend)


def _run(cfg: KiviConfig, dtype: torch.dtype, schedule: list[list[tuple[str, int]]], seed: int = 0) -> None:
    """``schedule``: steps, each a list of ``(request, new tokens)``; compares every layer of every step:
    the packed mode's views (per-query boundary included) and the materialized mode's tensors."""
    torch.manual_seed(seed)
    cache = _cache(cfg, dtype)
    packed = _cache(cfg, dtype)
    packed.packed_backend = "reference"
    # the "cpu" mode: decoding requests read by the paged decode kernel, their rows in place (window rings)
    kern = _cache(cfg, dtype, packed_backend="cpu") if numba_available() else None
    decoded = 0
    reqs: dict[str, _Req] = {}
    refs: dict[str, list[KiviLayer]] = {}
    for step in schedule:
        batch = []
        for rid, q in step:
            r = reqs.setdefault(rid, _Req(rid))
            refs.setdefault(rid, [KiviLayer(cfg.for_layer(i)) for i in range(2)])
            assert cache.can_store_request_tokens(r, q) and packed.can_store_request_tokens(r, q)
            assert kern is None or kern.can_store_request_tokens(r, q)
            batch.append((rid, r.position_offset, q))
        n = sum(q for _, q in step)
        if kern is not None:
            kern._decode = decode_step(batch, [kern.allocator.state(rid) for rid, _, _ in batch],
                                       kern.allocator.block_table, kern.layout)
        for layer in range(2):
            k = (torch.randn(H, n, D) * 3 + torch.randn(1, 1, D)).to(dtype)  # channel offsets, as real keys
            v = torch.randn(H, n, D).to(dtype)
            ks, vs = cache.layer_forward(layer, k, v, batch)
            pk, pv = packed.layer_forward(layer, k, v, batch)
            kk, kv = kern.layer_forward(layer, k, v, batch) if kern is not None else (pk, pv)
            dec, dec_rows = kk.decode, kk.decode_rows
            dec_out = None
            if dec is not None:
                assert dec.backend == "cpu" and dec.counts.shape[0] == len(dec_rows)
                query = torch.randn(len(dec_rows), 4, D)
                dec_out = run_paged_decode(dec, query, scaling=D**-0.5)
                decoded += 1
            off_new = off_seen = 0
            for i, (rid, past, q) in enumerate(batch):
                # The materialized mode gives every query of a chunk what KiviLayer's first query reads; the
                # packed mode's views carry KiviLayer's per-query boundary (docs/python.md, "Speculative decoding") too.
                ref_layer = refs[rid][layer]
                kview, vview = ref_layer.append(k[None, :, off_new: off_new + q], v[None, :, off_new: off_new + q])
                rk, rv = materialize(kview, ref_layer.dtype), materialize(vview, ref_layer.dtype)
                if dec is not None and i in dec_rows:  # the kernel over the rings against KiviLayer's views
                    r = dec_rows.index(i)
                    fk, fv = materialize(kview, torch.float32), materialize(vview, torch.float32)  # as the kernel
                    want = _attend(query[r], fk[0], fv[0], D**-0.5)
                    torch.testing.assert_close(dec_out[r], want, atol=2e-5, rtol=1e-4)
                else:
                    for got_view, ref_view in ((kk.views[i], kview), (kv.views[i], vview)):
                        assert (got_view.region is None) == (ref_view.region is None)
                        if ref_view.region is not None:
                            assert torch.equal(got_view.region.choice, ref_view.region.choice)
                        assert torch.equal(materialize(got_view, dtype), materialize(ref_view, dtype))
                for got_view, ref_view in ((pk.views[i], kview), (pv.views[i], vview)):
                    assert (got_view.region is None) == (ref_view.region is None), (rid, layer, past, q)
                    assert torch.equal(materialize(got_view, dtype), materialize(ref_view, dtype))
                    if ref_view.region is not None:
                        got_r, ref_r = got_view.region, ref_view.region
                        assert (got_r.first, got_r.exact) == (ref_r.first, ref_r.exact), (rid, layer, past, q)
                        assert torch.equal(got_r.choice, ref_r.choice), (rid, layer, past, q)
                        assert torch.equal(materialize(got_view, dtype, query=-1),
                                           materialize(ref_view, dtype, query=-1)), (rid, layer, past, q)
                got_k = ks[:, off_seen: off_seen + past + q]
                got_v = vs[:, off_seen: off_seen + past + q]
                assert torch.equal(got_k, rk[0]), (rid, layer, past, q, (got_k - rk[0]).abs().max())
                assert torch.equal(got_v, rv[0]), (rid, layer, past, q, (got_v - rv[0]).abs().max())
                st = cache.allocator.requests[rid]
                ref = refs[rid][layer]
                held = [side_counts(cache.layout.layer_configs[layer], side, past + q, st.shared) for side in "kv"]
                assert [h[1] for h in held] == [  # the counts of the token count: what KiviLayer holds
                    ref.k.store.length - ref.k.store.start,
                    ref.v.store.length - ref.v.store.start,
                ]
                assert [h[0] for h in held] == [ref.k.sink_len, ref.v.sink_len]
                off_new += q
                off_seen += past + q
            assert ks.shape[1] == off_seen
        for rid, q in step:
            reqs[rid].position_offset += q
    if kern is not None and all(lay is not None for lay in kern._kernel_layouts):
        assert decoded > 100  # most steps of SCHEDULE ran the kernel, long after the rings wrapped


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """``q [Hq, D]`` over ``k / v [H, T, D]`` (GQA), softmax attention in float32: ``[Hq, D]``."""
    g = q.shape[0] // k.shape[0]
    p = torch.softmax(torch.einsum("hgd,htd->hgt", q.view(k.shape[0], g, -1), k) * scaling, dim=-1)
    return torch.einsum("hgt,htd->hgd", p, v).reshape(q.shape)


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
def test_paged_forward_equals_kivi_layer(name, dtype):
    _run(CONFIGS[name], dtype, SCHEDULE)


def test_freed_request_gives_back_window_and_pages():
    cfg = CONFIGS["K2V2"]
    cache = _cache(cfg, torch.float32)
    free0 = cache.free_block_count()
    r = _Req("x")
    assert cache.can_store_request_tokens(r, 100)
    cache.layer_forward(0, torch.randn(H, 100, D), torch.randn(H, 100, D), [("x", 0, 100)])
    used = free0 - cache.free_block_count()
    assert used == cache.layout.request_blocks(100)
    cache.free_blocks("x")
    assert cache.free_block_count() == free0
    assert "x" not in cache.allocator.requests


def test_refused_value_leaves_pages_unchanged():
    cfg = CONFIGS["K2V2"]
    cache = _cache(cfg, torch.float32)
    r = _Req("x")
    assert cache.can_store_request_tokens(r, 80)
    k, v = torch.randn(H, 80, D), torch.randn(H, 80, D)
    v[0, 3, 5] = float("nan")
    before = cache.cache_tensor.clone()
    with pytest.raises(ValueError):
        cache.layer_forward(0, k, v, [("x", 0, 80)])
    assert torch.equal(cache.cache_tensor, before)
    v[0, 3, 5] = 0.0  # the same forward, now finite, goes through
    cache.layer_forward(0, k, v, [("x", 0, 80)])
    assert [side_counts(cfg, side, 80)[1] for side in "kv"] == [48, 48]
    assert not torch.equal(cache.cache_tensor, before)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", ["K2V2", "balanced-sink4"])
def test_packed_attention_matches_materialized_pages(name, backend):
    """The packed path (kivi's backend over page views, no dequantized context) against the plain one
    (pages dequantized, full-precision attention per request), on the same batch. A chunk into a request
    that holds tokens (b's 70, c's 30 while others decode) carries a per-query boundary: the plain side
    then attends query by query over its own keys (the materialized tensor, with the tokens that left the
    window by that query's step taken from the view's ``left``)."""
    from kivi.batching.paged_attention import PagedBatchViews, fp_attention, paged_attention_forward

    cfg = CONFIGS[name]
    torch.manual_seed(1)
    packed, plain = _cache(cfg, torch.float32, packed_backend=backend), _cache(cfg, torch.float32)
    reqs, batched = {}, 0
    schedule = [[("a", 45), ("b", 3)], [("a", 1), ("b", 70)]] + [[("a", 1), ("b", 1), ("c", 30 if i == 0 else 1)]
                                                                  for i in range(20)]
    for step in schedule:
        batch = []
        for rid, q in step:
            r = reqs.setdefault(rid, _Req(rid))
            assert packed.can_store_request_tokens(r, q) and plain.can_store_request_tokens(r, q)
            batch.append((rid, r.position_offset, q))
        n = sum(q for _, q in step)
        k = torch.randn(H, n, D) * 3 + torch.randn(1, 1, D)
        v = torch.randn(H, n, D)
        query = torch.randn(1, 4, n, D)  # GQA: 4 query heads over 2 kv heads
        packed._decode = decode_step(batch, [packed.allocator.state(rid) for rid, _, _ in batch],
                                     packed.allocator.block_table, packed.layout) if backend == "cpu" else None
        pk, pv = packed.layer_forward(0, k, v, batch)
        mk, mv = plain.layer_forward(0, k, v, batch)
        assert isinstance(pk, PagedBatchViews)
        batched += pk.decode is not None
        got, _ = paged_attention_forward(_ATTN, query, pk, pv, None, scaling=D**-0.5)
        off_q = off_k = 0
        for i, (_rid, past, q) in enumerate(batch):
            keys, vals = mk[None, :, off_k: off_k + past + q], mv[None, :, off_k: off_k + past + q]
            qry = query[:, :, off_q: off_q + q]
            if pk.views[i] is None:  # a decoding request, read by the one paged decode kernel call
                assert q == 1 and backend == "cpu" and i in pk.decode_rows and pv.decode is pk.decode
            if pk.views[i] is None or (pk.views[i].region is None and pv.views[i].region is None):
                want = fp_attention(_ATTN, qry, keys, vals, D**-0.5).transpose(1, 2)
            else:
                rows = []
                for j in range(q):
                    kv_j = []
                    for view, plain_t in ((pk.views[i], keys), (pv.views[i], vals)):
                        if view.region is None:
                            kv_j.append(plain_t)
                            continue
                        kv_j.append(materialize(view, torch.float32, query=j))  # what query j reads
                    end = past + j + 1  # causal: query j sees the tokens up to itself
                    rows.append(fp_attention(_ATTN, qry[:, :, j: j + 1], kv_j[0][:, :, :end], kv_j[1][:, :, :end],
                                             D**-0.5))
                assert q > 1 and past > 0
                want = torch.cat(rows, dim=2).transpose(1, 2)
            torch.testing.assert_close(got[:, off_q: off_q + q], want, atol=2e-5, rtol=1e-4)
            off_q += q
            off_k += past + q
        for rid, q in step:
            reqs[rid].position_offset += q
    assert packed.max_dequantized_bytes == 0
    assert batched == (21 if backend == "cpu" else 0)  # every step after the prefills: the paged decode kernel


def test_fp_attention_is_bottom_right_causal():
    from kivi.batching.paged_attention import fp_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    got = fp_attention(_ATTN, q, k, v, None)
    for i in range(3):
        keep = 7 - 3 + i + 1
        s = (q[:, :, i: i + 1] @ k4[:, :, :keep].transpose(-1, -2)) * 8**-0.5
        torch.testing.assert_close(got[:, :, i: i + 1], s.softmax(-1) @ v4[:, :, :keep])


def test_window_rows_are_distinct_and_inside_the_window_blocks():
    layout = _cache(CONFIGS["balanced-sink4"], torch.float16).layout
    blocks = [7, 3, 9, 11, 2, 5][: layout.window_blocks]
    idx = layout.window_index(blocks).view(-1, 2)
    assert idx.shape[0] == layout.num_layers * 2 * layout.window_rows
    assert set(idx[:, 0].tolist()) <= set(blocks) and int(idx[:, 1].max()) < layout.rows_per_block
    assert len({(int(b), int(r)) for b, r in idx}) == idx.shape[0]  # no two slots share a row


@pytest.mark.parametrize("mode", ["kernel", "views"])
@pytest.mark.parametrize("name", ["K2V2", "balanced-sink4"])
def test_a_step_writes_only_its_new_row(name, mode):
    """The window is a ring in its slots (kivi.paged.ring): a decode step writes one row per side, its new token's
    (a sink slot below ``S``, else its ring slot); the tokens that stay in the window are not rewritten, those
    that leave not moved, the sink's not copied (120 steps: the rings wrap twice). Both paths: the paged decode
    kernel's (rows read in place) and per-request views."""
    if mode == "kernel" and not numba_available():
        pytest.skip("numba not installed")
    cfg = CONFIGS[name]
    cache = _cache(cfg, torch.float32, packed_backend="cpu" if mode == "kernel" else "reference")
    torch.manual_seed(0)
    reqs = {rid: _Req(rid) for rid in ("a", "b")}
    for step in range(121):
        batch = []
        for rid, q in (("a", 20 if step == 0 else 1), ("b", 3 if step == 0 else 1)):
            assert cache.can_store_request_tokens(reqs[rid], q)
            batch.append((rid, reqs[rid].position_offset, q))
        states = [cache.allocator.state(rid) for rid, _, _ in batch]
        if mode == "kernel":
            cache._decode = decode_step(batch, states, cache.allocator.block_table, cache.layout)
        n = sum(q for _, _, q in batch)
        before = cache._rows.clone()
        keys, _ = cache.layer_forward(0, torch.randn(H, n, D), torch.randn(H, n, D), batch)
        windows = torch.tensor(sorted({b for st in states for b in st.window_blocks}))  # pages change too
        changed = int((cache._rows[windows] != before[windows]).flatten(2).any(-1).sum())
        if step:
            if step >= 50:  # both requests hold quantized tokens: the kernel reads them (mode "kernel")
                assert (keys.decode is not None) == (mode == "kernel")
            assert changed == 2 * len(batch), (step, changed)
        for rid, _, q in batch:
            reqs[rid].position_offset += q


@pytest.mark.parametrize("mode", ["kernel", "views"])
def test_refused_value_in_a_decode_step_leaves_rings_and_pages_unchanged(mode):
    """A NaN value enters the window (nothing quantizes it yet) and is refused when it leaves, R steps later:
    that step writes nothing — no page, no ring slot (its new token's neither)."""
    if mode == "kernel" and not numba_available():
        pytest.skip("numba not installed")
    cfg = CONFIGS["K2V2"]
    cache = _cache(cfg, torch.float32, packed_backend="cpu" if mode == "kernel" else "reference")
    torch.manual_seed(0)
    r = _Req("x")
    for step in range(cfg.residual_length + 2):
        q = 40 if step == 0 else 1
        assert cache.can_store_request_tokens(r, q)
        batch = [("x", r.position_offset, q)]
        st = cache.allocator.state("x")
        if mode == "kernel":
            cache._decode = decode_step(batch, [st], cache.allocator.block_table, cache.layout)
        k, v = torch.randn(H, q, D), torch.randn(H, q, D)
        if step == 1:
            v[0, 0, 3] = float("nan")  # the token at position 40, in the window for R steps
        before = cache.cache_tensor.clone()
        if r.position_offset - cfg.residual_length == 40:  # the NaN token leaves the window in this step
            with pytest.raises(ValueError):
                cache.layer_forward(0, k, v, batch)
            assert torch.equal(cache.cache_tensor, before)
            break
        cache.layer_forward(0, k, v, batch)
        r.position_offset += q
    else:
        raise AssertionError("the NaN token never left the window")
