"""Every place kivi writes a user-named path goes through the one writer: each refuses a FIFO and a device
node (left as they are), writes through a symlink to a regular file, and leaves no temporary file.

Written against the callers' public APIs only (no kivi.files import), so that each fails on code that
writes with ``Path.write_text`` / ``os.replace`` directly."""

from __future__ import annotations

import stat

import pytest

from tests.files.paths import leftovers, make, snapshot


def _save_cache(path):
    from kivi.cache.kivi_cache import KiviCache
    from kivi.config import KiviConfig

    KiviCache(KiviConfig()).save(path, fingerprint={})


def _config_json(path):
    from kivi.config import KiviConfig

    KiviConfig().to_json(path)


def _rows(suffix):
    def write(path):
        from kivi.eval.report import write_rows

        write_rows([{"name": "a", "ppl": 1.0, "config": {"k_bits": 2}}], path)

    return write


def _plot(path):
    pytest.importorskip("matplotlib")
    from kivi.eval.report import pareto_plot

    pareto_plot([{"name": "a", "kind": "kivi", "bits_per_element": 2.5, "delta_ppl_pct": 1.0}], path)


def _result_json(path):
    from kivi.cli.output import write_json_file

    write_json_file(str(path), {"ppl": 1.0})


WRITERS = {"prefix file": (_save_cache, ".kivi"), "KiviConfig.to_json": (_config_json, ".json"),
           "rows csv": (_rows(".csv"), ".csv"), "rows json": (_rows(".json"), ".json"),
           "pareto plot": (_plot, ".png"), "--output json": (_result_json, ".json")}


@pytest.mark.parametrize("kind", ["fifo", "char", "directory"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_each_writer_refuses_what_is_not_a_regular_file(tmp_path, writer, kind):
    write, suffix = WRITERS[writer]
    p = make(kind, tmp_path / f"out{suffix}")
    before = snapshot(p)
    with pytest.raises(OSError, match="not a regular file"):
        write(p)
    assert snapshot(p) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_each_writer_writes_through_a_symlink_to_a_regular_file(tmp_path, writer):
    write, suffix = WRITERS[writer]
    target = make("regular", tmp_path / f"real{suffix}")
    link = tmp_path / f"link{suffix}"
    link.symlink_to(target)
    write(link)
    assert stat.S_ISLNK(link.lstat().st_mode) and target.read_bytes() != b"old contents\n"
    assert leftovers(tmp_path) == []
