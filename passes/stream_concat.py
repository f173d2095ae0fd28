"""Streamed concatenation: a fused weight written in row chunks straight from its source matrices.

A `ConcatTensor` is the concatenation of `Part`s along one axis of the stored matrix:

- axis 0: the parts one after the other (rows of the first part, then of the second, ...);
- axis 1: each output row is the parts' rows side by side (rows interleave the parts).

When the model is saved, `tofile` writes the result chunk by chunk (about `CHUNK_BYTES` each). Each chunk
is read from the sources with `os.preadv` into a small buffer: neither a source nor the fused matrix is
ever mapped or held whole, so memory does not grow with the group or the matrix size (file pages a
process maps count towards its resident size; pages it only reads or writes do not). A part can scale
its values along one axis on the way ("fold" multiplies each block's norm weight into its rows), and
half-precision rows are rounded once, exactly as a whole-matrix numpy computation would round them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Part:
    """One source matrix: the stored tensor viewed as 2-D [rows, cols], optionally a range of its rows or
    columns, optionally transposed (then it is read through a memory map: layouts mixed within one
    group only), optionally scaled along an axis of the result (`scale` broadcasts against it)."""

    tensor: Source
    rows: int
    cols: int
    row_range: tuple[int, int] | None = None
    col_range: tuple[int, int] | None = None
    transpose: bool = False
    scale: np.ndarray | None = None  # float32, [rows of the result] (axis 0) or [cols of the result]
    scale_axis: int = 0
    transform: Callable[[np.ndarray], np.ndarray] | None = None  # applied to each block read (unpacking)

    width: int | None = None  # columns after `transform`, when it changes them

    @property
    def shape(self) -> tuple[int, int]:
        """The part's shape as it enters the concatenation."""
        rows = self.rows if self.row_range is None else self.row_range[1] - self.row_range[0]
        cols = self.cols if self.col_range is None else self.col_range[1] - self.col_range[0]
        rows, cols = (cols, rows) if self.transpose else (rows, cols)
        return rows, cols if self.width is None else self.width

    def read(self, start: int, stop: int, dtype: np.dtype) -> np.ndarray:
        """Rows start:stop of the part as it enters the concatenation, scaled, in `dtype`."""
        block = self._stored_rows(start, stop) if not self.transpose else self._transposed_rows(start, stop)
        if self.col_range is not None and not self.transpose:
            block = block[:, self.col_range[0] : self.col_range[1]]
        if self.transform is not None:
            block = self.transform(block)
        if self.scale is None:
            return block.astype(dtype, copy=False)
        scale = self.scale[start:stop, None] if self.scale_axis == 0 else self.scale[None, :]
        return (block.astype(np.float32, copy=False) * scale).astype(dtype, copy=False)

    def _stored_rows(self, start: int, stop: int) -> np.ndarray:
        first = self.row_range[0] if self.row_range is not None else 0
        return read_rows(self.tensor, self.rows, self.cols, first + start, first + stop)

    def _transposed_rows(self, start: int, stop: int) -> np.ndarray:
        matrix = _array(self.tensor).reshape(self.rows, self.cols)
        if self.row_range is not None:
            matrix = matrix[self.row_range[0] : self.row_range[1]]
        if self.col_range is not None:
            matrix = matrix[:, self.col_range[0] : self.col_range[1]]
        return np.ascontiguousarray(matrix[:, start:stop].T)


Source = ir.TensorProtocol | np.ndarray


def read_rows(tensor: Source, rows: int, cols: int, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of `tensor` viewed as [rows, cols]: external data is read with preadv into a new
    buffer (never mapped); other tensors are sliced in memory."""
    dtype = _numpy_dtype(tensor)
    if not isinstance(tensor, ir.ExternalTensor):
        return np.array(_array(tensor).reshape(rows, cols)[start:stop])
    out = np.empty((stop - start, cols), dtype=dtype)
    view = memoryview(out.view(np.uint8).reshape(-1))
    offset = (tensor.offset or 0) + start * cols * dtype.itemsize
    fd = os.open(tensor.path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            count = os.preadv(fd, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"{tensor.path}: external data ends early (tensor {tensor.name!r})")
            done += count
    finally:
        os.close(fd)
    return out


def _array(tensor: Source) -> np.ndarray:
    return tensor if isinstance(tensor, np.ndarray) else tensor.numpy()


def _numpy_dtype(tensor: Source) -> np.dtype:
    return tensor.dtype if isinstance(tensor, np.ndarray) else np.dtype(tensor.dtype.numpy())


class ConcatTensor(ir.LazyTensor):
    """The concatenation of `parts` along `axis` of the stored 2-D matrix, declared with `shape` (same
    number of elements). `finish` maps each finished chunk of rows to its final form (for example packs
    int4 zero points). `tofile` streams; `numpy()`/`tobytes()` build the whole tensor (small models)."""

    def __init__(
        self,
        parts: list[Part],
        axis: int,
        dtype: ir.DataType,
        shape: tuple[int, ...],
        name: str,
        finish: Callable[[np.ndarray], np.ndarray] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        super().__init__(self._materialize, dtype=dtype, shape=ir.Shape(shape), name=name)
        self.parts, self.axis, self.finish, self.chunk_bytes = parts, axis, finish, chunk_bytes
        self._numpy = np.dtype(dtype.numpy())

    def chunks(self) -> Iterator[np.ndarray]:
        """The result's rows in order, a chunk at a time."""
        if self.axis == 0:
            for part in self.parts:
                rows, cols = part.shape
                for start in range(0, rows, self._step(cols)):
                    yield self._finished(part.read(start, min(start + self._step(cols), rows), self._numpy))
            return
        rows, width = self.parts[0].shape[0], sum(p.shape[1] for p in self.parts)
        step = self._step(width)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            chunk = np.empty((stop - start, width), dtype=self._work_dtype())
            column = 0
            for part in self.parts:
                chunk[:, column : column + part.shape[1]] = part.read(start, stop, chunk.dtype)
                column += part.shape[1]
            yield self._finished(chunk)

    def tofile(self, file) -> None:
        for chunk in self.chunks():
            file.write(memoryview(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)))

    def _step(self, cols: int) -> int:
        return max(1, self.chunk_bytes // max(1, cols * self._work_dtype().itemsize))

    def _work_dtype(self) -> np.dtype:
        return _numpy_dtype(self.parts[0].tensor) if self.finish is not None else self._numpy

    def _finished(self, chunk: np.ndarray) -> np.ndarray:
        return self.finish(chunk) if self.finish is not None else chunk

    def _materialize(self) -> ir.TensorProtocol:
        chunks = [chunk.reshape(-1) for chunk in self.chunks()]
        array = np.concatenate(chunks) if chunks else np.empty(0, self._numpy)
        return ir.tensor(array.reshape(tuple(self.shape)), dtype=self.dtype, name=self.name)
