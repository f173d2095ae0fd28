"""Chunked writing of fused weights (passes/io/stream_concat.py, written by passes/io/tensor_writer.py)
against a plain numpy concatenation."""

from __future__ import annotations

import concurrent.futures
import errno
import io
import itertools
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from passes.io import stream_concat, tensor_writer
from passes.io.stream_concat import ConcatTensor, Part, scale_blocks, scale_rows
from passes.patterns.nbits import pack, unpack

DTYPES = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


def _external(array: np.ndarray, folder, name: str) -> ir.ExternalTensor:
    """`array` stored at an odd offset of a data file, as a model's external data would be."""
    path = folder / f"{name}.data"
    path.write_bytes(b"\0" * 7 + array.tobytes())
    dtype = {np.dtype(v.numpy()): v for v in DTYPES.values()}[array.dtype]
    return ir.ExternalTensor(
        path.name, 7, array.nbytes, dtype, shape=ir.Shape(array.shape), name=name, base_dir=folder
    )


def _written(tensor: ConcatTensor, folder=None) -> bytes:
    """What `tofile` writes: into a stream (in order), or, given a folder, into a regular file between other
    bytes (jobs that write their own ranges, on two threads)."""
    if folder is None:
        buffer = io.BytesIO()
        tensor.tofile(buffer)
        return buffer.getvalue()
    path = folder / "out.bin"
    with open(path, "wb") as file:
        file.write(b"head")
        tensor.tofile(file)
        file.write(b"tail")
    data = path.read_bytes()
    assert data[:4] == b"head" and data[-4:] == b"tail"
    return data[4:-4]


def _fold(matrix: np.ndarray, scale: np.ndarray | None, axis: int) -> np.ndarray:
    if scale is None:
        return matrix
    scale = scale[:, None] if axis == 0 else scale[None, :]
    return (matrix.astype(np.float32) * scale).astype(matrix.dtype)


@pytest.mark.parametrize("chunk_bytes", [1, 40, 1000, 1 << 20])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("sink", ["stream", "file"])
def test_chunks_equal_numpy_concatenation(tmp_path, chunk_bytes, dtype, axis, fold, sink):
    rng = np.random.default_rng(len(dtype) + axis)
    numpy_dtype = np.dtype(DTYPES[dtype].numpy())
    # Parts: external, in memory, and a column range of a wider external matrix (a gate_up half).
    shapes = [(6, 5), (6, 3)] if axis == 1 else [(4, 7), (3, 7)]
    mats = [rng.standard_normal(s).astype(np.float32).astype(numpy_dtype) for s in shapes]
    wide = rng.standard_normal((6, 9) if axis == 1 else (2, 14)).astype(np.float32).astype(numpy_dtype)
    cols = (2, 6) if axis == 1 else (3, 10)
    scale_axis = 0 if axis == 1 else 1  # "fold" scales the input dimension: rows of [in, out], else columns
    scales = [
        rng.uniform(0.5, 1.5, m.shape[scale_axis]).astype(np.float32) if fold else None
        for m in (*mats, wide[:, cols[0] : cols[1]])
    ]
    parts = [
        Part(_external(mats[0], tmp_path, "a"), *shapes[0], scale=scales[0], scale_axis=scale_axis),
        Part(ir.tensor(mats[1]), *shapes[1], scale=scales[1], scale_axis=scale_axis),
        Part(
            _external(wide, tmp_path, "w"),
            *wide.shape,
            col_range=cols,
            scale=scales[2],
            scale_axis=scale_axis,
        ),
    ]
    expected = np.concatenate(
        [_fold(m, s, scale_axis) for m, s in zip((*mats, wide[:, cols[0] : cols[1]]), scales, strict=True)],
        axis=axis,
    )
    tensor = ConcatTensor(parts, axis, DTYPES[dtype], expected.shape, "fused", chunk_bytes=chunk_bytes)
    assert _written(tensor, tmp_path if sink == "file" else None) == expected.tobytes()
    assert tensor.numpy().tobytes() == expected.tobytes() and tensor.numpy().dtype == numpy_dtype


def test_a_transposed_part_in_a_mixed_group(tmp_path):
    rng = np.random.default_rng(1)
    stored = rng.standard_normal((5, 4)).astype(np.float32)  # [out, in] of a Transpose(W) layer
    plain = rng.standard_normal((4, 3)).astype(np.float32)  # [in, out]
    parts = [Part(_external(stored, tmp_path, "t"), 5, 4, transpose=True), Part(ir.tensor(plain), 4, 3)]
    tensor = ConcatTensor(parts, 1, ir.DataType.FLOAT, (4, 8), "fused", chunk_bytes=16)
    assert _written(tensor) == np.concatenate([stored.T, plain], axis=1).tobytes()


def test_a_transposed_part_cut_short_is_an_error(tmp_path):
    """Columns are read through a map of a band of rows: a data file too short for the band says so (Python's
    mmap alone raises a ValueError there, which the tools would report as an internal error)."""
    stored = np.arange(20, dtype=np.float32).reshape(5, 4)
    parts = [Part(_external(stored, tmp_path, "t"), 5, 4, transpose=True)]
    path = tmp_path / "t.data"
    path.write_bytes(path.read_bytes()[:-8])
    tensor = ConcatTensor(parts, 1, ir.DataType.FLOAT, (4, 5), "fused", chunk_bytes=16)
    with pytest.raises(OSError, match=r"t\.data: external data ends early"):
        _written(tensor, tmp_path)


def test_bfloat16_fold_rounds_once_to_nearest_even(tmp_path):
    matrix = np.array([[1.0, 3.0], [5.0, 7.0]], np.float32).astype(ml_dtypes.bfloat16)
    scale = np.array([1.00390625, 1 / 3], np.float32)
    part = Part(_external(matrix, tmp_path, "b"), 2, 2, scale=scale, scale_axis=0)
    tensor = ConcatTensor([part], 0, ir.DataType.BFLOAT16, (2, 2), "fused", chunk_bytes=4)
    expected = (matrix.astype(np.float32) * scale[:, None]).astype(ml_dtypes.bfloat16)
    assert _written(tensor) == expected.tobytes()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sink", ["stream", "file"])
def test_packed_fields_concatenate_along_k(tmp_path, bits, sink):
    """int4 zero points of parts whose block counts are odd: unpacked per chunk, concatenated, repacked."""
    rng = np.random.default_rng(bits)
    fields = [rng.integers(0, 1 << bits, size=(6, count), dtype=np.uint8) for count in (3, 5, 2)]
    packed = [pack(f, bits) for f in fields]
    assert all(
        np.array_equal(unpack(p, bits)[:, : f.shape[1]], f) for p, f in zip(packed, fields, strict=True)
    )
    parts = [
        Part(p, 6, p.shape[1], transform=lambda c, n=f.shape[1]: unpack(c, bits)[:, :n], width=f.shape[1])
        for p, f in zip(packed, fields, strict=True)
    ]
    expected = pack(np.concatenate(fields, axis=1), bits)
    tensor = ConcatTensor(
        parts, 1, ir.DataType.UINT8, (expected.size,), "zp", finish=lambda c: pack(c, bits), chunk_bytes=3
    )
    assert _written(tensor, tmp_path if sink == "file" else None) == expected.tobytes()


def test_plain_parts_are_copied_file_to_file(tmp_path):
    """Unscaled whole parts one after the other: kernel copies into the open data file, at its position."""
    rng = np.random.default_rng(3)
    mats = [rng.standard_normal((r, 6)).astype(np.float32) for r in (5, 2)]
    parts = [Part(_external(m, tmp_path, f"p{i}"), *m.shape) for i, m in enumerate(mats)]
    assert all(p.file_range() is not None for p in parts)
    tensor = ConcatTensor(parts + [Part(ir.tensor(mats[0]), 5, 6)], 0, ir.DataType.FLOAT, (12, 6), "f")
    with open(tmp_path / "out.data", "wb") as file:
        file.write(b"head")
        tensor.tofile(file)
        file.write(b"tail")
    expected = b"head" + np.concatenate([*mats, mats[0]]).tobytes() + b"tail"
    assert (tmp_path / "out.data").read_bytes() == expected


@pytest.fixture(params=["native", "onnxruntime"])
def half_path(request, monkeypatch):
    """float16 scaled by passes/io/_half_scale.c, or by ONNX Runtime's casts (where it is not built)."""
    native = request.param == "native"
    if native:
        assert stream_concat._half_scale is not None, "passes/io/_half_scale.c is not built: pip install -e ."
        if not stream_concat._half_scale.supported():
            pytest.skip("this CPU has no AVX2 and F16C")
        calls = []
        module = stream_concat._half_scale
        scale = lambda *args: calls.append(args) or module.scale(*args)  # noqa: E731
        counted = SimpleNamespace(supported=module.supported, scale=scale)
        monkeypatch.setattr(stream_concat, "_half_scale", counted)
        request.node.native_calls = calls
    monkeypatch.setattr(stream_concat, "_NATIVE_HALF", native)
    return request.param


@pytest.mark.parametrize("cols", [256, 251])
def test_float16_fold_equals_numpy_bit_for_bit(half_path, request, cols):
    """Every float16 bit pattern (subnormals, infinities, NaNs) times scales that round, overflow to
    infinity and underflow to subnormals or zero: scale_rows (the C module, or ONNX Runtime's casts) gives
    numpy's bits, float16(float32(w) * float32(g)), on rows (one scale per row) and on columns, contiguous
    or a view; 251 columns leave a tail shorter than 8 lanes. The one difference: ONNX Runtime, scaling a
    view row by row, returns the canonical NaN for a NaN weight among a row's last cols % 8 (MLAS converts
    those one at a time), where numpy and the C module keep its payload."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)[:, :cols]
    specials = [1.0, 1 / 3, 1.00390625, -0.7, 0.0, -0.0, 1e-30, 3e-8, 7.3e-5, 1e5, 65504.0, np.inf, np.nan]
    scales = np.array(specials, np.float32)
    rng = np.random.default_rng(7)
    no_nan = np.resize(scales[:-1], 256)
    for scale in (np.resize(scales, 256), no_nan, rng.uniform(-3, 3, 256).astype(np.float32)):
        for axis in (0, 1):
            g = scale[:, None] if axis == 0 else scale[None, :cols]
            with np.errstate(all="ignore"):
                expected = (bits.astype(np.float32) * g).astype(np.float16)
            out = bits.copy()
            wide = np.zeros((256, 300), np.float16)  # a column slice of a wider chunk (gate/up interleave)
            wide[:, 20 : 20 + cols] = bits
            with np.errstate(all="ignore"):  # numpy's path (NaN scales) warns of inf * 0
                scale_rows(out, g)
                scale_rows(wide[:, 20 : 20 + cols], g)
            assert out.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()
            view = wide[:, 20 : 20 + cols]
            if half_path == "onnxruntime":  # row by row: MLAS converts a row's last cols % 8 values one
                view[np.isnan(view) & np.isnan(expected)] = np.nan  # at a time, to the canonical NaN
                expected[np.isnan(expected)] = np.nan
            assert view.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()
            assert not wide[:, :20].any() and not wide[:, 20 + cols :].any()
    if half_path == "native":  # the scales without NaN (NaN: numpy decides), block and view, both axes
        assert len(request.node.native_calls) == 2 * 2 * 2


@pytest.mark.parametrize("cols", [256, 251])
def test_bfloat16_fold_equals_numpy_bit_for_bit(half_path, request, cols):
    """Every bfloat16 bit pattern times scales that round, overflow and underflow: scale_rows (the C module,
    or numpy with ml_dtypes) gives numpy's bits, bfloat16(float32(w) * float32(g)) (a NaN: 0x7FC0 with its
    sign), on rows and on columns, contiguous or a view, with a tail shorter than 8 lanes."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256)[:, :cols]
    specials = [1.0, 1 / 3, 1.00390625, -0.7, 0.0, -0.0, 1e-30, 3e-39, 1e-45, 3e38, np.inf]
    rng = np.random.default_rng(8)
    for scale in (np.resize(np.array(specials, np.float32), 256), rng.uniform(-3, 3, 256).astype(np.float32)):
        for axis in (0, 1):
            g = scale[:, None] if axis == 0 else scale[None, :cols]
            with np.errstate(all="ignore"):
                expected = (bits.astype(np.float32) * g).astype(ml_dtypes.bfloat16)
                out = bits.copy()
                wide = np.zeros((256, 300), ml_dtypes.bfloat16)
                wide[:, 20 : 20 + cols] = bits
                scale_rows(out, g)
                scale_rows(wide[:, 20 : 20 + cols], g)
            assert out.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()
            assert wide[:, 20 : 20 + cols].view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()
            assert not wide[:, :20].view(np.uint16).any() and not wide[:, 20 + cols :].view(np.uint16).any()
    if half_path == "native":
        assert len(request.node.native_calls) == 2 * 2 * 2


@pytest.mark.parametrize("half_run", [64, 4])
def test_a_chunks_blocks_are_scaled_together_as_each_alone(monkeypatch, half_path, request, half_run):
    """scale_blocks: float16 and bfloat16 blocks with contiguous rows by the C module, one call each; without
    it, float16 in
    ONNX Runtime runs of at most _HALF_RUN blocks or rows (a view of a wider chunk row by row, each row where
    it lies). A view whose rows are not contiguous through a copy, in ONNX Runtime either way; the others
    (bfloat16, float32, a NaN scale) in numpy, a None scale left alone: each block's bits as numpy gives
    them, the columns around the views untouched."""
    rng = np.random.default_rng(3)
    runs = []
    fold = stream_concat._half_fold
    monkeypatch.setattr(stream_concat, "_HALF_RUN", half_run)
    monkeypatch.setattr(stream_concat, "_half_fold", lambda pair: runs.append(len(pair)) or fold(pair))
    wide = rng.standard_normal((5, 40)).astype(np.float16)
    around = wide.copy()
    column_scale = rng.uniform(-2, 2, (1, 8)).astype(np.float32)  # scaled along the other axis
    blocks = [
        rng.standard_normal((5, 7)).astype(np.float16),
        wide[:, 3:11],  # a strided view, its rows contiguous
        wide[:, 20:36:2],  # a view whose rows are not contiguous
        rng.standard_normal((5, 9)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((5, 4)).astype(np.float32),
        rng.standard_normal((5, 6)).astype(np.float16),  # NaN scale: numpy decides
        rng.standard_normal((5, 3)).astype(np.float16),  # no scale
    ]
    expected_blocks = [b.copy() for b in blocks]
    scales = [rng.uniform(-2, 2, (5, 1)).astype(np.float32) for _ in blocks]
    scales[2] = column_scale
    scales[5][2] = np.nan
    scales[6] = None
    with np.errstate(invalid="ignore"):
        pairs = zip(expected_blocks, scales, strict=True)
        expected = [b if g is None else (b.astype(np.float32) * g).astype(b.dtype) for b, g in pairs]
        scale_blocks(blocks, scales)
    if half_path == "native":  # the block, the view and bfloat16; the strided view (copied) in one run
        assert len(request.node.native_calls) == 3 and runs == [1]
    else:  # float16 with finite scales: the block, the view's 5 rows, the strided view (one more run)
        assert sum(runs) == 1 + 5 + 1 and max(runs) <= half_run
        assert len(runs) == (2 if half_run == 64 else 3)
    for block, want in zip(blocks, expected, strict=True):
        assert block.tobytes() == want.tobytes()
    assert wide[:, 3:11].tobytes() == expected[1].tobytes()
    assert wide[:, 20:36:2].tobytes() == expected[2].tobytes()
    untouched = np.ones(40, bool)
    untouched[3:11] = untouched[20:36:2] = False
    assert wide[:, untouched].tobytes() == around[:, untouched].tobytes()


def _copy_calls(monkeypatch) -> list[int]:
    """Lengths of the kernel copies made from now on."""
    calls: list[int] = []
    copy = os.copy_file_range

    def counted(source, target, count, *offsets):
        calls.append(count)
        return copy(source, target, count, *offsets)

    monkeypatch.setattr(os, "copy_file_range", counted)
    return calls


@pytest.mark.parametrize(("chunk_bytes", "band_bytes"), [(None, None), (50, None), (50, 130)])
def test_interleaved_plain_rows_are_read_into_a_chunk_and_sent_in_one_call(
    tmp_path, monkeypatch, chunk_bytes, band_bytes
):
    """ "last" gate/up: every output row is the parts' rows side by side. Plain external rows (one of them a
    row range of a taller matrix, at odd offsets and odd row lengths) are read by preadv straight into
    their columns of the chunk (BAND_BYTES a job; 130: several jobs of several chunks), and each chunk goes
    into the file, between other bytes, by one sendfile from the thread's memfd: no kernel copy per row
    segment (slower), no pwritev, no map of the sources."""
    if band_bytes is not None:
        monkeypatch.setattr(stream_concat, "BAND_BYTES", band_bytes)
    rng = np.random.default_rng(11)
    mats = [rng.standard_normal((9, c)).astype(np.float16) for c in (5, 3)]
    tall = rng.standard_normal((13, 7)).astype(np.float16)
    parts = [
        Part(_external(mats[0], tmp_path, "a"), 9, 5),
        Part(_external(tall, tmp_path, "t"), 13, 7, row_range=(3, 12)),
        Part(_external(mats[1], tmp_path, "b"), 9, 3),
    ]
    expected = np.concatenate([mats[0], tall[3:12], mats[1]], axis=1)
    tensor = ConcatTensor(parts, 1, ir.DataType.FLOAT16, expected.shape, "gate", chunk_bytes=chunk_bytes)
    calls = _copy_calls(monkeypatch)
    reads = _preadv_calls(monkeypatch)
    writes = _recorded_writes(monkeypatch, small_jobs=False)
    assert _written(tensor, tmp_path) == expected.tobytes()
    chunks = 1 if chunk_bytes is None else -(-9 // (50 // (15 * 2)))  # rows per chunk: 50 // row bytes
    assert calls == [] and len(reads) == 3 * chunks
    assert [kind for kind, _ in writes] == ["sendfile"] * chunks
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("failure", ["no memfd", "memfd refused", "sendfile refused"])
def test_chunks_without_memfd_or_sendfile_are_written_from_memory(tmp_path, monkeypatch, failure):
    """Where there is no memfd (not Linux, or a sandbox refuses the call), or sendfile refuses the output
    file, the chunk's bytes go from plain memory with pwritev: the same bytes."""
    if failure == "no memfd":
        monkeypatch.delattr(os, "memfd_create")
    elif failure == "memfd refused":

        def denied(*args):
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "memfd_create", denied)
    else:

        def refused(*args):
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(os, "sendfile", refused)
    monkeypatch.setattr(tensor_writer, "_THREAD", threading.local())  # no chunk buffer made before
    rng = np.random.default_rng(14)
    mats = [rng.standard_normal((9, c)).astype(np.float32) for c in (5, 3)]
    scale = rng.uniform(0.5, 1.5, 9).astype(np.float32)
    parts = [
        Part(_external(mats[0], tmp_path, "a"), 9, 5, scale=scale),
        Part(_external(mats[1], tmp_path, "b"), 9, 3),
    ]
    expected = np.concatenate([_fold(mats[0], scale, 0), mats[1]], axis=1)
    tensor = ConcatTensor(parts, 1, ir.DataType.FLOAT, expected.shape, "gate", chunk_bytes=64)
    writes = _recorded_writes(monkeypatch, small_jobs=False)
    assert _written(tensor, tmp_path) == expected.tobytes()
    refused = {"sendfile"} if failure == "sendfile refused" else set()  # tried for each chunk, refused
    assert {kind for kind, _ in writes} == {"pwritev"} | refused


def _preadv_calls(monkeypatch) -> list[tuple[str, int]]:
    """(file, offset) of each preadv from now on."""
    calls: list[tuple[str, int]] = []
    preadv = os.preadv

    def counted(fd, buffers, offset):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    return calls


def test_plain_parts_one_after_the_other_are_copied_by_the_kernel_in_pieces(tmp_path, monkeypatch):
    """Down: unscaled whole parts are kernel copies of COPY_BYTES each (several jobs, any order)."""
    monkeypatch.setattr(tensor_writer, "COPY_BYTES", 64)
    rng = np.random.default_rng(16)
    mats = [rng.standard_normal((r, 6)).astype(np.float32) for r in (5, 7)]
    parts = [Part(_external(m, tmp_path, f"p{i}"), *m.shape) for i, m in enumerate(mats)]
    tensor = ConcatTensor(parts, 0, ir.DataType.FLOAT, (12, 6), "down")
    calls = _copy_calls(monkeypatch)
    assert _written(tensor, tmp_path) == np.concatenate(mats).tobytes()
    assert sum(calls) == 12 * 6 * 4 and max(calls) == 64


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("band_bytes", [None, 60])
def test_scaled_rows_are_scaled_from_their_maps_into_the_chunk(tmp_path, monkeypatch, dtype, band_bytes):
    """ "fold" on some parts only: a scaled part is scaled from its rows of the band, mapped, straight into
    its columns of the chunk (float16 row by row: ONNX Runtime takes contiguous buffers, and a part's
    columns are not), with no read into a buffer first; the unscaled part is read into its columns. In one
    job or in several; no map outlives the write."""
    if band_bytes is not None:
        monkeypatch.setattr(stream_concat, "BAND_BYTES", band_bytes)
    rng = np.random.default_rng(12)
    mats = [rng.standard_normal((6, c)).astype(dtype) for c in (4, 5)]
    scale = rng.uniform(0.5, 1.5, 6).astype(np.float32)
    scales = [scale, None]
    parts = [Part(_external(m, tmp_path, f"m{i}"), *m.shape, scale=scales[i]) for i, m in enumerate(mats)]
    expected = np.concatenate([_fold(m, s, 0) for m, s in zip(mats, scales, strict=True)], axis=1)
    tensor = ConcatTensor(parts, 1, DTYPES[dtype], expected.shape, "gate", chunk_bytes=40)
    reads = _preadv_calls(monkeypatch)
    assert _written(tensor, tmp_path) == expected.tobytes()
    assert {Path(path).name for path, _ in reads} == {"m1.data"}
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("axis", [0, 1])
def test_without_kernel_copies_the_same_bytes_go_through_a_buffer(tmp_path, monkeypatch, axis):
    """copy_file_range refused (another file system, an old kernel): the same bytes, through a buffer."""

    def refused(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refused)
    rng = np.random.default_rng(13)
    shapes = [(5, 6), (5, 4)] if axis == 1 else [(3, 6), (4, 6)]
    mats = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    parts = [Part(_external(m, tmp_path, f"m{i}"), *m.shape) for i, m in enumerate(mats)]
    expected = np.concatenate(mats, axis=axis)
    tensor = ConcatTensor(parts, axis, ir.DataType.FLOAT, expected.shape, "w")
    assert _written(tensor, tmp_path) == expected.tobytes()


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("fold", [False, True])
def test_external_data_cut_short_is_an_error(tmp_path, monkeypatch, axis, fold):
    """A data file shorter than its tensors says so, whichever path reads it (kernel copy, rows, chunks)."""
    rng = np.random.default_rng(14)
    mats = [rng.standard_normal((8, 6)).astype(np.float32) for _ in range(2)]
    parts = [Part(_external(m, tmp_path, f"m{i}"), 8, 6) for i, m in enumerate(mats)]
    if fold:
        parts = [
            Part(p.tensor, 8, 6, scale=np.ones(6 if axis == 0 else 8, np.float32), scale_axis=1 - axis)
            for p in parts
        ]
    path = tmp_path / "m1.data"
    path.write_bytes(path.read_bytes()[:-30])
    shape = (16, 6) if axis == 0 else (8, 12)
    tensor = ConcatTensor(parts, axis, ir.DataType.FLOAT, shape, "w", chunk_bytes=48)
    with pytest.raises(OSError, match=r"m1\.data: external data ends early"):  # names the file
        _written(tensor, tmp_path)


@pytest.mark.parametrize("libc", ["absent", "failing"])
def test_without_fallocate_the_file_is_written_the_same(tmp_path, monkeypatch, libc):
    """Allocating the range first is only a hint: no fallocate, or one that fails, writes the same bytes."""

    class Failing:
        @staticmethod
        def fallocate(*args):
            return -1

    monkeypatch.setattr(tensor_writer, "_libc", lambda: None if libc == "absent" else Failing())
    rng = np.random.default_rng(15)
    mats = [rng.standard_normal((5, 6)).astype(np.float16) for _ in range(2)]
    parts = [Part(_external(m, tmp_path, f"m{i}"), 5, 6) for i, m in enumerate(mats)]
    tensor = ConcatTensor(parts, 1, ir.DataType.FLOAT16, (5, 12), "w", chunk_bytes=30)
    assert _written(tensor, tmp_path) == np.concatenate(mats, axis=1).tobytes()


@pytest.mark.parametrize("axis", [0, 1])
def test_an_empty_concatenation_writes_nothing(tmp_path, axis):
    mats = [np.zeros((0, 4), np.float32) for _ in range(2)]
    parts = [Part(_external(m, tmp_path, f"m{i}"), *m.shape) for i, m in enumerate(mats)]
    shape = (0, 8) if axis == 1 else (0, 4)
    assert _written(ConcatTensor(parts, axis, ir.DataType.FLOAT, shape, "w"), tmp_path) == b""


def _tensors(tmp_path) -> tuple[list[ir.TensorProtocol], list[bytes]]:
    """One of each kind a saved model holds: a fused ("fold") gate, a plain external weight, an in-memory
    tensor and a lazy one (as FP8 weights are), with the bytes each must write."""
    rng = np.random.default_rng(17)
    mats = [rng.standard_normal((40, c)).astype(np.float16) for c in (6, 10)]
    scale = rng.uniform(0.5, 1.5, 40).astype(np.float32)
    gate = ConcatTensor(
        [Part(_external(m, tmp_path, f"g{i}"), *m.shape, scale=scale) for i, m in enumerate(mats)],
        1, ir.DataType.FLOAT16, (40, 16), "gate", chunk_bytes=64,
    )  # fmt: skip
    plain = rng.standard_normal((50, 8)).astype(np.float32)
    small = rng.standard_normal(5).astype(np.float32)
    lazy = rng.standard_normal((3, 4)).astype(np.float32)
    tensors = [
        gate,
        _external(plain, tmp_path, "plain"),
        ir.tensor(small, name="small"),
        ir.LazyTensor(lambda: ir.tensor(lazy), dtype=ir.DataType.FLOAT, shape=ir.Shape([3, 4]), name="lazy"),
    ]
    gate_bytes = np.concatenate([_fold(m, scale, 0) for m in mats], axis=1).tobytes()
    return tensors, [gate_bytes, plain.tobytes(), small.tobytes(), lazy.tobytes()]


@pytest.mark.parametrize("sink", ["stream", "file"])
def test_write_tensors_writes_each_tensor_at_its_offset(tmp_path, monkeypatch, sink):
    """A model's data file: the tensors one after the other, from where the file stands, at the offsets
    returned, whatever their kind (jobs of all of them on two threads into a file; in order into a
    stream)."""
    monkeypatch.setattr(tensor_writer, "COPY_BYTES", 96)
    tensors, expected = _tensors(tmp_path)
    if sink == "stream":
        file = io.BytesIO(b"head")
        file.seek(4)
        offsets = tensor_writer.write_tensors(file, tensors)
        data = file.getvalue()
    else:
        with open(tmp_path / "out.data", "wb") as file:
            file.write(b"head")
            offsets = tensor_writer.write_tensors(file, tensors)
            assert file.tell() == 4 + sum(map(len, expected))
        data = (tmp_path / "out.data").read_bytes()
    assert data == b"head" + b"".join(expected)
    assert offsets == [4 + sum(map(len, expected[:i])) for i in range(len(expected))]


def _recorded_writes(monkeypatch, small_jobs: bool = True) -> list[tuple[str, int]]:
    """Each write call as it comes: ("pwritev", fd) for a write from memory, ("sendfile", fd) for a chunk
    sent from its memfd, ("copy", fd) for a kernel copy; with `small_jobs`, small jobs on one worker (the
    jobs' own order)."""
    if small_jobs:
        monkeypatch.setattr(tensor_writer, "COPY_BYTES", 96)
        monkeypatch.setattr(stream_concat, "BAND_BYTES", 64)
        monkeypatch.setattr(tensor_writer, "_WORKERS", 1)
    writes: list[tuple[str, int]] = []
    pwritev, copy, sendfile = os.pwritev, os.copy_file_range, os.sendfile

    def sent(fd, *args):
        writes.append(("sendfile", fd))
        return sendfile(fd, *args)

    def written(fd, buffers, offset):
        writes.append(("pwritev", fd))
        return pwritev(fd, buffers, offset)

    def copied(source, fd, *args):
        writes.append(("copy", fd))
        return copy(source, fd, *args)

    monkeypatch.setattr(os, "pwritev", written)
    monkeypatch.setattr(os, "copy_file_range", copied)
    monkeypatch.setattr(os, "sendfile", sent)
    return writes


def _longest_run(items: list) -> int:
    return max(len(list(group)) for _, group in itertools.groupby(items))


def test_write_tensors_interleaves_the_tensors_in_proportion(tmp_path, monkeypatch):
    """The writes of a fused gate (chunks scaled in memory) and of a plain weight (kernel copies) alternate,
    each tensor advancing in proportion to its size, so one thread copies while the other scales."""
    writes = _recorded_writes(monkeypatch)
    tensors, expected = _tensors(tmp_path)
    with open(tmp_path / "out.data", "wb") as file:
        tensor_writer.write_tensors(file, tensors[:2])
    assert (tmp_path / "out.data").read_bytes() == b"".join(expected[:2])
    # 1280 bytes of gate in jobs of 64 (two rows): 20 writes; 1600 of plain in copies of 96: 17
    kinds = [kind for kind, _ in writes]
    assert kinds.count("copy") == 17 and kinds.count("sendfile") == 20 and _longest_run(kinds) <= 3, kinds


def test_write_files_writes_each_file_and_alternates_between_them(tmp_path, monkeypatch):
    """A model's data in several files, written at once: each file gets its tensors from where it stands,
    at the offsets returned, and the jobs alternate between the files (each advancing in proportion to its
    size), so that the two threads mostly write different files, which the kernel lets go on together."""
    writes = _recorded_writes(monkeypatch)
    tensors, expected = _tensors(tmp_path)
    with open(tmp_path / "a.data", "wb") as first, open(tmp_path / "b.data", "wb") as second:
        first.write(b"head")
        offsets = tensor_writer.write_files([(first, tensors[:1]), (second, tensors[1:])])
        assert (first.tell(), second.tell()) == (4 + len(expected[0]), sum(map(len, expected[1:])))
        fds = (first.fileno(), second.fileno())
    assert (tmp_path / "a.data").read_bytes() == b"head" + expected[0]
    assert (tmp_path / "b.data").read_bytes() == b"".join(expected[1:])
    assert offsets == [[4], [0, len(expected[1]), len(expected[1]) + len(expected[2])]]
    # 20 writes of gate (1280 bytes in jobs of 64) against 17 copies of plain (1600 in 96) and two small
    files = [fd for _, fd in writes]
    assert set(files) == set(fds) and len(files) == 20 + 17 + 2 and _longest_run(files) <= 3, files


def test_no_write_call_copies_more_than_write_bytes(tmp_path, monkeypatch):
    """Every pwritev copies at most WRITE_BYTES from user memory (larger writes get large page-cache folios,
    10-15x slower per byte on the VM measured) and takes at most IOV_MAX buffers, whatever the pieces: one
    large buffer, many small ones, or both; the bytes land in order."""
    monkeypatch.setattr(tensor_writer, "WRITE_BYTES", 1000)
    monkeypatch.setattr(tensor_writer, "IOV_MAX", 7)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in [4321, 3, 999, 1, 1000, *[17] * 40, 2500]]
    calls: list[tuple[int, int]] = []
    pwritev = os.pwritev

    def recorded(fd, buffers, offset):
        calls.append((sum(len(b) for b in buffers), len(buffers)))
        return pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", recorded)
    with open(tmp_path / "out.data", "wb") as file:
        tensor_writer.pwrite_all(file.fileno(), arrays, 5)
    assert (tmp_path / "out.data").read_bytes() == b"\0" * 5 + b"".join(a.tobytes() for a in arrays)
    assert max(size for size, _ in calls) == 1000 and max(count for _, count in calls) <= 7
    assert sum(size for size, _ in calls) == sum(a.size for a in arrays)


def test_chunk_buffers_are_reused_per_thread_and_grow():
    """A thread builds chunk after chunk in the same buffer (new memory per chunk faulted in every page
    again); a larger chunk grows it; threads never share one."""
    first = tensor_writer.chunk_buffer(100)
    assert tensor_writer.chunk_buffer(50) is first and first.nbytes >= tensor_writer.BUFFER_BYTES
    grown = tensor_writer.chunk_buffer(first.nbytes + 1)
    assert grown is not first and grown.nbytes == first.nbytes + 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(tensor_writer.chunk_buffer, 10).result()
    assert theirs is not grown


def test_a_float16_view_with_strided_rows_is_scaled_without_touching_its_source():
    """A float16 block whose rows are not contiguous goes through a contiguous copy of its source; the
    source (the data file's read-only map, in the fusion) is never written, even when it is contiguous."""
    rng = np.random.default_rng(21)
    source = rng.standard_normal((4, 6)).astype(np.float16)
    source.flags.writeable = False
    kept = source.copy()
    wide = np.zeros((4, 12), np.float16)
    block = wide[:, ::2]
    scale = rng.uniform(0.5, 1.5, (4, 1)).astype(np.float32)
    scale_blocks([block], [scale], [source])
    assert source.tobytes() == kept.tobytes()
    assert block.tobytes() == (kept.astype(np.float32) * scale).astype(np.float16).tobytes()
    assert not wide[:, 1::2].any()


def test_a_concatenation_prints_without_evaluating():
    """repr names the tensor, its shape and parts, and builds nothing (LazyTensor's repr printed its own
    bound method: endless recursion whenever a fused graph or one of its values was printed)."""
    tensor = ConcatTensor(
        [Part(np.ones((2, 3), np.float32), 2, 3), Part(np.ones((2, 5), np.float32), 2, 5)],
        1,
        ir.DataType.FLOAT,
        (2, 8),
        "gate",
    )
    assert repr(tensor) == "ConcatTensor('gate', FLOAT, [2, 8], 2 parts along axis 1)"
    assert "gate" in str(ir.Value(name="gate", const_value=tensor))
