"""The command line and the files a user names: a path that is not a regular file is one line (exit 2) and
stays as it is; an empty value is one line naming the option; an endless text input stops at its bound.

Most run in this process through ``kivi.cli.main`` (the same code path, fast); the reported cases
(``--save-prefix`` onto a device node, an endless pipe on ``--prompt-file -``) also in a subprocess."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kivi.cli import main
from tests.cli.test_cli_errors import env, one_line
from tests.files.paths import feed_fifo, leftovers, make, snapshot

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64", "--context", "1k"]


def _main(capsys, argv: list[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    return lines[0]


# ------------------------------------------------------------------------- group 1: what kivi writes
@pytest.mark.parametrize("kind, words", [("fifo", "a FIFO (named pipe)"), ("char", "a character device"),
                                         ("block", "a block device"), ("directory", "a folder (directory)")])
@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--save-prefix"],
    ["estimate", *SHAPE, "--cache-budget", "1MiB", "--write-config"],
    ["eval", "ppl", "-o"],
    ["sweep", "--plot"],
    ["tune", "--max-bits", "4", "--out"],
    ["demo", "--json-out"],
], ids=lambda a: a[0] + a[-1] if isinstance(a, list) else a)
def test_an_output_path_that_is_not_a_regular_file_is_one_line_and_untouched(capsys, tmp_path, argv, kind, words):
    p = make(kind, tmp_path / "out")
    before = snapshot(p)
    line = _main(capsys, [*argv, str(p)])
    assert argv[-1] in line and words in line and "not a regular file" in line, line
    assert snapshot(p) == before and leftovers(tmp_path) == []


def test_a_symlink_to_a_fifo_and_a_missing_folder_are_one_line(capsys, tmp_path):
    fifo = make("fifo", tmp_path / "fifo")
    (tmp_path / "link").symlink_to(fifo)
    line = _main(capsys, ["generate", "--prompt", "hi", "--save-prefix", str(tmp_path / "link")])
    assert "--save-prefix" in line and "is a symlink to a FIFO (named pipe)" in line
    line = _main(capsys, ["generate", "--prompt", "hi", "--save-prefix", str(tmp_path / "no" / "p.kivi")])
    assert "--save-prefix" in line and "does not exist (kivi creates no folders)" in line


def test_save_prefix_onto_a_device_node_in_a_subprocess(tmp_path):
    """The reported case (``--save-prefix /dev/null`` as root turned it into a file), on a node made in tmp_path."""
    node = make("char", tmp_path / "null")
    before = snapshot(node)
    p = subprocess.run([sys.executable, "-m", "kivi", "generate", "--prompt", "hi", "--save-prefix", str(node)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    one_line(p.returncode, p.stderr, "--save-prefix", "is a character device, not a regular file")
    assert snapshot(node) == before and leftovers(tmp_path) == []


# ------------------------------------------------------------------------- group 2: empty values
EMPTY = [
    ["generate", "--prompt", "hi", "--load-prefix", ""],
    ["generate", "--prompt", "hi", "--save-prefix", ""],
    ["generate", "--prompt", "hi", "--config", ""],
    ["generate", "--prompt", "hi", "--preset", ""],
    ["generate", "--prompt", "hi", "--attention-backend", ""],
    ["generate", "--prompt-file", ""],
    ["generate", "--prompt", "hi", "--model", ""],
    ["eval", "ppl", "--text", ""],
    ["eval", "ppl", "-o", ""],
    ["eval", "ppl", "--baseline", ""],
    ["eval", "passkey", "--presets", ""],
    ["sweep", "--plot", ""],
    ["sweep", "--csv", ""],
    ["sweep", "--configs", "a.json", ""],
    ["sweep", "--baselines", " "],
    ["tune", "--max-bits", "4", "--out", ""],
    ["tune", "--max-bits", "4", "--profile", ""],
    ["tune", "--max-bits", "4", "--candidates", ""],
    ["tune", "--max-ppl-increase", ""],
    ["profile", "--write-config", ""],
    ["demo", "--json-out", ""],
    ["demo", "--presets", ""],
    ["estimate", *SHAPE, "--write-config", ""],
    ["estimate", "--model", ""],
    ["estimate", *SHAPE, "--scale-dtype", ""],
    ["estimate", *SHAPE, "--sliding-layers", ""],
    ["estimate", *SHAPE, "--dtype", ""],
    ["serve", "--host", ""],  # '' would listen on every interface
    ["serve", "--served-model-name", " "],
]


@pytest.mark.parametrize("argv", EMPTY, ids=[" ".join(a[:2]) + " " + next(x for x in reversed(a) if x.startswith("-"))
                                            for a in EMPTY])
def test_an_empty_value_is_one_line_naming_the_option(capsys, argv):
    option = next(x for x in reversed(argv) if x.startswith("-"))
    line = _main(capsys, argv)
    assert f"argument {option}" in line or f"argument -o/{option}" in line or option in line, line
    assert "empty" in line, line


# ------------------------------------------------------------------------- group 4: bounded text inputs
def test_an_endless_fifo_as_eval_text_stops_at_the_bound(capsys, tmp_path):
    fifo = make("fifo", tmp_path / "text")
    writer = feed_fifo(fifo, None)
    line = _main(capsys, ["eval", "ppl", "--text", str(fifo), "--max-text-bytes", "256KiB"])
    assert "--text" in line and "more than 262,144 bytes" in line and "--max-text-bytes" in line, line
    writer.join(timeout=30)
    assert not writer.is_alive()


def test_an_endless_fifo_as_a_config_file_stops_at_the_bound(capsys, tmp_path):
    fifo = make("fifo", tmp_path / "cfg.json")
    writer = feed_fifo(fifo, None)
    line = _main(capsys, ["generate", "--prompt", "hi", "--config", str(fifo)])
    assert "--config" in line and "holds more than 67,108,864 bytes" in line, line
    writer.join(timeout=30)
    assert not writer.is_alive()


def test_an_endless_pipe_on_prompt_file_stdin_in_a_subprocess():
    """``yes | kivi generate --prompt-file -``: one line naming the option and the bound, exit 2."""
    p = subprocess.Popen([sys.executable, "-m", "kivi", "generate", "--prompt-file", "-", "--max-text-bytes",
                          "1MiB"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env=env())

    def feed():
        try:
            while True:
                p.stdin.write(b"y\n" * 32768)
        except (BrokenPipeError, ValueError, OSError):
            pass

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    one_line(p.returncode, err, "--prompt-file - (standard input)", "more than 1,048,576 bytes", "--max-text-bytes")


def test_prompt_file_within_the_bound_is_read(tmp_path):
    from kivi.cli.generate import read_prompt

    f = tmp_path / "p.txt"
    f.write_text("a prompt\r\n")
    ns = argparse.Namespace(prompt=None, prompt_file=str(f), max_text_bytes=100)
    assert read_prompt(ns) == "a prompt\n"
    ns.max_text_bytes = 5
    with pytest.raises(ValueError, match="--prompt-file .* holds more than 5 bytes"):
        read_prompt(ns)
