"""What exporters.nas.early_copy needs of an ONNX file, read with the standard library only: the metadata and
each initializer's name, dtype, dims and where its bytes are (raw bytes in the file, or a range of an
external data file).

`import onnx` takes ~0.5 s of CPU (protobuf, numpy) before the first byte could be copied; this reader takes
a few milliseconds for a graph whose weights are external (node records are skipped by their length). The
protobuf wire format: each field is a varint key (field number << 3 | wire type) followed by a varint (type
0), 8 bytes (1), a varint length and that many bytes (2), or 4 bytes (5). Field numbers from onnx.proto:
ModelProto graph 7, metadata_props 14; GraphProto initializer 5; TensorProto dims 1, data_type 2, name 8,
raw_data 9, external_data 13, data_location 14; StringStringEntryProto key 1, value 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# TensorProto.DataType values and the dtype names of exporters.nas.safetensors_out.
DTYPES = {1: "float32", 10: "float16", 16: "bfloat16"}
EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


class ProtoError(ValueError):
    """Not a protobuf message this reader understands (the real load then says what is wrong)."""


@dataclass
class Initializer:
    name: str = ""
    data_type: int = 0
    dims: list[int] = field(default_factory=list)
    raw_data: bytes = b""
    external: dict[str, str] = field(default_factory=dict)
    data_location: int = 0

    @property
    def dtype(self) -> str | None:
        return DTYPES.get(self.data_type)


@dataclass
class ModelHeader:
    metadata: dict[str, str]
    initializers: dict[str, Initializer]


def read_model(path: str | Path) -> ModelHeader:
    """The metadata and initializers of the ONNX file at `path` (its external data is not opened)."""
    data = memoryview(Path(path).read_bytes())
    metadata: dict[str, str] = {}
    initializers: dict[str, Initializer] = {}
    for number, value in _fields(data):
        if number == 14 and isinstance(value, memoryview):
            key, text = _entry(value)
            metadata[key] = text
        elif number == 7 and isinstance(value, memoryview):
            for inner, item in _fields(value):
                if inner == 5 and isinstance(item, memoryview):
                    tensor = _initializer(item)
                    initializers[tensor.name] = tensor
    return ModelHeader(metadata, initializers)


def _initializer(data: memoryview) -> Initializer:
    tensor = Initializer()
    for number, value in _fields(data):
        if number == 1:  # repeated int64, packed (length-delimited) or one varint per field
            if isinstance(value, memoryview):
                tensor.dims += [_signed(v) for v in _varints(value)]
            else:
                tensor.dims.append(_signed(value))
        elif number == 2 and isinstance(value, int):
            tensor.data_type = value
        elif number == 8 and isinstance(value, memoryview):
            tensor.name = bytes(value).decode()
        elif number == 9 and isinstance(value, memoryview):
            tensor.raw_data = bytes(value)
        elif number == 13 and isinstance(value, memoryview):
            key, text = _entry(value)
            tensor.external[key] = text
        elif number == 14 and isinstance(value, int):
            tensor.data_location = value
    return tensor


def _entry(data: memoryview) -> tuple[str, str]:
    """A StringStringEntryProto: (key, value)."""
    key = value = ""
    for number, item in _fields(data):
        if isinstance(item, memoryview):
            if number == 1:
                key = bytes(item).decode()
            elif number == 2:
                value = bytes(item).decode()
    return key, value


def _fields(data: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each field of one message: an int for varints and fixed-size fields, a view
    of the bytes for length-delimited ones."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > end:
                raise ProtoError("a field runs past the end of its message")
            yield number, data[at : at + length]
            at += length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            yield number, int.from_bytes(data[at : at + size], "little")
            at += size
        else:
            raise ProtoError(f"wire type {wire} (groups) is not used by ONNX")


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data):
            raise ProtoError("a varint runs past the end of its message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _varints(data: memoryview) -> Iterator[int]:
    at = 0
    while at < len(data):
        value, at = _varint(data, at)
        yield value


def _signed(value: int) -> int:
    """An int64 field's varint as the signed number (two's complement over 64 bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value
