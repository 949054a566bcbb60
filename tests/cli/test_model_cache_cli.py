"""`kivi cache ls|verify|clear` on a temporary cache root (KIVI_CACHE_DIR) with fake converted copies."""

from __future__ import annotations

import json

import pytest

from kivi.cli import main
from kivi.models.conversion_cache import CONVERTED_MARKER, gguf_sha256
from kivi.models.copy_manifest import record_files


@pytest.fixture()
def cache(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    monkeypatch.setenv("KIVI_CACHE_DIR", str(root))
    models = root / "models"
    live, gone = tmp_path / "live.gguf", tmp_path / "gone.gguf"
    live.write_bytes(b"GGUF live")
    for name, src in (("live-aaaa", live), ("gone-bbbb", gone)):
        (models / name).mkdir(parents=True)
        (models / name / "config.json").write_text("{}")
        (models / name / "model.safetensors").write_bytes(bytes(4096))
        sha = gguf_sha256(live, root) if src == live else "0" * 64
        (models / name / CONVERTED_MARKER).write_text(json.dumps(
            {"source": str(src), "sha256": sha, "files": record_files(models / name)}))
    return models


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls_lists_path_size_source_last_use(cache, capsys):
    rc, out, _ = run(capsys, "cache", "ls", "--json")
    assert rc == 0
    d = json.loads(out)
    by = {c["key"]: c for c in d["copies"]}
    assert set(by) == {"live-aaaa", "gone-bbbb"} and d["root"] == str(cache)
    assert by["live-aaaa"]["stale"] is None and by["live-aaaa"]["bytes"] > 4096 and by["live-aaaa"]["last_used"] > 0
    assert by["live-aaaa"]["source"].endswith("live.gguf") and by["live-aaaa"]["path"] == str(cache / "live-aaaa")
    assert "gone" in by["gone-bbbb"]["stale"]
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0 and "live-aaaa" in out and "STALE" in out and "on disk" in out


def test_clear_stale_then_key_then_all(cache, capsys):
    rc, out, _ = run(capsys, "cache", "clear")  # no argument: the stale ones only
    assert rc == 0 and "removed gone-bbbb" in out and (cache / "live-aaaa").is_dir()
    assert not (cache / "gone-bbbb").exists()
    rc, _, err = run(capsys, "cache", "clear", "nope")
    assert rc == 2 and "no converted copy 'nope'" in err and (cache / "live-aaaa").is_dir()
    rc, _, err = run(capsys, "cache", "clear", "--all", "live-aaaa")
    assert rc == 2 and "not both" in err
    rc, out, _ = run(capsys, "cache", "clear", "live-aaaa", "--json")
    assert rc == 0 and [c["key"] for c in json.loads(out)["removed"]] == ["live-aaaa"]
    assert not any(p.is_dir() for p in cache.iterdir())
    rc, out, _ = run(capsys, "cache", "clear", "--all")
    assert rc == 0 and "0 copies" in out


def test_ls_of_an_empty_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KIVI_CACHE_DIR", str(tmp_path / "empty"))
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0 and "no converted models" in out


def test_ls_verify_and_clear_name_a_damaged_copy(cache, capsys):
    weights = cache / "live-aaaa" / "model.safetensors"
    rc, out, _ = run(capsys, "cache", "verify")
    assert rc == 0 and "2 copies checked" in out and "0 damaged" in out
    weights.write_bytes(b"\1" + bytes(4095))  # the same size: only the full hash (verify) sees it...
    rc, out, _ = run(capsys, "cache", "verify", "--json")
    d = json.loads(out)
    assert rc == 1 and d["damaged"] == ["live-aaaa"] and "model.safetensors" in \
        {c["key"]: c["damaged"] for c in d["copies"]}["live-aaaa"]
    rc, _, err = run(capsys, "cache", "verify", "nope")
    assert rc == 2 and "no converted copy 'nope'" in err
    weights.write_bytes(bytes(100))  # ...a truncated file every check sees
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0 and "live-aaaa" in out and "DAMAGED: model.safetensors has 100 bytes, 4,096 were written" in out
    rc, out, _ = run(capsys, "cache", "ls", "--json")
    assert "truncated" in {c["key"]: c["damaged"] for c in json.loads(out)["copies"]}["live-aaaa"]
    rc, out, _ = run(capsys, "cache", "clear")  # the stale and the damaged ones
    assert rc == 0 and "removed live-aaaa" in out and "removed gone-bbbb" in out
    assert not any(p.is_dir() for p in cache.iterdir())
