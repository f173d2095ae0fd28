"""Streamed concatenation: a fused weight written in row chunks straight from its source matrices.

A `ConcatTensor` is the concatenation of `Part`s along one axis of the stored matrix:

- axis 0: the parts one after the other (rows of the first part, then of the second, ...);
- axis 1: each output row is the parts' rows side by side (rows interleave the parts).

A ConcatTensor is written as jobs, each writing its own byte range (`writes(fd, at)`), which
passes/io/tensor_writer.py runs on two threads beside the model's other tensors (`write_files`):

- plain parts (whole rows, unscaled) of an axis-0 concatenation, and unchanged external tensors: kernel
  copies, file to file (copy_file_range), in COPY_BYTES pieces;
- interleaved gate/up rows: a job per band of about BAND_BYTES of output rows, built a chunk (about
  CHUNK_BYTES) at a time in the thread's chunk buffer, the pages of a memfd. Each part's rows go into
  its columns of the chunk with one copy from the page cache: plain rows by preadv; rows that "fold"
  scales by the multiply itself, from the band's rows mapped from their data file with MAP_POPULATE
  (page table entries for the cached pages in one call, no copy; unmapped when the band is written;
  float16 and bfloat16 by passes/io/_half_scale.c, see scale_blocks). Then one sendfile copies the chunk
  into the output in the kernel, 64 KB at a time as `cp` copies (_ChunkBuffer). The gather this
  replaced, pwritev of each output row straight from mapped rows in calls of at most WRITE_BYTES, spent
  a fifth of its CPU on Python and on hand-offs between the threads (docs/scale.md, eighth pass); one
  copy_file_range per row segment was slower at every segment size from 4 to 56 KB;
- other parts one after the other (scaled, transposed, in memory): a chunk at a time into the chunk
  buffer, scaled there in place, sent the same way. Transposed parts are read through a map of a band of
  their stored rows, in-memory ones copied;
- chunks that `finish` changes (packed int4 zero points): each part's rows read into a new block, and the
  finished chunk written with pwritev.

Into a stream (an in-memory buffer), chunks are built and written in order. Neither a source nor the
fused matrix is ever mapped (beyond a band's rows) or held whole, so memory does not grow with the group
or the matrix size (file pages a process maps count towards its resident size; pages it only reads or
writes do not).
"fold" multiplies each part's norm weight into its input dimension in float32, and half-precision rows
are rounded once, exactly as a whole-matrix numpy computation would round them (`scale_rows`; float16 and
bfloat16 in one pass, passes/io/_half_scale.c).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from passes.io.tensor_writer import (
    IOV_MAX,
    Write,
    advance,
    chunk_buffer,
    copies,
    pwrite_all,
    regular_fd,
    write_chunk,
    write_tensors,
)

try:  # half-precision "fold" in one pass (passes/io/_half_scale.c); where it is not built, the slower paths
    from passes.io import _half_scale
except ImportError:
    _half_scale = None
_NATIVE_HALF = _half_scale is not None and _half_scale.supported()
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# A built chunk. Each costs about 150 us of its own (Python, an ONNX Runtime run, a sendfile): 4 MB chunks
# were 10-15% faster than 1 MB ones, 8 MB no faster (docs/scale.md, eighth pass).
CHUNK_BYTES = 4 << 20
BAND_BYTES = 8 << 20  # output bytes per interleaved-rows job (built and written CHUNK_BYTES at a time)
Source = ir.TensorProtocol | np.ndarray  # a model's tensor (external data or in memory), or an array


@dataclass(frozen=True)
class Part:
    """One source matrix: the stored tensor viewed as 2-D [rows, cols], optionally a range of its rows or
    columns, optionally transposed (layouts mixed within one group: read a band at a time through a
    memory map whose pages are dropped after each band), optionally scaled along an axis of the result."""

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

    def read(self, start: int, stop: int, dtype: np.dtype, scaled: bool = True) -> np.ndarray:
        """Rows start:stop of the part as it enters the concatenation, in `dtype`, scaled unless told not to
        (the caller then scales them with `row_scale`)."""
        out = np.empty((stop - start, self.shape[1]), dtype)
        self.read_into(out, start, stop)
        if scaled and self.scale is not None:
            scale_rows(out, self.row_scale(start, stop))
        return out

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Write rows start:stop of the part, unscaled, into `out` (a [stop - start, width] view of a
        chunk)."""
        if self._direct and out.dtype == _numpy_dtype(self.tensor):  # read straight into the chunk
            first = self.row_range[0] if self.row_range is not None else 0
            read_rows_into(self.tensor, self.cols, first + start, out)
        else:
            read = self._transposed_rows if self.transpose else self._stored_rows
            block = read(start, stop)
            if self.col_range is not None and not self.transpose:
                block = block[:, self.col_range[0] : self.col_range[1]]
            out[...] = self.transform(block) if self.transform is not None else block

    def mapped_rows(self, start: int, stop: int, dtype: np.dtype) -> np.ndarray | None:
        """Rows start:stop as a read-only view of the data file's pages (see map_rows), or None when the
        part is not whole stored rows of an external data file in `dtype`."""
        if not (self._direct and isinstance(self.tensor, ir.ExternalTensor)):
            return None
        if _numpy_dtype(self.tensor) != dtype or stop <= start:
            return None
        first = self.row_range[0] if self.row_range is not None else 0
        return map_rows(self.tensor, self.cols, first + start, stop - start, populate=True)

    def row_scale(self, start: int, stop: int) -> np.ndarray | None:
        """The scale of rows start:stop, shaped to broadcast over them (None: not scaled)."""
        if self.scale is None:
            return None
        return self.scale[start:stop, None] if self.scale_axis == 0 else self.scale[None, :]

    @property
    def _direct(self) -> bool:
        """Whole stored rows, as stored: readable straight into the destination."""
        return self.col_range is None and not self.transpose and self.transform is None

    def file_range(self) -> tuple[str, int, int] | None:
        """(path, offset, length) when the whole part is a plain byte range of an external data file."""
        if not (self._direct and self.scale is None and isinstance(self.tensor, ir.ExternalTensor)):
            return None
        first, rows = (self.row_range or (0, self.rows))[0], self.shape[0]
        row_bytes = self.cols * _numpy_dtype(self.tensor).itemsize
        return str(self.tensor.path), (self.tensor.offset or 0) + first * row_bytes, rows * row_bytes

    def _stored_rows(self, start: int, stop: int) -> np.ndarray:
        first = self.row_range[0] if self.row_range is not None else 0
        return read_rows(self.tensor, self.rows, self.cols, first + start, first + stop)

    def _transposed_rows(self, start: int, stop: int) -> np.ndarray:
        first = self.col_range[0] if self.col_range is not None else 0
        matrix = read_columns(self.tensor, self.rows, self.cols, first + start, first + stop)
        if self.row_range is not None:
            matrix = matrix[self.row_range[0] : self.row_range[1]]
        return np.ascontiguousarray(matrix.T)


def scale_rows(out: np.ndarray, scale: np.ndarray) -> None:
    """out = dtype(float32(out) * scale), in place (see scale_blocks)."""
    scale_blocks([out], [scale])


def scale_blocks(
    blocks: list[np.ndarray],
    scales: list[np.ndarray | None],
    sources: list[np.ndarray | None] | None = None,
) -> None:
    """Each block = dtype(float32(its source) * its scale), where a block's source is the block itself (in
    place) unless `sources` gives another array of its shape and dtype; a None scale leaves its block as
    is. Multiplied in float32 and rounded once (to nearest even) to the block's dtype, exactly as numpy
    computes it on the whole matrix.

    float16 goes through passes/io/_half_scale.c: one pass with the CPU's F16C conversions, where its rows are
    contiguous and it is scaled by row or by column (a part's columns of a chunk, from mapped rows). numpy
    2.4 converts float16 element by element (0.7 GB/s), and ONNX Runtime's Cast -> Mul -> Cast, the
    fallback where the module is not built, takes three passes (2.4 GB/s in the fusion): either left
    half-precision "fold" CPU-bound on two cores (docs/scale.md, ninth pass). ONNX Runtime takes contiguous
    buffers only, so there a view of a wider chunk goes row by row, each row scaled into where it lies, in
    runs of up to _HALF_RUN rows (a run costs tens of microseconds of its own). Same IEEE operations
    everywhere, so the same bits (tests/passes/io/test_stream_concat.py compares them with numpy's for every
    float16 value), but for one case of the fallback: row by row, a NaN weight among a row's last
    cols % 8 values comes out as the canonical NaN, its payload lost (MLAS converts those one at a time).
    bfloat16 goes through the C module too (7 GB/s against ml_dtypes' 2.7), else numpy with ml_dtypes, the
    same bits; float32 through numpy: one buffered pass, strided or not, no float32 copy.
    """
    half: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for block, source, scale in zip(blocks, sources or [None] * len(blocks), scales, strict=True):
        if scale is None or not block.size:
            continue
        source = block if source is None else source
        scale = np.ascontiguousarray(scale, np.float32)
        # A NaN scale times a NaN weight: x86 keeps the first operand's payload, and the operand order
        # differs between numpy and ONNX Runtime; numpy decides there.
        nan = np.isnan(scale).any()
        if not nan and _native_scale(block, source, scale):
            continue
        if block.dtype != np.float16 or nan:
            np.multiply(source, scale, out=block, dtype=np.float32, casting="unsafe")
        elif block.flags.c_contiguous:
            half.append((block, source, scale))
        elif block.strides[-1] == block.itemsize:  # rows contiguous: each scaled into where it lies
            for row in range(len(block)):  # a scale is [rows, 1] or [1, cols]
                row_scale = scale[row : row + 1] if len(scale) > 1 else scale
                half.append((block[row : row + 1], source[row : row + 1], row_scale))
        else:
            contiguous = np.array(source, order="C")  # a copy: `source` may be the file's read-only map
            _half_fold([(contiguous, contiguous, scale)])
            block[...] = contiguous
    for first in range(0, len(half), _HALF_RUN):
        _half_fold(half[first : first + _HALF_RUN])


def _native_scale(block: np.ndarray, source: np.ndarray, scale: np.ndarray) -> bool:
    """Scale a float16 or bfloat16 block whose rows are contiguous by passes/io/_half_scale.c; False when it
    cannot."""
    rows, cols = block.shape if block.ndim == 2 else (0, 0)
    per_row = scale.shape == (rows, 1)
    if not (_NATIVE_HALF and rows and (per_row or scale.shape == (1, cols)) and block.flags.writeable):
        return False
    if block.dtype not in (np.float16, _BFLOAT16) or source.dtype != block.dtype:
        return False
    if source.shape != block.shape:
        return False
    if block.strides[1] != block.itemsize or source.strides[1] != source.itemsize:
        return False
    if block.strides[0] % block.itemsize or source.strides[0] % source.itemsize:  # rows elements apart
        return False
    step, from_step = block.strides[0] // block.itemsize, source.strides[0] // source.itemsize
    addresses = source.ctypes.data, from_step, block.ctypes.data, step
    _half_scale.scale(*addresses, rows, cols, scale.ctypes.data, per_row, block.dtype == _BFLOAT16)
    return True


_HALF_RUN = 64  # blocks (or rows) scaled by one ONNX Runtime run: a run's graph holds 3 nodes per block


def _half_fold(triples: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """One ONNX Runtime run over every (contiguous float16 block, its float16 source, float32 scale)."""
    with _LOAD:  # built once per count, by whichever chunk builder comes first
        session = _half_fold_session(len(triples))
    binding = session.io_binding()
    for i, (block, source, scale) in enumerate(triples):
        # Elementwise, so in place works too: each value is read before it is written. No allocation.
        binding.bind_cpu_input(f"w{i}", np.ascontiguousarray(source))
        binding.bind_cpu_input(f"g{i}", scale)
        binding.bind_output(f"y{i}", "cpu", 0, np.float16, list(block.shape), block.ctypes.data)
    session.run_with_iobinding(binding)


@functools.cache
def _half_fold_session(count: int):
    """A one-thread ONNX Runtime session computing y_i = float16(float32(w_i) * g_i) for `count` pairs
    (g_i float32, broadcast)."""
    from passes.io.sessions import open_session  # noqa: PLC0415 (ONNX Runtime: only float16 folds that _half_scale.c cannot take need it)

    helper, half, single = onnx.helper, onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    value = helper.make_tensor_value_info
    matrix = [None, None]
    nodes, inputs, outputs = [], [], []
    for i in range(count):
        nodes += [
            helper.make_node("Cast", [f"w{i}"], [f"w32_{i}"], to=single),
            helper.make_node("Mul", [f"w32_{i}", f"g{i}"], [f"y32_{i}"]),
            helper.make_node("Cast", [f"y32_{i}"], [f"y{i}"], to=half),
        ]
        inputs += [value(f"w{i}", half, matrix), value(f"g{i}", single, matrix)]
        outputs.append(value(f"y{i}", half, matrix))
    graph = helper.make_graph(nodes, "half_fold", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return open_session(model, threads=1)  # the chunk builders are the parallelism (_WORKERS threads)


def read_rows(tensor: Source, rows: int, cols: int, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of `tensor` viewed as [rows, cols] (external data: read, never mapped)."""
    if not isinstance(tensor, ir.ExternalTensor):
        return np.array(_array(tensor).reshape(rows, cols)[start:stop])
    out = np.empty((stop - start, cols), dtype=_numpy_dtype(tensor))
    read_rows_into(tensor, cols, start, out)
    return out


def read_rows_into(tensor: Source, cols: int, start: int, out: np.ndarray) -> None:
    """Rows start:start + len(out) of `tensor` viewed as [., cols] into `out`, which may be a column slice
    of a wider chunk: external data goes with preadv from the file straight into each row of `out`."""
    if not isinstance(tensor, ir.ExternalTensor):
        out[...] = _array(tensor).reshape(-1, cols)[start : start + len(out)]
        return
    row_bytes = cols * out.dtype.itemsize
    if out.flags.c_contiguous:  # whole rows one after the other: one buffer
        rows = [memoryview(out.view(np.uint8).reshape(-1))] if out.size else []
    else:
        rows = [memoryview(row.view(np.uint8)) for row in out]
    offset = (tensor.offset or 0) + start * row_bytes
    fd = os.open(tensor.path, os.O_RDONLY)
    try:
        for first in range(0, len(rows), IOV_MAX):
            _preadv_all(fd, rows[first : first + IOV_MAX], offset + first * row_bytes, tensor)
    finally:
        os.close(fd)


def map_rows(
    tensor: ir.ExternalTensor, cols: int, first: int, count: int, populate: bool = False
) -> np.ndarray:
    """Rows first:first + count of `tensor` viewed as [., cols]: a read-only view of its data file's pages,
    unmapped when the last view of it is released. `populate`: MAP_POPULATE, the cached pages enter the
    page table in one call instead of a fault per page (for rows that are read whole)."""
    dtype = _numpy_dtype(tensor)
    row_bytes = cols * dtype.itemsize
    offset = (tensor.offset or 0) + first * row_bytes
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(tensor.path, "rb") as file:
        if os.fstat(file.fileno()).st_size < offset + count * row_bytes:  # mmap would refuse: ValueError
            raise OSError(f"{tensor.path}: external data ends early (tensor {tensor.name!r})")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        pages = mmap.mmap(
            file.fileno(), offset - base + count * row_bytes, flags, mmap.PROT_READ, offset=base
        )
    return np.frombuffer(pages, dtype, count * cols, offset - base).reshape(count, cols)


_MAPPED_ROWS_BYTES = 16 << 20  # file pages read_columns keeps mapped at a time


def read_columns(tensor: Source, rows: int, cols: int, start: int, stop: int) -> np.ndarray:
    """Columns start:stop of `tensor` viewed as [rows, cols], as a new [rows, stop - start] array. External
    data is mapped a band of rows at a time (map_rows: only the columns' pages are read),
    each band unmapped before the next, so memory stays near the result whatever the matrix size."""
    if not isinstance(tensor, ir.ExternalTensor):
        return np.array(_array(tensor).reshape(rows, cols)[:, start:stop])
    out = np.empty((rows, stop - start), _numpy_dtype(tensor))
    band = max(1, _MAPPED_ROWS_BYTES // (cols * out.itemsize))
    for first in range(0, rows, band):
        count = min(band, rows - first)
        out[first : first + count] = map_rows(tensor, cols, first, count)[:, start:stop]
    return out


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, tensor) -> None:
    """preadv until every buffer is full (a call may stop short)."""
    while buffers:
        count = os.preadv(fd, buffers, offset)
        if count <= 0:
            raise OSError(f"{tensor.path}: external data ends early (tensor {tensor.name!r})")
        offset += count
        buffers = advance(buffers, count)


_LOAD = threading.Lock()  # chunks are built in threads; a tensor maps or computes its array once


def _array(tensor: Source) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    with _LOAD:
        return tensor.numpy()


def _numpy_dtype(tensor: Source) -> np.dtype:
    return tensor.dtype if isinstance(tensor, np.ndarray) else np.dtype(tensor.dtype.numpy())


class ConcatTensor(ir.LazyTensor):
    """The concatenation of `parts` along `axis` of the stored 2-D matrix, declared with `shape` (same
    number of elements). `finish` maps each finished chunk of rows to its final form (for example packs
    int4 zero points). `tofile` into a regular file: jobs that each write their own byte range, run by two
    threads (plain parts are copied file to file by the kernel; other chunks are read, scaled and written
    a few rows at a time, so that the chunk stays in the core's cache). Into a stream: chunks in order.
    `numpy()`/`tobytes()` build the whole tensor."""

    def __init__(
        self,
        parts: list[Part],
        axis: int,
        dtype: ir.DataType,
        shape: tuple[int, ...],
        name: str,
        finish: Callable[[np.ndarray], np.ndarray] | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        super().__init__(self._materialize, dtype=dtype, shape=ir.Shape(shape), name=name)
        self.parts, self.axis, self.finish, self.chunk_bytes = parts, axis, finish, chunk_bytes
        self._numpy = np.dtype(dtype.numpy())

    def __repr__(self) -> str:  # LazyTensor's would print `func`, a bound method whose repr is this one
        return (
            f"{type(self).__name__}({self.name!r}, {self.dtype.name}, {list(self.shape)}, "
            f"{len(self.parts)} parts along axis {self.axis})"
        )

    def chunks(self) -> Iterator[np.ndarray]:
        """The result's rows in order, a chunk at a time (plain file ranges read a chunk at a time)."""
        if self.axis == 0:
            for part in self.parts:
                if self.finish is None and (file_range := part.file_range()) is not None:
                    path, offset, length = file_range
                    for done in range(0, length, CHUNK_BYTES):
                        count = min(CHUNK_BYTES, length - done)
                        yield np.fromfile(path, np.uint8, count, offset=offset + done)
                    continue
                for start, stop in self._steps(part.shape[0], part.shape[1]):
                    yield self._finished(part.read(start, stop, self._work_dtype()))
            return
        for start, stop in self._steps(self.parts[0].shape[0], self._width()):
            yield self._finished(np.concatenate(self._blocks(start, stop), axis=1))

    def writes(self, fd: int, base: int) -> Iterator[Write]:
        """The result as jobs, in order, that each write their own byte range of `fd` (from `base`) and can
        run in any order: kernel copies of file ranges, or chunks built and written."""
        row_bytes = self._row_bytes()
        if row_bytes == 0:
            return
        if self.axis == 0:
            at = base
            for part in self.parts:
                if self.finish is None and (file_range := part.file_range()) is not None:
                    yield from copies(*file_range, fd, at)
                else:
                    for start, stop in self._steps(part.shape[0], part.shape[1]):
                        where = at + start * row_bytes
                        job = functools.partial(self._stacked_at, part, start, stop, fd, where)
                        yield Write((stop - start) * row_bytes, job)
                at += part.shape[0] * row_bytes
            return
        band = BAND_BYTES if self.finish is None else None  # a job's rows, built chunk by chunk
        for start, stop in self._steps(self.parts[0].shape[0], self._width(), band):
            job = functools.partial(self._side_by_side_at, start, stop, fd, base + start * row_bytes)
            yield Write((stop - start) * row_bytes, job)

    def tofile(self, file) -> None:
        if regular_fd(file) is None:  # a stream (an in-memory buffer, a pipe): in order
            for chunk in self.chunks():
                write_chunk(file, chunk)
        else:
            write_tensors(file, [self])

    def _stacked_at(self, part: Part, start: int, stop: int, fd: int, at: int) -> None:
        if self.finish is not None:
            chunk = self.finish(part.read(start, stop, self._work_dtype()))
            pwrite_all(fd, [self._checked(chunk, stop - start)], at)
            return
        buffer = chunk_buffer((stop - start) * self._row_bytes())
        chunk = buffer.array(stop - start, part.shape[1], self._numpy)
        part.read_into(chunk, start, stop)
        scale_blocks([chunk], [part.row_scale(start, stop)])
        buffer.write(fd, chunk.nbytes, at)

    def _side_by_side_at(self, start: int, stop: int, fd: int, at: int) -> None:
        if self.finish is not None:
            chunk = self.finish(np.concatenate(self._blocks(start, stop), axis=1))
            pwrite_all(fd, [self._checked(chunk, stop - start)], at)
            return
        # Scaled parts are scaled from their rows of the band, mapped once, into their columns of each
        # chunk; the others are read into their columns. Either way one copy from the page cache.
        dtype, width, row_bytes = self._work_dtype(), self._width(), self._row_bytes()
        maps = [None if part.scale is None else part.mapped_rows(start, stop, dtype) for part in self.parts]
        for first, last in self._steps(stop - start, width):
            buffer = chunk_buffer((last - first) * row_bytes)
            chunk = buffer.array(last - first, width, dtype)
            column, views, sources = 0, [], []
            for part, rows in zip(self.parts, maps, strict=True):
                views.append(chunk[:, column : column + part.shape[1]])
                column += part.shape[1]
                sources.append(None if rows is None else rows[first:last])
                if rows is None:
                    part.read_into(views[-1], start + first, start + last)
            scales = [part.row_scale(start + first, start + last) for part in self.parts]
            scale_blocks(views, scales, sources)
            buffer.write(fd, chunk.nbytes, at + first * row_bytes)

    def _blocks(self, start: int, stop: int) -> list[np.ndarray]:
        """Rows start:stop of each part, read into a new block each and scaled there in place."""
        blocks = [part.read(start, stop, self._work_dtype(), scaled=False) for part in self.parts]
        scale_blocks(blocks, [part.row_scale(start, stop) for part in self.parts])
        return blocks

    def _checked(self, chunk: np.ndarray, rows: int) -> np.ndarray:
        if chunk.nbytes != rows * self._row_bytes():
            raise ValueError(f"{self.name}: a finished chunk of {rows} rows has {chunk.nbytes} bytes")
        return chunk

    def _rows(self) -> int:
        return sum(p.shape[0] for p in self.parts) if self.axis == 0 else self.parts[0].shape[0]

    def _row_bytes(self) -> int:
        """Bytes of one row of the concatenation as stored (after `finish`)."""
        rows = self._rows()
        if rows == 0:
            return 0
        if self.nbytes % rows:
            raise ValueError(f"{self.name}: {self.nbytes} bytes do not split into {rows} rows")
        return self.nbytes // rows

    def _width(self) -> int:
        return sum(p.shape[1] for p in self.parts)

    def _steps(self, rows: int, cols: int, step_bytes: int | None = None) -> Iterator[tuple[int, int]]:
        """Row ranges of about `step_bytes` (default: the chunk size) covering `rows` rows of `cols`."""
        chunk_bytes = self.chunk_bytes if self.chunk_bytes is not None else CHUNK_BYTES
        chunk_bytes = step_bytes or chunk_bytes
        step = max(1, chunk_bytes // max(1, cols * self._work_dtype().itemsize))
        for start in range(0, rows, step):
            yield start, min(start + step, rows)

    def _work_dtype(self) -> np.dtype:
        return _numpy_dtype(self.parts[0].tensor) if self.finish is not None else self._numpy

    def _finished(self, chunk: np.ndarray) -> np.ndarray:
        return self.finish(chunk) if self.finish is not None else chunk

    def _materialize(self) -> ir.TensorProtocol:
        chunks = [chunk.view(np.uint8).reshape(-1) for chunk in self.chunks()]
        array = np.concatenate(chunks).view(self._numpy) if chunks else np.empty(0, self._numpy)
        return ir.tensor(array.reshape(tuple(self.shape)), dtype=self.dtype, name=self.name)
