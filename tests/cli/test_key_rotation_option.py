"""--key-rotation on the shared KIVI configuration options (kivi estimate / eval / generate / serve)."""

from __future__ import annotations

import argparse

import pytest

from kivi.cli.errors import CliError
from kivi.cli.options import add_config_args, config_from_args


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_key_rotation_flag_sets_the_field(tmp_path):
    from kivi import KiviConfig

    assert _parse("--preset", "extreme", "--key-rotation", "hadamard").key_rotation == "hadamard"
    assert _parse("--preset", "extreme").key_rotation == "none"
    path = tmp_path / "c.json"
    KiviConfig(k_bits=4).to_json(path)
    cfg = _parse("--config", str(path), "--key-rotation", "hadamard")
    assert cfg.key_rotation == "hadamard" and cfg.k_bits == 4
    with pytest.raises(SystemExit):
        _parse("--key-rotation", "random")


def test_a_packed_backend_with_rotation_is_one_line_before_the_model_loads():
    want = (r"--attention-backend cpu: attention_backend='cpu' does not implement key_rotation='hadamard'.*"
            r"use 'reference' \(the kivi command line runs models on the CPU\)$")
    with pytest.raises(CliError, match=want):
        _parse("--key-rotation", "hadamard", "--attention-backend", "cpu")
    assert _parse("--key-rotation", "hadamard", "--attention-backend", "reference").attention_backend == "reference"
