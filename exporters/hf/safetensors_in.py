"""A checkpoint folder's safetensors, read lazily: the tensor table from the headers, rows on demand.

    checkpoint = open_checkpoint(folder)               # headers only: name -> file, dtype, shape, byte range
    rows = read_tensor_rows(checkpoint.tensors[name], 0, 8)

One file (model.safetensors) or shards listed by model.safetensors.index.json. Standard library only at
import time: the --hf export reads the headers and starts its weight copy before numpy is loaded.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from passes.errors import UserError

if TYPE_CHECKING:
    import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The safetensors dtypes a checkpoint's tensors may have, by their numpy / ONNX names.
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype, shape and absolute byte range in `file`."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numpy_name(self) -> str:
        """float32 | float16 | bfloat16 (KeyError for a dtype no export reads)."""
        return SAFETENSORS_DTYPES[self.dtype]


@dataclass
class Checkpoint:
    """The tensor table of a checkpoint folder, read from the safetensors headers only."""

    folder: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def largest_bytes(self) -> int:
        return max((t.end - t.start for t in self.tensors.values()), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Read the safetensors headers (index + shards, or model.safetensors); UserError for a missing shard."""
    folder = Path(folder)
    checkpoint = Checkpoint(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{index}: cannot read 'weight_map' ({type(exc).__name__})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (folder / name).is_file():
                raise UserError(f"{index}: shard {name!r} (field 'weight_map') is missing from {folder}")
        for name in files:
            checkpoint.tensors.update(read_header(folder / name))
        for tensor, name in weight_map.items():
            if tensor not in checkpoint.tensors or checkpoint.tensors[tensor].file.name != name:
                raise UserError(f"{index}: 'weight_map' puts {tensor!r} in {name}, which does not hold it")
    elif (folder / SINGLE_FILE).is_file():
        checkpoint.tensors = read_header(folder / SINGLE_FILE)
    else:
        raise UserError(
            f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}; save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    return checkpoint


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The safetensors header: 8-byte little-endian length, JSON {name: {dtype, shape, data_offsets}}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if length > size - 8:
            raise UserError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: not a safetensors file (bad header)") from None
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if base + end > size:
            raise UserError(f"{path}: tensor {name!r} lies past the end of the file (truncated shard)")
        tensors[name] = TensorEntry(name, path, info["dtype"], tuple(info["shape"]), base + begin, base + end)
    return tensors


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of float32 | float16 | bfloat16 (bfloat16 from ml_dtypes, which onnx loads anyway)."""
    import ml_dtypes  # noqa: PLC0415 (the weight copy starts before numpy loads; see the docstring)
    import numpy as np  # noqa: PLC0415 (the weight copy starts before numpy loads; see the docstring)

    return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[name])


def read_tensor_rows(entry: TensorEntry, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of a checkpoint tensor (a vector is one row), in its own dtype, read from the shard."""
    import numpy as np  # noqa: PLC0415 (loaded by numpy_dtype already; see there why not at the top)

    dtype = numpy_dtype(entry.numpy_name)
    cols = entry.shape[-1] if len(entry.shape) == 2 else math.prod(entry.shape)
    row_bytes = cols * dtype.itemsize
    with open(entry.file, "rb") as f:
        f.seek(entry.start + start * row_bytes)
        raw = f.read((stop - start) * row_bytes)
    return np.frombuffer(raw, dtype=dtype).reshape(stop - start, cols)
