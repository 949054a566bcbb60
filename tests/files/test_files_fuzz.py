"""Property tests of the one writer and the one reader: random file types behind random paths, random sizes,
endless streams. Runs in a few seconds (the examples are small; hypothesis' database is not needed)."""

from __future__ import annotations

import io
import os
import stat
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kivi.files import MissingFolderError, NotRegularFileError, TextReadError, read_text, write_bytes
from tests.files.paths import Endless, feed_fifo, leftovers, make, snapshot

#: What a user may point kivi at; "link:X" is a symlink to an X, "missing-folder" a path in a folder that
#: does not exist, "absent" a new file in an existing folder.
KINDS = ["absent", "regular", "directory", "fifo", "char", "block", "socket", "link:regular", "link:directory",
         "link:fifo", "link:char", "link:absent", "link:link:regular", "missing-folder"]
WRITABLE = {"absent", "regular", "link:regular", "link:link:regular"}
NAMES = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=40).filter(
    lambda s: s not in (".", "..") and len(s.encode()) < 200)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                database=None)


def _place(kind: str, path: Path) -> Path:
    """Make ``path`` a ``kind``; returns what a write must reach (the final regular file), if any."""
    if kind == "absent":
        return path
    if kind == "missing-folder":
        return path / "sub" / "file"
    if kind.startswith("link:"):
        target = path.with_name(path.name[:50] + ".target")
        _place(kind[5:], target)
        path.symlink_to(target)
        return path
    make(kind, path)
    return path


@FAST
@given(kind=st.sampled_from(KINDS), name=NAMES, data=st.binary(max_size=2048))
def test_the_writer_writes_regular_files_and_leaves_everything_else_alone(tmp_path, kind, name, data):
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        folder = Path(d)
        path = _place(kind, folder / name)
        before = {p.name: snapshot(p) for p in folder.iterdir()}
        try:
            written = write_bytes(path, data)
        except (NotRegularFileError, MissingFolderError) as e:
            assert kind not in WRITABLE, (kind, e)
            assert {p.name: snapshot(p) for p in folder.iterdir()} == before  # nothing changed, nothing added
        else:
            assert kind in WRITABLE, kind
            assert written.read_bytes() == data and stat.S_ISREG(os.lstat(written).st_mode)
            assert path.is_symlink() == kind.startswith("link:")
        assert leftovers(folder) == []


@FAST
@given(size=st.integers(0, 5000), bound=st.integers(0, 5000), source=st.sampled_from(["file", "stdin", "fifo"]))
def test_the_reader_returns_the_text_up_to_its_bound_and_refuses_more(tmp_path, size, bound, source):
    text = ("k\u00e9y " * size)[:size]
    raw = text.encode()
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        p = Path(d) / "t"
        if source == "file":
            p.write_bytes(raw)
        elif source == "fifo":
            make("fifo", p)
            feed_fifo(p, raw)
        try:
            got = read_text("-" if source == "stdin" else p, option="--text", max_bytes=bound,
                            stdin=io.BytesIO(raw))
        except TextReadError as e:
            assert len(raw) > bound and "--text" in str(e) and f"more than {bound:,} bytes" in str(e)
        else:
            assert len(raw) <= bound and got == text


@settings(max_examples=20, deadline=None, database=None)
@given(bound=st.integers(0, 3 * 2**20), byte=st.sampled_from([b"a", b"\x00", b"\xff"]))
def test_an_endless_stream_always_stops_at_its_bound(bound, byte):
    stream = Endless(byte)
    try:
        read_text("-", option="--prompt-file", max_bytes=bound, stdin=stream)
    except TextReadError as e:
        assert f"more than {bound:,} bytes" in str(e)
    assert stream.given == bound + 1  # never read past the bound's first byte
