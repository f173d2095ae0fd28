"""Loading and saving models safely: checked external data, atomic writes, weights left on disk."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from passes.errors import UserError
from passes.io.data_files import data_file_names, data_files, pack, remove_data_files
from passes.io.staging import commit_output, staged_output  # noqa: F401  (re-exported)
from passes.io.tensor_writer import write_files

# Above this many initializer bytes a model must be saved with external data (protobuf's 2 GB limit).
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
# Initializers of at most this many bytes stay in the proto when the rest go to external data (onnx-ir's
# default): shape inference reads small constants such as axes and shapes from the proto.
INLINE_BYTES = 256


def load_proto(path: str | Path) -> onnx.ModelProto:
    """The model's protobuf without its external data, after checking the data files exist and stay
    inside the model's folder."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"model {path} does not exist")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as exc:
        raise UserError(f"{path} is not an ONNX model ({type(exc).__name__})") from None
    if not proto.graph.node or not proto.opset_import:
        raise UserError(f"{path} is not an ONNX model (no graph nodes or opset)")
    check_external_data(proto, path.parent)
    return proto


def load_typed_proto(path: str | Path) -> onnx.ModelProto:
    """load_proto with value types from shape inference, where it works (cut graphs need typed edges)."""
    proto = load_proto(path)
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return proto


def check_external_data(proto: onnx.ModelProto, folder: Path) -> None:
    folder = folder.resolve()
    for tensor in _external_tensors(proto):
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        target = (folder / location).resolve()
        if not target.is_relative_to(folder) or os.path.isabs(location):
            raise UserError(
                f"initializer {tensor.name!r}: external data location {location!r} leaves the model's "
                "folder (path traversal); refusing to read it"
            )
        if not target.is_file():
            raise UserError(
                f"initializer {tensor.name!r}: external data file {location!r} is missing; "
                f"keep it beside the model in {folder}"
            )
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if end > target.stat().st_size:
            raise UserError(f"initializer {tensor.name!r}: external data file {location!r} is truncated")


def _external_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor


def has_external_data(path: str | Path) -> bool:
    return any(True for _ in _external_tensors(onnx.load(str(path), load_external_data=False)))


def load_model(path: str | Path) -> ir.Model:
    """An onnx-ir model whose external weights stay memory-mapped on disk."""
    proto = load_proto(path)
    model = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(model.graph, Path(path).parent)
    return model


def weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save_model(
    model: ir.Model, path: Path, external: bool, max_file_bytes: int | None = None
) -> None:
    """Save (external data beside it when `external`: `<name>.data`, or, given `max_file_bytes` and weights
    above it, numbered files of at most that each, passes/io/data_files.py); the tensors of every file are
    written all at once (tensor_writer.write_files).

    The data files are written here rather than by onnx-ir's writer, which writes one file in a temporary
    folder and removes that folder: on a file system that discards freed blocks synchronously (ext4 mounted
    with `discard`, as on these machines) the removal waits for all the writeback queued ahead of it,
    0.5-2 s after a few GB (docs/scale.md). Same layout as onnx-ir's within a file: the initializers above
    INLINE_BYTES, densely, in order. Data files of an earlier save to `path` that this one does not
    write are removed (unless the model read from them)."""
    path = Path(path)
    values = [value for graph in model.graphs() for value in graph.initializers.values()]
    tensors = [value.const_value for value in values]
    earlier = data_files(path)
    reads_earlier = any(_reads_from(tensor, earlier) for tensor in tensors)
    if not external or reads_earlier:
        # onnx-ir stages the data file itself when a tensor reads from a file it replaces (numbered files
        # it read from stay: the model in memory may still read them)
        ir.save(model, path, external_data=f"{path.name}.data" if external else None)
        if not reads_earlier:
            remove_data_files(path, keep=[path.with_name(f"{path.name}.data")] if external else [])
        return
    written = [(value, tensor) for value, tensor in zip(values, tensors, strict=True) if _external(tensor)]
    packed = pack([tensor.nbytes for _, tensor in written], max_file_bytes)
    names = data_file_names(path.name, len(packed))
    files = [[written[i] for i in indices] for indices in packed]
    try:
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(open(path.with_name(name), "wb")) for name in names]
            pairs = [
                (file, [tensor for _, tensor in group]) for file, group in zip(opened, files, strict=True)
            ]
            offsets = write_files(pairs)  # all files at once, their tensors interleaved
        for name, group, starts in zip(names, files, offsets, strict=True):
            for (value, tensor), offset in zip(group, starts, strict=True):
                value.const_value = ir.ExternalTensor(
                    name, offset, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=tensor.name,
                    base_dir=path.parent,
                )  # fmt: skip
        for value, tensor in zip(values, tensors, strict=True):
            if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= INLINE_BYTES:
                value.const_value = ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name)
        ir.save(model, path)  # the tensors are external now: the proto keeps their location and offset
    except BaseException:
        for name in names:  # no partial data file (the proto is written last)
            path.with_name(name).unlink(missing_ok=True)
        raise
    finally:
        for value, tensor in zip(values, tensors, strict=True):
            value.const_value = tensor
    remove_data_files(path, keep=[path.with_name(name) for name in names])


def _external(tensor: ir.TensorProtocol | None) -> bool:
    """Whether a saved initializer goes to the data file (small ones stay in the proto)."""
    return tensor is not None and tensor.nbytes > INLINE_BYTES


def _reads_from(tensor: ir.TensorProtocol | None, files: list[Path]) -> bool:
    if not isinstance(tensor, ir.ExternalTensor):
        return False
    try:
        return any(os.path.samefile(tensor.path, file) for file in files)
    except OSError:  # the tensor's file missing
        return False
