"""Saved prefix files as untrusted input (kivi/cache/persist_checks.py): forged headers, tensor tables and
values, with every checksum recomputed (a checksum is not a signature).

Every mutation of a small saved prefix either loads the very state that was saved or raises
``PrefixFileError``, never another exception, and no load asks torch for more than about the file's size.
The default suite loads every ``SAMPLE``-th forged file of each kind (each kind from its own offset, every
family of mutation represented); the ``slow`` run (KIVI_SLOW=1) loads all of them, about 4,400 per kind.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
import time
from pathlib import Path

import pytest
import torch

from kivi.cache.kivi_cache import KiviCache
from kivi.cache.persist import PrefixFileError
from kivi.prefix import model_fingerprint, prefill
from tests.cache.test_persist import _config, _decode, _ids, _model, _same_state


# ---------------------------------------------------------------------------------------------- file surgery
def read_parts(path: Path) -> tuple[dict, dict, bytes]:
    """``(safetensors header, kivi_meta, payload)`` of a prefix file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["kivi_meta"]), data[8 + n :]


def write_parts(path: Path, header: dict, meta: dict, payload: bytes, resum: bool = True) -> None:
    """Write a prefix file back with its checksums recomputed, as a forger would (``resum``: every tensor's too)."""
    header = copy.deepcopy(header)
    if resum and isinstance(meta.get("tensor_sha256"), dict):
        for name, info in header.items():
            offsets = info.get("data_offsets") if isinstance(info, dict) else None
            if name in meta["tensor_sha256"] and isinstance(offsets, list) and all(isinstance(o, int) for o in offsets):
                meta["tensor_sha256"][name] = hashlib.sha256(payload[offsets[0] : offsets[1]]).hexdigest()
    text = json.dumps(meta, sort_keys=True)
    header["__metadata__"]["kivi_meta"] = text
    header["__metadata__"]["kivi_meta_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def _leaves(obj, path=()):
    """``(path, value)`` of every leaf of a JSON tree: dicts and lists of dicts walked into, every other list
    a leaf; the template's ``fields`` are left to :func:`meta_mutations`."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k != "fields":
                yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()


def _variants(value):
    """Forged replacements for one metadata value: off by one, huge, negative, wrong types, missing."""
    out = [_DELETE, None, "x", 1.5, [1], {"a": 1}]
    if isinstance(value, bool):
        out += [not value, 0, 1, "true"]
    elif isinstance(value, int):
        out += [value + 1, value - 1, 0, -1, value * 100, 2 * 10**8, 10**12, 1e12, float(value), str(value), True]
    elif isinstance(value, list):
        out += [[], value + value[-1:], value[:-1], [v * 100 if isinstance(v, int) else v for v in value],
                [2 * 10**8] * len(value), [10**12] * len(value), [-1] * len(value), ["x"] * len(value), value * 100]
    elif isinstance(value, str):
        out += ["complex64", "", "float16", "int32", 5]
    elif value is None:
        out += [0, 1, 64, "float32", False]
    return out


#: Metadata a file may state freely: another valid state that loads (not a forgery the loader can see). So
#: are its config and sliding windows when the caller gives no model (the cache is what the file says it is).
FREE = {("versions",), ("cache", "layers", 0, "due"), ("cache", "layers", 1, "due")}


def meta_mutations(meta):
    """Every forged variant of every field of ``kivi_meta``'s cache, config, fingerprint and checksum table."""
    for key in ("cache", "config", "fingerprint", "tensor_sha256", "versions"):
        yield f"del {key}", (key,), _DELETE
    for top in ("cache", "config"):
        for path, value in _leaves(meta[top], (top,)):
            for i, variant in enumerate(_variants(value)):
                shown = "<del>" if variant is _DELETE else repr(variant)[:20]
                yield f"{'.'.join(map(str, path))}={shown}#{i}", path, variant
    for label in ("k", "v"):
        for where in _template_paths(meta["cache"]["layers"][0]["parts"][0][label]["store"],
                                     ("cache", "layers", 0, "parts", 0, label, "store")):
            tm = meta
            for k in where:
                tm = tm[k]
            for field in tm["fields"]:
                for key, value in (("dtype", "int32"), ("dtype", "complex64"),
                                   ("shape", [1, 2]), ("shape", [1, 2, 99])):
                    yield f"template {'.'.join(map(str, where[3:]))}.{field}.{key}={value}", (
                        *where, "fields", field, key), value
            yield f"template {'.'.join(map(str, where[3:]))} extra field", (*where, "fields", "zz"), \
                {"dtype": "uint8", "shape": [1, 2, 4]}


def _template_paths(store, where):
    """Paths of a side's store templates (one per tier store with position tiers) that hold a format."""
    stores = (
        [(st, (*where, "tiers", j)) for j, st in enumerate(store["tiers"])] if "tiers" in store else [(store, where)]
    )
    return [(*w, "template") for st, w in stores if st["template"] is not None]


def table_mutations(header):
    """Forged tensor tables: other dtypes and shapes of the same byte count, inconsistent offsets, tensors
    dropped or added."""
    names = sorted(k for k in header if k != "__metadata__")
    for name in names:
        info = header[name]
        nbytes = info["data_offsets"][1] - info["data_offsets"][0]
        for dtype in ("F32", "I32", "F16", "BF16", "U8", "I64", "BOOL", "F64", "C64"):
            if dtype != info["dtype"]:
                yield f"{name} dtype {dtype}", name, {**info, "dtype": dtype}
        shape = info["shape"]
        for i in range(len(shape)):  # same bytes, other shape: one axis doubled, another halved
            for j in range(len(shape)):
                if i != j and shape[j] % 2 == 0:
                    s = list(shape)
                    s[i], s[j] = s[i] * 2, s[j] // 2
                    yield f"{name} shape {s}", name, {**info, "shape": s}
        yield f"{name} shape +1", name, {**info, "shape": [*shape[:-1], shape[-1] + 1]}
        yield f"{name} shape flat", name, {**info, "shape": [max(1, nbytes)] if info["dtype"] == "U8" else [0]}
        yield f"{name} shape huge", name, {**info, "shape": [10**12, *shape[1:]]}
        yield f"{name} shape negative", name, {**info, "shape": [-1, *shape[1:]]}
        lo, hi = info["data_offsets"]
        yield f"{name} offsets shifted", name, {**info, "data_offsets": [lo + 1, hi + 1]}
        yield f"{name} offsets reversed", name, {**info, "data_offsets": [hi, lo]}
        yield f"{name} offsets huge", name, {**info, "data_offsets": [lo, 10**12]}
        yield f"{name} offsets text", name, {**info, "data_offsets": ["0", "4"]}
        yield f"{name} dropped", name, None
    yield "extra tensor", "zz.extra", {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}


def value_mutations(header, payload):
    """Non-finite floats, non-boolean mask bytes, out-of-range token ids (checksums recomputed)."""
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        lo, hi = info["data_offsets"]
        if hi == lo:
            continue
        if info["dtype"] in ("F32", "F16", "BF16", "F64"):
            dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}[
                info["dtype"]
            ]
            for bad in (float("nan"), float("inf"), -float("inf")):
                t = torch.frombuffer(bytearray(payload[lo:hi]), dtype=dt).clone()
                t[: min(100, t.numel())] = bad
                yield f"{name} {bad}", lo, t.view(torch.uint8).numpy().tobytes()
        elif info["dtype"] == "BOOL":
            yield f"{name} byte 2", lo, bytes([2]) + payload[lo + 1 : hi]
        elif name == "input_ids":
            t = torch.frombuffer(bytearray(payload[lo:hi]), dtype=torch.int64).clone()
            for bad in (-1, 128, 2**40):
                u = t.clone()
                u[0] = bad
                yield f"input_ids {bad}", lo, u.view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------- the run
class AllocationRecorder:
    """Total bytes requested from torch.zeros / torch.empty while active (what a load allocates)."""

    LIMIT = 1 << 30

    def __init__(self, monkeypatch):
        self.total = 0
        for fname in ("zeros", "empty"):
            real = getattr(torch, fname)

            def wrapped(*shape, real=real, **kw):
                dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
                n = 1
                for d in dims:
                    n *= int(d)
                self.total += n * real((), dtype=kw.get("dtype") or torch.float32).element_size()
                if self.total > self.LIMIT:  # recorded; not attempted (a forged size must not eat the machine)
                    raise MemoryError(f"refused by the test: {self.total} bytes requested")
                return real(*shape, **kw)

            monkeypatch.setattr(torch, fname, wrapped)


def _base(tmp_path, kind):
    """A small saved prefix of each kind: sinks + several blocks + ids; a padded batch (masks); sliding layers."""
    if kind == "sinks-blocks-ids":
        model = _model("llama-gqa", _config(2, 4, 4, "cpu"))
        ids = _ids(157)
        cache = prefill(model, ids[:, :100])
        for s in range(100, 157, 19):
            _decode(model, cache, ids[:, s : s + 19], 1)
        save_ids = ids
    elif kind == "padded-batch":
        model = _model("llama-gqa", _config(2, 2, 0, "reference"))
        ids = _ids(90, batch=2)
        mask = torch.ones_like(ids)
        mask[1, :40] = 0  # left padding reaching into stored keys: stored_valid and window_valid
        cache = KiviCache.from_model(model)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        save_ids = None
    elif kind in ("tiers", "per-head"):  # tier stores of several widths; head groups of their own widths
        extra = (dict(tiers=[(32, None), (32, 8), (48, 4), (None, 2)], k_bits=8, v_bits=8) if kind == "tiers" else
                 dict(head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 3]}}))
        model = _model("llama-gqa", _config(sink_tokens=4, backend="cpu", **{"k_bits": 2, "v_bits": 2, **extra}))
        ids = _ids(160)
        cache = prefill(model, ids[:, :90])
        _decode(model, cache, ids[:, 90:], 30)
        layer = cache.layers[0]
        assert len(layer.parts[0].k.chain) == 3 if kind == "tiers" else len(layer.parts) == 2
        save_ids = None
    else:
        model = _model("mistral-sliding", _config(2, 2, 0, "cpu"))
        ids = _ids(240)
        cache = prefill(model, ids[:, :60])
        for s in range(60, 240, 30):
            _decode(model, cache, ids[:, s : s + 30], 1)
        assert any(blk is None for blk in cache.layers[0].k.store.blocks)
        save_ids = ids
    fp = model_fingerprint(model)
    path = tmp_path / f"{kind}.kivi"
    cache.save(path, fingerprint=fp, input_ids=save_ids)
    return model, fp, path


KINDS = ["sinks-blocks-ids", "padded-batch", "sliding", "tiers", "per-head"]
SAMPLE = 6  # the default suite's stride through each kind's forged files


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sampled", "all"])
@pytest.mark.parametrize("kind", KINDS)
def test_forged_files_load_exactly_or_raise_prefix_error(tmp_path, monkeypatch, kind, full):
    model, fp, path = _base(tmp_path, kind)
    want = KiviCache.load(path, fingerprint=fp, model=model)
    header, meta, payload = read_parts(path)
    size = path.stat().st_size
    forged = tmp_path / "forged.kivi"
    cases = []
    for label, key, variant in meta_mutations(meta):
        m = copy.deepcopy(meta)
        try:
            _set(m, key, variant)
        except (KeyError, IndexError, TypeError):
            continue
        own = key[0] == "config" or key[-1:] == ("sliding_window",)  # what the file says the cache is
        free = "own" if own else "due" if key in FREE else key[:1] == ("versions",)
        cases.append(("meta", label, header, m, payload, free))
    for label, name, entry in table_mutations(header):
        h = copy.deepcopy(header)
        if entry is None:
            del h[name]
        else:
            h[name] = entry
        cases.append(("table", label, h, copy.deepcopy(meta), payload, False))
    for label, lo, data in value_mutations(header, payload):
        cases.append(("value", label, header, copy.deepcopy(meta), payload[:lo] + data + payload[lo + len(data):],
                      False))

    assert len(cases) > 300  # the forgeries are generated in full either way
    picked = cases if full else cases[KINDS.index(kind) % SAMPLE :: SAMPLE]
    assert {c[0] for c in picked} == {"meta", "table", "value"}  # every family of forgery is loaded
    failures, loaded, t0 = [], 0, time.perf_counter()
    for _, label, h, m, p, free in picked:
        write_parts(forged, h, m, p)
        for with_model in (True, False):  # the model's config and shape, or only the file's own
            rec = AllocationRecorder(monkeypatch)
            try:
                got = (KiviCache.load(forged, fingerprint=fp, model=model) if with_model
                       else KiviCache.load(forged, fingerprint=fp))
            except PrefixFileError as e:
                msg = str(e)
                if "\n" in msg or str(forged) not in msg:
                    failures.append(f"{label}: message not one line naming the file: {msg!r}")
            except Exception as e:  # noqa: BLE001 - what the test is about
                failures.append(f"{label} (model={with_model}): {type(e).__name__}: {str(e)[:160]}")
            else:
                loaded += 1
                try:
                    if free == "due":  # another valid state: the same tensors, tokens due to move or not
                        assert got.nbytes == want.nbytes
                    elif free != "own" or with_model:  # else the file's own config / windows: another valid cache
                        _same_state(want, got)
                    if not free:
                        assert [la.due for la in got.layers] == [la.due for la in want.layers]
                except Exception as e:  # noqa: BLE001 - an assertion, or a state the comparison cannot even read
                    failures.append(f"{label} (model={with_model}): loaded a different state ({type(e).__name__})")
            finally:
                monkeypatch.undo()
            if rec.total > 2 * size + (64 << 10):
                failures.append(f"{label} (model={with_model}): asked torch for {rec.total} bytes, file {size}")
    elapsed = time.perf_counter() - t0
    print(f"{kind}: {len(picked)} of {len(cases)} forged files x 2 loads in {elapsed:.1f} s, {loaded} loads succeeded")
    assert not failures, f"{len(failures)} of {2 * len(picked)} loads:\n" + "\n".join(failures[:40])
    assert loaded > 0  # some forgeries are other valid states, and those were compared


# ---------------------------------------------------------------------------------------------- named forgeries
@pytest.fixture
def forge(tmp_path):
    """``(model, fingerprint, path, forge(fn) -> message)``: ``fn(header, meta, payload) -> payload`` edits a
    copy of a saved prefix (checksums recomputed); the load with the model must raise; its message is returned."""
    model, fp, path = _base(tmp_path, "sinks-blocks-ids")

    def run(fn):
        header, meta, payload = read_parts(path)
        payload = fn(header, meta, payload) or payload
        out = tmp_path / "forged.kivi"
        write_parts(out, header, meta, payload)
        with pytest.raises(PrefixFileError) as e:
            KiviCache.load(out, fingerprint=fp, model=model)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{out}: ")
        return str(e.value).removeprefix(f"{out}: ")

    return model, fp, path, run


def _store(meta, layer=0, side="k"):
    return meta["cache"]["layers"][layer]["parts"][0][side]["store"]


@pytest.mark.parametrize("caps", [lambda c: c * 100, lambda c: 2 * 10**8, lambda c: 10**12, lambda c: 1e12],
                         ids=["x100", "2e8", "1e12", "1e12-float"])
def test_forged_block_capacity_is_refused_before_allocating(forge, monkeypatch, caps):
    *_, run = forge
    rec = AllocationRecorder(monkeypatch)

    def edit(h, meta, p):
        st = _store(meta)
        st["caps"] = [*st["caps"][:-1], caps(st["caps"][-1])]

    msg = run(edit)
    assert msg.startswith("layer0.parts.0.k.store.caps")
    assert (", expected 64 (the last block holds" in msg) or "expected a list of integers" in msg
    assert rec.total < 1 << 20  # nothing of the claimed size was asked for


def test_forged_tensor_table_is_refused(forge):
    *_, run = forge

    def window_i32(h, meta, p):
        for name in h:
            if name.endswith(".window"):
                h[name]["dtype"] = "I32"

    assert run(window_i32).startswith("tensor layer0.parts.0.k.window: found int32 [1, 2, 41, 32], expected float32 "
                                      "[1, 2, 41, 32]")

    def window_shape(h, meta, p):
        s = h["layer1.parts.0.v.window"]["shape"]
        h["layer1.parts.0.v.window"]["shape"] = [s[0], s[1], s[2] * 2, s[3] // 2]

    assert run(window_shape) == ("tensor layer1.parts.0.v.window: found float32 [1, 2, 64, 16], expected float32 "
                                 "[1, 2, 32, 32]")

    def ids_shape(h, meta, p):
        h["input_ids"]["shape"] = [157, 1]

    assert run(ids_shape) == "tensor input_ids: found int64 [157, 1], expected int64 [1, 157]"


def test_forged_metadata_is_refused(forge):
    *_, run = forge
    assert run(lambda h, meta, p: meta.pop("cache") and None) == "metadata field cache is missing"

    def complex_dtype(h, meta, p):
        meta["cache"]["layers"][0]["dtype"] = "complex64"

    assert run(complex_dtype).startswith("cache.layers[0].dtype: found 'complex64', expected one of")

    def bits(h, meta, p):
        _store(meta, 1, "v")["template"]["bits"] = 3

    assert run(bits) == "layer1.parts.0.v.store.template.bits: found 3, expected 4"

    def nan_window(h, meta, p):
        lo, hi = h["layer0.parts.0.v.window"]["data_offsets"]
        t = torch.frombuffer(bytearray(p[lo:hi]), dtype=torch.float32).clone()
        t[:100] = float("nan")
        return p[:lo] + t.numpy().tobytes() + p[hi:]

    assert run(nan_window) == "tensor layer0.parts.0.v.window: found 100 non-finite values, expected finite values only"


def test_cropped_and_past_recording_caches_round_trip(tmp_path):
    """States off the plain schedule: a crop into a long first block (saved with the capacity a fresh append
    gives, so the loaded block is smaller), and a window holding tokens due to move (past recording)."""
    model = _model("llama-gqa", _config(2, 2, 4, "cpu"))
    ids = _ids(150)
    cache = prefill(model, ids)
    assert cache.layers[0].k.store.caps == [112]
    cache.crop(-70)  # keys back into the window from inside the 112-token block
    fp = model_fingerprint(model)
    cache.save(tmp_path / "crop.kivi", fingerprint=fp)
    loaded = KiviCache.load(tmp_path / "crop.kivi", fingerprint=fp, model=model)
    assert [la.k.store.caps for la in loaded.layers] == [[64], [64]] and cache.layers[0].k.store.caps == [112]
    for a, b in zip(cache.layers, loaded.layers):
        for sa, sb in ((a.k, b.k), (a.v, b.v)):
            for t, u in ((sa.window, sb.window), (sa.sink, sb.sink)):
                assert (t is None and u is None) or torch.equal(t, u)
            assert all(torch.equal(x.tensors()[f], y.tensors()[f]) for (_, x), (_, y)
                       in zip(sa.store.iter_blocks(), sb.store.iter_blocks()) for f in x.tensors())
    q = _ids(3, seed=7)
    want, got = _decode(model, cache, q, 30), _decode(model, loaded, q, 30)
    assert torch.equal(want.argmax(-1), got.argmax(-1)) and torch.allclose(want, got, atol=1e-5)

    cache = prefill(model, ids[:, :100])
    for layer in cache.layers:
        layer.activate_past_recording()
    _decode(model, cache, ids[:, 100:140], 1)
    assert all(layer.due for layer in cache.layers)
    cache.save(tmp_path / "due.kivi", fingerprint=fp)
    loaded = KiviCache.load(tmp_path / "due.kivi", fingerprint=fp, model=model)
    _same_state(cache, loaded)
    assert [la.due for la in loaded.layers] == [True, True]


def test_unused_capacity_beyond_the_file_is_refused_before_allocating(tmp_path, monkeypatch):
    """A file whose blocks' unused tails would allocate more than the file's size (or the fixed allowance,
    lowered here so a small cache shows it): refused, nothing of that size asked for."""
    import dataclasses

    import kivi.cache.persist_checks as checks

    cfg = dataclasses.replace(_config(2, 2, 0, "cpu"), block_size=4096)
    model = _model("llama-gqa", cfg)
    cache = prefill(model, _ids(150))
    fp = model_fingerprint(model)
    cache.save(tmp_path / "p.kivi", fingerprint=fp)
    assert KiviCache.load(tmp_path / "p.kivi", fingerprint=fp, model=model).nbytes == cache.nbytes
    monkeypatch.setattr(checks, "TAIL_ALLOWANCE_BYTES", 64 << 10)
    rec = AllocationRecorder(monkeypatch)
    with pytest.raises(PrefixFileError, match=r"unused block capacity: found \d+ bytes, expected at most \d+ bytes "
                                              r"beyond the file's \d+ bytes of tensors$"):
        KiviCache.load(tmp_path / "p.kivi", fingerprint=fp, model=model)
    assert rec.total < cache.nbytes // 4
