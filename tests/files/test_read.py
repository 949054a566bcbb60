"""kivi.files.read: the one text reader stops at its bound, whatever it reads from."""

from __future__ import annotations

import io
import os

import pytest

from kivi.files import DEFAULT_MAX_TEXT_BYTES, TextReadError, read_text
from tests.files.paths import Endless, feed_fifo, make


def test_a_file_is_read_and_its_line_endings_normalised(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("caf\u00e9\r\nline\rend\n".encode())
    assert read_text(p, option="--text") == "caf\u00e9\nline\nend\n"


def test_exactly_the_bound_is_read_one_more_byte_is_refused(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"x" * 100)
    assert read_text(p, option="--text", max_bytes=100) == "x" * 100
    with pytest.raises(TextReadError, match=r"--text '.*t.txt' holds more than 99 bytes .*; give a shorter text"):
        read_text(p, option="--text", max_bytes=99)


def test_a_huge_regular_file_is_refused_from_its_size(tmp_path):
    p = tmp_path / "sparse.txt"
    with open(p, "wb") as f:
        f.truncate(DEFAULT_MAX_TEXT_BYTES + 1)  # sparse: nothing is written or read
    with pytest.raises(TextReadError, match=r"more than 67,108,864 bytes \(64 MiB\).*raise the bound with --max"):
        read_text(p, option="--prompt-file", raise_bound="--max-text-bytes")


def test_an_endless_stdin_stops_at_the_bound():
    stream = Endless()
    with pytest.raises(TextReadError, match=r"--prompt-file - \(standard input\) holds more than 1,000 bytes"):
        read_text("-", option="--prompt-file", max_bytes=1000, stdin=stream)
    assert stream.given == 1001


def test_stdin_within_the_bound_and_not_utf8():
    assert read_text("-", option="--prompt-file", stdin=io.BytesIO(b"hello")) == "hello"
    with pytest.raises(TextReadError, match=r"--prompt-file - \(standard input\) is not UTF-8 text \(byte 0xe9 at "
                                            r"offset 3\)"):
        read_text("-", option="--prompt-file", stdin=io.BytesIO(b"caf\xe9"))


def test_an_endless_fifo_stops_at_the_bound(tmp_path):
    p = make("fifo", tmp_path / "pipe")
    writer = feed_fifo(p, None)
    with pytest.raises(TextReadError, match="holds more than 300,000 bytes"):
        read_text(p, option="--text", max_bytes=300_000)
    writer.join(timeout=30)
    assert not writer.is_alive()  # the writer saw the reader leave


def test_a_fifo_within_the_bound_is_read(tmp_path):
    p = make("fifo", tmp_path / "pipe")
    feed_fifo(p, b"short text")
    assert read_text(p, option="--text") == "short text"


def test_an_endless_device_stops_at_the_bound(tmp_path):
    """A node equal to /dev/zero's (1, 5), made in tmp_path: the reader that ran until memory ran out."""
    p = tmp_path / "zero"
    try:
        os.mknod(p, 0o600 | 0o020000, os.makedev(1, 5))
    except OSError as e:
        pytest.skip(f"mknod not permitted here: {e}")
    with pytest.raises(TextReadError, match="holds more than 4,096 bytes"):
        read_text(p, option="--prompt-file", max_bytes=4096)


def test_missing_folder_socket_not_utf8(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--text '.*nope.txt' does not exist"):
        read_text(tmp_path / "nope.txt", option="--text")
    with pytest.raises(TextReadError, match=r"cannot read --text '.*': it is a folder \(directory\), not a text file"):
        read_text(tmp_path, option="--text")
    with pytest.raises(TextReadError, match="it is a socket"):
        read_text(make("socket", tmp_path / "s"), option="--text")
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(TextReadError, match=r"not UTF-8 text \(byte 0xff at offset 0\)"):
        read_text(tmp_path / "bin", option="--text")
