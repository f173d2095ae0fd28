"""Atomic outputs: nothing stays on failure; a large commit does not wait for its folder's removal."""

from __future__ import annotations

import time

import pytest

import passes.io.staging
from passes.io.data_files import data_file_names
from passes.io.staging import commit_output, staged_output


def _stage(staging, name: str) -> None:
    (staging / name).write_bytes(b"model")
    (staging / f"{name}.data").write_bytes(b"weights")


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), staged_output(tmp_path / "m.onnx") as staging:
        _stage(staging, "m.onnx")
        raise RuntimeError("validation failed")
    assert _names(tmp_path) == []


def test_a_small_commit_removes_its_folder_before_returning(tmp_path):
    with staged_output(tmp_path / "m.onnx") as staging:
        _stage(staging, "m.onnx")
        commit_output(staging / "m.onnx", tmp_path / "m.onnx")
    assert _names(tmp_path) == ["m.onnx", "m.onnx.data"]


def test_a_large_commit_leaves_the_removal_to_a_detached_process(tmp_path, monkeypatch):
    monkeypatch.setattr(passes.io.staging, "DETACHED_REMOVAL_BYTES", 1)
    removed = []
    monkeypatch.setattr(passes.io.staging.shutil, "rmtree", lambda *args, **kwargs: removed.append(args))
    with staged_output(tmp_path / "m.onnx") as staging:
        _stage(staging, "m.onnx")
        commit_output(staging / "m.onnx", tmp_path / "m.onnx")
    assert removed == []  # not removed in this process
    deadline = time.monotonic() + 30
    while staging.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _names(tmp_path) == ["m.onnx", "m.onnx.data"]
    assert (tmp_path / "m.onnx.data").read_bytes() == b"weights"


def test_a_large_failure_is_still_removed_before_returning(tmp_path, monkeypatch):
    """An uncommitted folder (files left in it) is removed in this process whatever the sizes."""
    monkeypatch.setattr(passes.io.staging, "DETACHED_REMOVAL_BYTES", 1)
    (tmp_path / "m.onnx.data").write_bytes(b"an older output")
    with pytest.raises(RuntimeError), staged_output(tmp_path / "m.onnx") as staging:
        _stage(staging, "m.onnx")
        raise RuntimeError("interrupted")
    assert _names(tmp_path) == ["m.onnx.data"]
    assert (tmp_path / "m.onnx.data").read_bytes() == b"an older output"


def test_numbered_data_files_are_committed_and_an_older_output_s_removed(tmp_path):
    """A commit moves every data file of the staged model; the files of the output it replaces that it
    does not have (an earlier save in more files, or in one) are removed, other files stay."""
    for name in ["m.onnx", "m.onnx.data", *data_file_names("m.onnx", 3), "other.onnx.data"]:
        (tmp_path / name).write_bytes(b"an older output")
    with staged_output(tmp_path / "m.onnx") as staging:
        (staging / "m.onnx").write_bytes(b"model")
        for name in data_file_names("m.onnx", 2):
            (staging / name).write_bytes(name.encode())
        commit_output(staging / "m.onnx", tmp_path / "m.onnx")
    assert _names(tmp_path) == sorted(["m.onnx", *data_file_names("m.onnx", 2), "other.onnx.data"])
    for name in data_file_names("m.onnx", 2):
        assert (tmp_path / name).read_bytes() == name.encode()
