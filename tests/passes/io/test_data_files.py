"""Data file names and the packing of tensors into files of at most N bytes."""

from __future__ import annotations

import pytest

from passes.io.data_files import data_file_names, data_files, pack


@pytest.mark.parametrize(
    ("sizes", "limit", "files"),
    [
        ([5, 5, 5], None, [[0, 1, 2]]),  # no limit: one file
        ([5, 5, 5], 0, [[0, 1, 2]]),
        ([5, 5, 5], 10, [[0, 1], [2]]),  # in order, a new file when the next would pass the limit
        ([5, 5, 5], 9, [[0], [1], [2]]),
        ([3, 20, 3, 3], 10, [[0], [1], [2, 3]]),  # a tensor above the limit gets a file of its own
        ([20], 10, [[0]]),
        ([], 10, [[]]),  # no tensors: one (empty) file, as for a model whose weights all stay inline
    ],
)
def test_pack(sizes, limit, files):
    assert pack(sizes, limit) == files


def test_names():
    assert data_file_names("m.onnx", 1) == ["m.onnx.data"]
    assert data_file_names("m.onnx", 3) == [
        "m.onnx.00001-of-00003.data",
        "m.onnx.00002-of-00003.data",
        "m.onnx.00003-of-00003.data",
    ]


def test_data_files_are_the_model_s_own(tmp_path):
    for name in [
        "m.onnx.data",
        *data_file_names("m.onnx", 2),
        "m.onnx.1-of-2.data",  # not five digits
        "mm.onnx.00001-of-00002.data",  # another model's
        "m.onnx.00001-of-00002.data.tmp",
        "[m].onnx.00001-of-00002.data",  # a name with glob characters
    ]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in data_files(tmp_path / "m.onnx")] == ["m.onnx.data", *data_file_names("m.onnx", 2)]
    assert [p.name for p in data_files(tmp_path / "[m].onnx")] == ["[m].onnx.00001-of-00002.data"]
    assert data_files(tmp_path / "missing" / "m.onnx") == []
