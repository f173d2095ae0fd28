"""passes/io/file_copy.py: byte-range copies between open files, in the kernel or through a buffer."""

from __future__ import annotations

import errno
import os

import pytest

import passes.io.file_copy
from passes.io.file_copy import copy_range, write_at


@pytest.fixture(params=["kernel", "buffer"])
def path_kind(request, monkeypatch):
    """Both ways a copy goes: copy_file_range, and the buffer used where the kernel refuses it."""
    if request.param == "buffer":

        def refused(*args):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refused)
    return request.param


def _open(tmp_path, data: bytes) -> tuple[int, int]:
    (tmp_path / "shard.bin").write_bytes(data)
    source = os.open(tmp_path / "shard.bin", os.O_RDONLY)
    target = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    return source, target


def test_copies_the_range_at_its_place(tmp_path, path_kind):
    data = bytes(range(256)) * 40
    source, target = _open(tmp_path, data)
    try:
        os.pwrite(target, b"head", 0)
        copy_range(source, 100, target, 4, 5000)
    finally:
        os.close(source)
        os.close(target)
    assert (tmp_path / "out.bin").read_bytes() == b"head" + data[100:5100]


def test_a_source_that_ends_early_names_its_file(tmp_path, path_kind):
    source, target = _open(tmp_path, b"x" * 1000)
    name = str(tmp_path / "shard.bin")
    try:
        with pytest.raises(OSError, match=r"shard\.bin: external data ends early \(at byte 1000"):
            copy_range(source, 900, target, 0, 200, name=name)
    finally:
        os.close(source)
        os.close(target)


def test_write_at_writes_everything_in_small_calls(tmp_path, monkeypatch):
    """write_at: every byte at its offset, no call above WRITE_BYTES (a 1 MB write got a 1 MB page-cache
    folio and was 10-15x slower per byte on the VM measured), a short write continued."""
    monkeypatch.setattr(passes.io.file_copy, "WRITE_BYTES", 1000)
    sizes: list[int] = []
    pwrite = os.pwrite

    def short(fd, data, offset):  # writes at most 700 bytes a call, as a kernel may
        sizes.append(len(data))
        return pwrite(fd, bytes(data[:700]), offset)

    monkeypatch.setattr(os, "pwrite", short)
    data = bytes(range(256)) * 20
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        write_at(fd, data, 3)
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == b"\0" * 3 + data
    assert max(sizes) == 1000 and len(sizes) == -(-len(data) // 700)
