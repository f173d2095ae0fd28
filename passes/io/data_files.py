"""The names of a saved model's external data files, and how its tensors are packed into them.

A model `m.onnx` keeps its weights in one file, `m.onnx.data`, unless a size limit is asked for (for
example where it will be published: the Hugging Face Hub takes no file above 50 GB, so a 500 GB model
goes up in parts). Then, when they pass the limit, in `m.onnx.00001-of-00003.data`,
`m.onnx.00002-of-00003.data`, ... (tensors in order, a new file when the next tensor would pass the
limit; a tensor larger than the limit gets a file of its own), all written at once
(tensor_writer.write_files). One file stays the default: once no write call copied more than 128 KB
(file_copy.WRITE_BYTES), two files of 2 GB were no faster than one in alternating rounds on this VM
(docs/scale.md, seventh pass). No import of onnx: staging uses this module too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path


def data_file_names(model_name: str, count: int) -> list[str]:
    """The names of `count` data files of the model file `model_name`."""
    if count == 1:
        return [f"{model_name}.data"]
    return [f"{model_name}.{i:05d}-of-{count:05d}.data" for i in range(1, count + 1)]


def data_files(model: Path) -> list[Path]:
    """The data files present beside `model` that its name gives it (one file or numbered parts)."""
    parts = re.compile(re.escape(model.name) + r"\.\d{5}-of-\d{5}\.data")
    single = model.with_name(f"{model.name}.data")
    found = [single] if single.is_file() else []
    if model.parent.is_dir():
        found += sorted(p for p in model.parent.iterdir() if parts.fullmatch(p.name) and p.is_file())
    return found


def remove_data_files(model: Path, keep: Sequence[Path]) -> None:
    """Remove the data files beside `model` that its name gives it, but those in `keep`."""
    for stale in set(data_files(model)) - set(keep):
        stale.unlink(missing_ok=True)


def pack(sizes: Sequence[int], max_bytes: int | None) -> list[list[int]]:
    """The indices of the tensors of `sizes` that go to each file, in order (None or 0: one file)."""
    files: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        if max_bytes and files[-1] and filled + size > max_bytes:
            files.append([])
            filled = 0
        files[-1].append(i)
        filled += size
    return files
