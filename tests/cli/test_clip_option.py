"""--clip on the shared KIVI configuration options (kivi estimate / eval / generate / serve)."""

from __future__ import annotations

import argparse

import pytest

from kivi.cli.options import add_config_args, config_from_args


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_clip_flag_sets_the_field():
    assert _parse("--preset", "balanced", "--clip").clip is True
    assert _parse("--sink-tokens", "4", "--clip").clip is True
    assert _parse("--preset", "balanced").clip is False
    assert _parse("--clip", "values").clip == "values"
    assert _parse("--clip", "keys", "--k-bits", "4").clip == "keys"
    with pytest.raises(SystemExit):
        _parse("--clip", "mse")


def test_clip_with_config_file(tmp_path):
    from kivi import KiviConfig

    path = tmp_path / "c.json"
    KiviConfig(k_bits=4).to_json(path)
    cfg = _parse("--config", str(path), "--clip")
    assert cfg.clip is True and cfg.k_bits == 4


def test_clip_with_symmetric_is_refused():
    with pytest.raises(ValueError, match="clip=True is only implemented for asymmetric"):
        _parse("--symmetric", "--clip")
