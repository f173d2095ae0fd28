"""save_model's own external-data writer: onnx-ir's layout, no temporary folder, no partial files."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.io.data_files import data_file_names
from passes.io.model_io import INLINE_BYTES, load_model, save_model

SPEC = SyntheticSpec(blocks=[(True, 48), (False, 64), (True, 32)])


@pytest.fixture
def model_path(tmp_path):
    (tmp_path / "source").mkdir()
    return build_synthetic(SPEC, tmp_path / "source" / "model.onnx", external=True)


def _initializers(model: ir.Model) -> dict[str, ir.TensorProtocol]:
    return {name: value.const_value for name, value in model.graph.initializers.items()}


def test_same_files_as_onnx_ir_and_the_model_is_unchanged(model_path, tmp_path):
    model = load_model(model_path)
    small = sum(t.nbytes <= INLINE_BYTES for t in _initializers(model).values())
    assert 0 < small < len(model.graph.initializers)  # both kinds are exercised
    before = _initializers(model)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    save_model(model, tmp_path / "ours" / "m.onnx", external=True)
    assert _initializers(model) == before  # the caller's model still reads from its own files
    ir.save(model, tmp_path / "theirs" / "m.onnx", external_data="m.onnx.data")
    for name in ("m.onnx", "m.onnx.data"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()
    assert sorted(os.listdir(tmp_path / "ours")) == ["m.onnx", "m.onnx.data"]
    saved = _initializers(load_model(tmp_path / "ours" / "m.onnx"))
    for name, tensor in before.items():
        np.testing.assert_array_equal(saved[name].numpy(), tensor.numpy())


def test_a_model_saved_over_the_data_it_reads(model_path):
    """The tensors read from the file being replaced: onnx-ir's writer stages it (same result)."""
    model = load_model(model_path)
    expected = {name: t.numpy().copy() for name, t in _initializers(model).items()}
    save_model(model, model_path, external=True)
    saved = _initializers(load_model(model_path))
    for name, array in expected.items():
        np.testing.assert_array_equal(saved[name].numpy(), array)


def test_saved_in_several_files_of_at_most_the_limit(model_path, tmp_path):
    """Weights above the limit go to numbered files, tensors in order, each file within the limit unless
    it holds one larger tensor; the model reads the same; a later save in one file removes the numbered
    ones (and the other way round), and a save without external data removes them all."""
    model = load_model(model_path)
    before = {name: t.numpy().copy() for name, t in _initializers(model).items()}
    sizes = [t.nbytes for t in _initializers(model).values() if t.nbytes > INLINE_BYTES]
    limit = 2 * max(sizes) // 3  # the largest tensors exceed it: files of one tensor too
    target = tmp_path / "out" / "m.onnx"
    target.parent.mkdir()
    save_model(model, target, external=True, max_file_bytes=limit)
    names = sorted(os.listdir(target.parent))
    count = len(names) - 1
    assert count > 2 and names == ["m.onnx", *data_file_names("m.onnx", count)]
    proto = onnx.load(str(target), load_external_data=False)
    locations: dict[str, list[int]] = {}
    for tensor in proto.graph.initializer:
        info = {entry.key: entry.value for entry in tensor.external_data}
        if info:
            locations.setdefault(info["location"], []).append(int(info["length"]))
    assert sorted(locations) == names[1:] and sum(map(len, locations.values())) == len(sizes)
    for name, lengths in locations.items():
        assert sum(lengths) <= limit or len(lengths) == 1
        assert (target.parent / name).stat().st_size == sum(lengths)  # densely packed
    saved = _initializers(load_model(target))
    for name, array in before.items():
        np.testing.assert_array_equal(saved[name].numpy(), array)
    save_model(model, target, external=True, max_file_bytes=None)
    assert sorted(os.listdir(target.parent)) == ["m.onnx", "m.onnx.data"]
    save_model(model, target, external=True, max_file_bytes=limit)
    assert sorted(os.listdir(target.parent)) == names
    save_model(model, target, external=False)  # weights in the proto: no data file stays
    assert os.listdir(target.parent) == ["m.onnx"]


class _Failing(ir.Tensor):
    def tofile(self, file) -> None:
        file.write(b"\0" * 10)
        raise OSError("disk gone")


def test_a_failed_write_leaves_no_files(model_path, tmp_path):
    model = load_model(model_path)
    value = next(v for v in model.graph.initializers.values() if v.const_value.nbytes > INLINE_BYTES)
    value.const_value = _Failing(value.const_value.numpy(), name=value.name)
    target = tmp_path / "out" / "m.onnx"
    target.parent.mkdir()
    with pytest.raises(OSError, match="disk gone"):
        save_model(model, target, external=True)
    assert list(target.parent.iterdir()) == []
