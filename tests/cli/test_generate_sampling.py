"""`kivi generate --do-sample --temperature T`: a temperature below kivi.sampling.GREEDY_BELOW is greedy (the
rule kivi serve and generate_batch share), on a tiny saved model, in process."""

from __future__ import annotations

import json

import pytest

from kivi.cli import main
from tests.cli.test_generate_budget import tiny_folder  # noqa: F401 - the tiny saved model fixture


def _tokens(folder, capsys, *extra) -> list[int]:
    rc = main(["generate", "--model", str(folder), "--prompt", "hello world kivi cache", "--raw",
               "--max-new-tokens", "8", "--json", *extra])
    out, _ = capsys.readouterr()
    assert rc == 0
    return json.loads(out)["tokens"]


@pytest.mark.parametrize("temperature", ["1e-300", "5e-324", "1e-40"])
def test_a_tiny_temperature_is_greedy(tiny_folder, capsys, temperature):  # noqa: F811
    greedy = _tokens(tiny_folder, capsys)
    assert _tokens(tiny_folder, capsys, "--do-sample", "--temperature", temperature) == greedy
