"""kivi.files.write: the one writer creates or atomically replaces regular files and refuses everything else."""

from __future__ import annotations

import os
import re
import stat

import pytest

from kivi.files import MissingFolderError, NotRegularFileError, check_write_target, write_bytes, write_file, write_text
from tests.files.paths import leftovers, make, snapshot


def test_a_new_file_gets_open_s_mode(tmp_path):
    old = os.umask(0o027)
    try:
        p = write_text(tmp_path / "new.json", "{}\n")
    finally:
        os.umask(old)
    assert p.read_text() == "{}\n" and stat.S_IMODE(os.stat(p).st_mode) == 0o640
    assert leftovers(tmp_path) == []


def test_a_regular_file_is_replaced_keeping_its_mode(tmp_path):
    p = make("regular", tmp_path / "r.txt")
    os.chmod(p, 0o604)
    ino = os.stat(p).st_ino
    write_bytes(p, b"new")
    assert p.read_bytes() == b"new" and stat.S_IMODE(os.stat(p).st_mode) == 0o604
    assert os.stat(p).st_ino != ino  # a new inode renamed over it: readers see old or new, never half
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind, words", [("directory", "a folder (directory)"), ("fifo", "a FIFO (named pipe)"),
                                         ("char", "a character device"), ("block", "a block device"),
                                         ("socket", "a socket")])
def test_what_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, kind, words):
    p = make(kind, tmp_path / "target")
    before = snapshot(p)
    with pytest.raises(NotRegularFileError, match=re.escape(f"is {words}, not a regular file")) as info:
        write_text(p, "data")
    assert isinstance(info.value, OSError) and str(p) in str(info.value)
    assert snapshot(p) == before and leftovers(tmp_path) == []


def test_a_symlink_to_a_regular_file_is_followed(tmp_path):
    target = make("regular", tmp_path / "real.txt")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert write_text(link, "through the link") == target
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "through the link" and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["directory", "fifo", "char", "block", "socket"])
def test_a_symlink_to_anything_else_is_refused(tmp_path, kind):
    target = make(kind, tmp_path / "node")
    link = tmp_path / "link"
    link.symlink_to(target)
    before, before_link = snapshot(target), snapshot(link)
    with pytest.raises(NotRegularFileError, match="is a symlink to a"):
        write_text(link, "data")
    assert snapshot(target) == before and snapshot(link) == before_link and leftovers(tmp_path) == []


def test_dangling_and_looping_symlinks_are_refused(tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(NotRegularFileError, match="symlink to a missing file"):
        write_text(dangling, "x")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(NotRegularFileError, match="cannot be followed"):
        write_text(loop, "x")
    assert not (tmp_path / "nowhere").exists() and dangling.is_symlink() and loop.is_symlink()


def test_a_missing_folder_is_an_error_and_not_created(tmp_path):
    with pytest.raises(MissingFolderError, match=r"the folder '.*/no' does not exist \(kivi creates no folders\)"):
        write_text(tmp_path / "no" / "x.json", "x")
    assert not (tmp_path / "no").exists()
    make("regular", tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        write_text(tmp_path / "file" / "x.json", "x")


def test_an_empty_path_is_refused():
    with pytest.raises(ValueError, match="empty"):
        check_write_target("")


@pytest.mark.parametrize("error", [ValueError("failed half way"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failed_fill_leaves_no_temporary_file_and_the_old_file(tmp_path, error):
    p = make("regular", tmp_path / "r.txt")

    def fill(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise error

    with pytest.raises(type(error)):
        write_file(p, fill)
    assert p.read_bytes() == b"old contents\n" and leftovers(tmp_path) == []


def test_a_path_that_becomes_a_fifo_while_writing_is_not_replaced(tmp_path):
    p = tmp_path / "r.txt"

    def fill(tmp):
        with open(tmp, "wb") as f:
            f.write(b"new")
        os.mkfifo(p)  # someone puts a FIFO there meanwhile

    with pytest.raises(NotRegularFileError, match="FIFO"):
        write_file(p, fill)
    assert stat.S_ISFIFO(os.lstat(p).st_mode) and leftovers(tmp_path) == []
