from __future__ import annotations

import os

import pytest

from kivi.files import describe_mode
from tests.files.paths import make


@pytest.mark.parametrize("kind, words", [("regular", "a regular file"), ("directory", "a folder (directory)"),
                                         ("fifo", "a FIFO (named pipe)"), ("char", "a character device"),
                                         ("block", "a block device"), ("socket", "a socket")])
def test_each_kind_is_named(tmp_path, kind, words):
    assert describe_mode(os.lstat(make(kind, tmp_path / "x")).st_mode) == words


def test_a_symlink_is_named(tmp_path):
    (tmp_path / "l").symlink_to(tmp_path / "nowhere")
    assert describe_mode(os.lstat(tmp_path / "l").st_mode) == "a symlink"
