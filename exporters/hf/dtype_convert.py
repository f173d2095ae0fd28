"""A checkpoint tensor written in another dtype: row chunks read from the shard, cast, written at an offset.

Every cast goes through float32 and rounds to nearest even, as torch's `.to(dtype)` does (numpy, and
ml_dtypes for bfloat16). Peak memory is one chunk. numpy is imported only when a tensor converts: a
copy that keeps the dtype starts before numpy is loaded.
"""

from __future__ import annotations

import os

from exporters.hf.safetensors_in import TensorEntry, numpy_dtype
from passes.io.file_copy import write_at

CHUNK_BYTES = 64 << 20  # rows converted at a time


def converts(entry: TensorEntry, dtype: str) -> bool:
    """The tensor is stored in another dtype than the export's: written through convert_rows, not copied."""
    return entry.numpy_name != dtype


def import_converters() -> None:
    """Import numpy and ml_dtypes (which converting needs) in this thread before the writer starts: the
    main thread imports numpy too (through onnx_ir), and two threads importing numpy for the first time
    at once can get it half initialized ("cannot import name '__cpu_features__' from partially initialized
    module"; seen in CI)."""
    import ml_dtypes  # noqa: F401, PLC0415 (imported in this thread before the writer starts; see the docstring)
    import numpy  # noqa: F401, PLC0415 (imported in this thread before the writer starts; see the docstring)


def convert_rows(src: int, entry: TensorEntry, fd: int, offset: int, dtype: str) -> int:
    """Write `entry` (read from the open shard `src`) in `dtype` at `offset` of `fd`, in row chunks; returns
    the bytes written."""
    import numpy as np  # noqa: PLC0415 (loaded by import_converters; a copy that keeps the dtype starts before numpy loads)

    source, target = numpy_dtype(entry.numpy_name), numpy_dtype(dtype)
    length = entry.end - entry.start
    rows = entry.shape[0] if entry.shape else 1
    row_bytes = max(1, length // max(rows, 1))
    step = max(1, CHUNK_BYTES // row_bytes) * row_bytes
    written = 0
    for first in range(0, length, step):
        raw = os.pread(src, min(step, length - first), entry.start + first)
        data = np.frombuffer(raw, dtype=source).astype(target)
        write_at(fd, data.view(np.uint8), offset + written)
        written += data.nbytes
    return written
