"""numba's cache files checked before they are trusted (kivi/numba_cache.py): unreadable ones set aside, one warning."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from kivi.optional import numba_available

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba cannot run here")

SOURCE = '''
import numba

@numba.njit(cache=True)
def twice(x):
    return 2 * x
'''


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A module with one ``cache=True`` function, compiled for int64 and float64 into a cache under ``tmp_path``."""
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "twice_mod.py").write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("twice_mod", tmp_path / "twice_mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.twice(3) == 6 and mod.twice(1.5) == 3.0
    return mod.twice


def _files(f):
    files = f._cache._cache_file
    index = files._index_path
    data = [files._data_path(name) for name in files._load_index().values()]
    return index, sorted(data)


def test_a_clean_cache_has_nothing_unreadable(cached):
    from kivi.numba_cache import set_aside_unreadable, unreadable_files

    assert len(_files(cached)[1]) == 2
    assert unreadable_files([cached]) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set_aside_unreadable([cached], "a test function") == []


@pytest.mark.parametrize("damage", ["truncate-data", "garble-data", "truncate-index", "empty-index"])
def test_an_unreadable_file_is_set_aside_once(cached, damage):
    from kivi.numba_cache import SET_ASIDE, set_aside_unreadable, unreadable_files

    index, data = _files(cached)
    path = index if damage.endswith("index") else data[0]
    raw = open(path, "rb").read()
    damaged = {"truncate-data": raw[: len(raw) // 2], "garble-data": b"\x80\x05garbage" + raw[10:],
               "truncate-index": raw[: len(raw) // 3], "empty-index": b""}[damage]
    with open(path, "wb") as f:
        f.write(damaged)
    assert unreadable_files([cached]) == [path]
    with pytest.warns(RuntimeWarning, match=r"a test function .* held 1 unreadable file\(s\) .*set aside") as rec:
        assert set_aside_unreadable([cached], "a test function") == [path]
    assert len(rec) == 1
    assert open(path + SET_ASIDE, "rb").read() == damaged
    with warnings.catch_warnings():  # set aside: nothing left to warn about
        warnings.simplefilter("error")
        assert set_aside_unreadable([cached], "a test function") == []
