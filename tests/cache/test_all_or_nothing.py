"""Every cache mutation is all or nothing: a failure injected at each step leaves the cache bit-identical.

For each operation (``KiviCache.update`` prefill / chunk / decode, on full, sliding and sink layers,
reference and packed backends; ``crop``; ``reorder_cache``; ``batch_select_indices``;
``batch_repeat_interleave``), the test runs it once per step it makes, failing the k-th step
(k = 1, 2, ... until the operation completes without reaching k). A step is any call of the functions
the cache is built from: the quantizers (torch and numba), dequantization, the schedule's arithmetic,
every ``BlockStore`` method, every ``KiviLayer`` helper, ``torch.cat`` / ``ones`` / ``empty`` in the
cache modules, and the tensor methods ``clone`` / ``copy_`` / ``to`` / ``index_select`` /
``repeat_interleave``. After each failure the cache must equal a snapshot taken before (every
visible stored row, window, sink and mask bit for bit, block layout, counters, dtype, ``nbytes``),
and the next update must return what an untouched copy returns.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import kivi.cache.boundary as boundary_mod
import kivi.cache.kivi_cache as cache_mod
import kivi.cache.layer as layer_mod
import kivi.cache.side as side_mod
import kivi.cache.sliding as sliding_mod
import kivi.cache.step as step_mod
import kivi.cache.store as store_mod
import kivi.cache.view as view_mod
from kivi import KiviCache, KiviConfig
from kivi.cache.layer import KiviLayer
from kivi.cache.sliding import SlidingKiviLayer
from kivi.cache.view import PackedStates, materialize


class Injected(Exception):
    """The failure the test injects."""


class Injector:
    """Counts the calls of every wrapped step; the ``fail_at``-th one raises :class:`Injected` (once)."""

    def __init__(self, fail_at: int):
        self.fail_at, self.calls, self.fired = fail_at, 0, None

    def wrap(self, name: str, fn):
        def step(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at and self.fired is None:
                self.fired = name
                raise Injected(name)
            return fn(*args, **kwargs)

        return step


class _TorchProxy:
    """A module's ``torch`` with counted ``cat`` / ``ones`` / ``empty``."""

    COUNTED = ("cat", "ones", "empty")

    def __init__(self, inj: Injector):
        self._inj = inj

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return self._inj.wrap(f"torch.{name}", attr) if name in self.COUNTED else attr


MODULE_FUNCTIONS = {
    layer_mod: ("prefill_exact_queries", "materialize", "check_head_dim"),
    side_mod: ("quantize_side", "quantize_tokens_into", "token_quantizer_supported", "dequantize_kv", "key_group_start",
               "window_exits",
               "FpSegment", "AttentionView", "token_slice", "set_boundary"),
    boundary_mod: ("window_exits", "query_boundaries", "dequantize_kv", "token_slice"),
    sliding_mod: ("sliding_cut",),
    store_mod: ("new_block_tokens", "token_divisor"),
    view_mod: ("dequantize_kv",),
    cache_mod: ("PackedStates",),
}
METHODS = {
    store_mod.BlockStore: ("append", "append_in_place", "_new_block", "_divisor", "evict", "truncate", "read",
                           "iter_blocks", "map_tensors", "checkpoint"),
    side_mod.SideState: ("map_tensors", "checkpoint", "pending_valid", "view", "flush", "_store_moved", "_fast_tokens",
                         "quantize_tokens", "crop"),
    KiviLayer: ("lazy_initialization", "append", "_flush_due", "_map", "checkpoint"),
    sliding_mod.SlidingKiviLayer: ("_cut", "_before_forward"),
    KiviCache: ("_new_token_valid",),
    KiviConfig: ("for_layer",),
    torch.Tensor: ("clone", "copy_", "to", "index_select", "repeat_interleave"),
}


def _install(mp: pytest.MonkeyPatch, inj: Injector) -> None:
    for mod, names in MODULE_FUNCTIONS.items():
        for name in names:
            if hasattr(mod, name):
                mp.setattr(mod, name, inj.wrap(name, getattr(mod, name)))
    for mod in (layer_mod, side_mod, step_mod, boundary_mod, store_mod, view_mod):
        mp.setattr(mod, "torch", _TorchProxy(inj))
    for cls, names in METHODS.items():
        for name in names:
            # methods the class defines itself (not inherited), and torch's tensor methods
            fn = getattr(cls, name) if cls is torch.Tensor else vars(cls).get(name)
            if fn is not None:
                mp.setattr(cls, name, inj.wrap(f"{cls.__name__}.{name}", fn))


# --------------------------------------------------------------------------- snapshots


def _bits(t: torch.Tensor | None):
    if t is None:
        return None
    return str(t.dtype), tuple(t.shape), t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _layout(seg) -> dict:
    return {f.name: (_bits(getattr(seg, f.name)) if isinstance(getattr(seg, f.name), torch.Tensor)
                     else getattr(seg, f.name)) for f in dataclasses.fields(seg)}


def snapshot(cache: KiviCache) -> dict:
    """Everything observable about a cache (rows past a store's length are free space, not state)."""
    out = {"layers": len(cache.layers), "nbytes": cache.nbytes, "seq": cache.get_seq_length(),
           "breakdown": cache.memory_breakdown()}
    for i, layer in enumerate(cache.layers):
        d = {"seen": layer.seen, "dtype": layer.dtype, "init": layer.is_initialized,
             "fast": (dict(layer.k._fast), dict(layer.v._fast)),
             "device": vars(layer).get("device"), "kv_offset": layer.kv_offset,
             "mask": layer.get_mask_sizes(1) if layer.is_initialized else None}
        for name, side in (("k", layer.k), ("v", layer.v)):
            st = side.store
            d[name] = {
                "window": _bits(side.window), "window_valid": _bits(side.window_valid), "sink": _bits(side.sink),
                "length": st.length, "start": st.start, "starts": list(st.starts), "caps": list(st.caps),
                "blocks": [None if b is None else {k: (tuple(t.shape), str(t.dtype)) for k, t in b.items()}
                           for b in st.blocks],
                "template": None if st.template is None else _layout(st.template),
                "rows": [(pos, _layout(seg)) for pos, seg in st.iter_blocks()],
            }
        out[i] = d
    return out


# --------------------------------------------------------------------------- caches and operations

CFG = dict(group_size=8, residual_length=16, block_size=32)
B, H, D = 2, 2, 16


def _tokens(n: int, dtype: torch.dtype, seed: int, batch: int = B):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, H, n, D, generator=g).to(dtype), torch.randn(batch, H, n, D, generator=g).to(dtype))


LONG = (60, 1, 1, 9, 1, 40)  # 112 tokens: the sliding layer evicts at its next forward (cut 0 -> 64, frees a block)
SHORT = (45, 1, 1, 9, 1)  # 57 tokens: nothing evicted yet, so a crop may reach into the sinks


def _build(kind: str, history: tuple[int, ...] = LONG) -> tuple[KiviCache, torch.dtype]:
    """A cache with some history: a full layer, a sliding one, a third with other settings."""
    if kind == "fp32-fast":  # values leave the window through the numba quantizer
        cfg, dtype, backend = KiviConfig(**CFG), torch.float32, "reference"
    elif kind == "bf16-sinks":
        cfg, dtype, backend = KiviConfig(**CFG, sink_tokens=3, k_bits=4), torch.bfloat16, "reference"
    elif kind == "fp16-unquantized-keys":
        cfg, dtype, backend = KiviConfig(**CFG, quantize_key=False, v_bits=4), torch.float16, "reference"
    elif kind == "packed-cpu":
        pytest.importorskip("numba")
        cfg, dtype, backend = KiviConfig(**CFG, sink_tokens=2), torch.float32, "cpu"
    else:
        raise AssertionError(kind)
    layers = [KiviLayer(cfg), SlidingKiviLayer(cfg, sliding_window=24), KiviLayer(dataclasses.replace(cfg, v_bits=8))]
    cache = KiviCache(cfg, layers=layers, attention_backend=backend)
    mask = torch.ones(B, 200, dtype=torch.long)
    mask[1, :5] = 0  # row 1 left-padded
    seen = 0
    for step, n in enumerate(history):
        cache.set_attention_mask(mask[:, : seen + n])
        k, v = _tokens(n, dtype, seed=step)
        for i in range(len(layers)):
            cache.update(k, v, i)
        seen += n
    cache.set_attention_mask(None)
    return cache, dtype


def _out(x):
    return materialize(x.view) if isinstance(x, PackedStates) else x


def _update(n: int, layer_idx: int, padded: bool = False):
    def op(cache: KiviCache, dtype: torch.dtype):
        k, v = _tokens(n, dtype, seed=100 + n)
        if padded:
            mask = torch.ones(B, cache.get_seq_length() + n, dtype=torch.long)
            mask[0, -n:-n + 2] = 0
            cache.set_attention_mask(mask)
        out = cache.update(k, v, layer_idx)  # (PackedStates are read by attention later: not a cache step)
        cache.set_attention_mask(None)
        return out

    return op


OPS = {
    "decode-full": _update(1, 0),
    "decode-sliding": _update(1, 1),
    "chunk-19-padded": _update(19, 0, padded=True),
    "chunk-40-sliding": _update(40, 1),
    "chunk-33-layer2": _update(33, 2),
    "crop-3": lambda c, dt: c.crop(-3),
    "crop-30": lambda c, dt: c.crop(-30),
    "crop-to-2": lambda c, dt: c.crop(-(c.get_seq_length() - 2)),
    "reorder": lambda c, dt: c.reorder_cache(torch.tensor([1, 0])),
    "select": lambda c, dt: c.batch_select_indices(torch.tensor([1])),
    "repeat": lambda c, dt: c.batch_repeat_interleave(2),
}


def _next_update(cache: KiviCache, dtype: torch.dtype) -> list:
    """One decode token into every layer; what each update returned (as tensors)."""
    batch = cache.layers[0].k.window.shape[0] if cache.layers[0].k.window is not None else B
    k, v = _tokens(1, dtype, seed=999, batch=batch)
    return [t for i in range(len(cache.layers)) for t in map(_out, cache.update(k, v, i))]


def _assert_same_update(a: KiviCache, b: KiviCache, dtype: torch.dtype) -> None:
    ra, rb = _next_update(a, dtype), _next_update(b, dtype)
    assert all(_bits(x) == _bits(y) for x, y in zip(ra, rb))
    assert snapshot(a) == snapshot(b)


KINDS = ["fp32-fast", "bf16-sinks", "fp16-unquantized-keys", "packed-cpu"]
CASES = [(op, kind) for op in OPS for kind in KINDS
         # the edits of every layer do not depend on the backend, nor batch edits on the key format (time)
         if not (op.startswith("crop") and kind == "packed-cpu")
         and not (op in ("reorder", "select", "repeat") and kind in ("fp32-fast", "fp16-unquantized-keys"))]


def _case(i: int, op: str, kind: str):
    """Each operation with one kind in the default suite (kinds in turn), the rest marked slow (time)."""
    default = kind == [k for k in KINDS if (op, k) in CASES][i % len([k for k in KINDS if (op, k) in CASES])]
    return pytest.param(op, kind, id=f"{op}-{kind}", marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("op_name,kind", [_case(i, op, kind) for i, op in enumerate(OPS) for kind in KINDS
                                          if (op, kind) in CASES])
def test_a_failure_at_any_step_leaves_the_cache_as_it_was(kind, op_name, monkeypatch):
    base, dtype = _build(kind, SHORT if op_name == "crop-to-2" else LONG)
    before = snapshot(base)
    op = OPS[op_name]
    fired = []
    cache = copy.deepcopy(base)  # reused while failures leave it as it was (checked after each one)
    for fail_at in range(1, 10_000):
        inj = Injector(fail_at)
        with monkeypatch.context() as mp:
            _install(mp, inj)
            try:
                op(cache, dtype)
            except Injected:
                pass
        if inj.fired is None:  # the operation ran to completion: every step has been failed once
            break
        fired.append(inj.fired)
        assert snapshot(cache) == before, f"state changed after a failure at step {fail_at} ({inj.fired})"
        if fail_at % 7 == 1:  # the next update equals an untouched copy's (a sample of the steps: time)
            _assert_same_update(copy.deepcopy(cache), copy.deepcopy(base), dtype)
    assert len(fired) >= 10, fired  # the operation was really broken up into steps
    if op_name in ("decode-sliding", "chunk-40-sliding"):
        assert "BlockStore.evict" in fired and base.layers[1].k.store.start < cache.layers[1].k.store.start
        assert cache.layers[1].k.store.blocks[0] is None is not base.layers[1].k.store.blocks[0]  # freed
    # the operation, run without failure, does change the cache (so the comparisons above could fail)
    assert snapshot(cache) != before


def test_the_injector_reaches_the_quantizers_and_the_store():
    """The steps above include the quantizers, store writes, window concat, sink and flush arithmetic."""
    base, dtype = _build("bf16-sinks")
    names = set()
    for fail_at in range(1, 10_000):
        inj = Injector(fail_at)
        cache = copy.deepcopy(base)
        with pytest.MonkeyPatch.context() as mp:
            _install(mp, inj)
            try:
                _update(19, 0)(cache, dtype)
            except Injected:
                pass
        if inj.fired is None:
            break
        names.add(inj.fired)
    assert {"quantize_side", "BlockStore.append_in_place", "torch.cat", "window_exits",
            "SideState.flush", "Tensor.clone"} <= names, names


def test_a_crop_refused_by_a_sliding_layer_leaves_every_layer_as_it_was():
    """crop() runs over the layers in turn: the full layer before the sliding one must not be cropped."""
    cache, dtype = _build("fp32-fast")
    for _ in range(4):
        k, v = _tokens(40, dtype, seed=5)
        for i in range(3):
            cache.update(k, v, i)
    assert cache.layers[1].kv_offset > 0
    before = snapshot(cache)
    with pytest.raises(ValueError, match="sliding window"):
        cache.crop(-(cache.get_seq_length() - 1))
    assert snapshot(cache) == before


def test_a_failed_first_update_adds_no_layer_and_sets_no_dtype():
    cache = KiviCache(KiviConfig(**CFG))
    k, v = _tokens(20, torch.float32, seed=0)
    v[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.update(k, v, 0)
    assert len(cache.layers) == 0
    layer = KiviLayer(KiviConfig(**CFG))
    with pytest.raises(ValueError, match="NaN"):
        layer.update(k, v)
    assert not layer.is_initialized and layer.dtype is None
    layer.update(*_tokens(20, torch.bfloat16, seed=1))  # a later first update sets its own dtype
    assert layer.dtype == torch.bfloat16


def test_an_update_its_checks_refuse_leaves_the_cache_as_it_was():
    """Keys and values of different lengths, dtypes or a layer index past the layers: refused before any step."""
    cache, dtype = _build("bf16-sinks")
    before = snapshot(cache)
    k, v = _tokens(5, dtype, seed=3)
    for args, match in (((k, v[:, :, :4], 0), "tokens 5 vs 4"), ((k, v.float(), 1), "same dtype"),
                        ((k, v, 3), r"allowed 0\.\.2"), ((k, v, 10**6), "out of range")):
        with pytest.raises(ValueError, match=match):
            cache.update(*args)
        assert snapshot(cache) == before
    _assert_same_update(cache, copy.deepcopy(_build("bf16-sinks")[0]), dtype)
