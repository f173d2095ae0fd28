"""Chunked writing of fused weights (passes/stream_concat.py) against a plain numpy concatenation."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from passes.fuse import _pack, _unpack
from passes.stream_concat import ConcatTensor, Part, scale_rows

DTYPES = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


def _external(array: np.ndarray, folder, name: str) -> ir.ExternalTensor:
    """`array` stored at an odd offset of a data file, as a model's external data would be."""
    path = folder / f"{name}.data"
    path.write_bytes(b"\0" * 7 + array.tobytes())
    dtype = {np.dtype(v.numpy()): v for v in DTYPES.values()}[array.dtype]
    return ir.ExternalTensor(
        path.name, 7, array.nbytes, dtype, shape=ir.Shape(array.shape), name=name, base_dir=folder
    )


def _written(tensor: ConcatTensor) -> bytes:
    buffer = io.BytesIO()
    tensor.tofile(buffer)
    return buffer.getvalue()


def _fold(matrix: np.ndarray, scale: np.ndarray | None, axis: int) -> np.ndarray:
    if scale is None:
        return matrix
    scale = scale[:, None] if axis == 0 else scale[None, :]
    return (matrix.astype(np.float32) * scale).astype(matrix.dtype)


@pytest.mark.parametrize("chunk_bytes", [1, 40, 1000, 1 << 20])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("fold", [False, True])
def test_chunks_equal_numpy_concatenation(tmp_path, chunk_bytes, dtype, axis, fold):
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
    assert _written(tensor) == expected.tobytes()
    assert tensor.numpy().tobytes() == expected.tobytes() and tensor.numpy().dtype == numpy_dtype


def test_a_transposed_part_in_a_mixed_group(tmp_path):
    rng = np.random.default_rng(1)
    stored = rng.standard_normal((5, 4)).astype(np.float32)  # [out, in] of a Transpose(W) layer
    plain = rng.standard_normal((4, 3)).astype(np.float32)  # [in, out]
    parts = [Part(_external(stored, tmp_path, "t"), 5, 4, transpose=True), Part(ir.tensor(plain), 4, 3)]
    tensor = ConcatTensor(parts, 1, ir.DataType.FLOAT, (4, 8), "fused", chunk_bytes=16)
    assert _written(tensor) == np.concatenate([stored.T, plain], axis=1).tobytes()


def test_bfloat16_fold_rounds_once_to_nearest_even(tmp_path):
    matrix = np.array([[1.0, 3.0], [5.0, 7.0]], np.float32).astype(ml_dtypes.bfloat16)
    scale = np.array([1.00390625, 1 / 3], np.float32)
    part = Part(_external(matrix, tmp_path, "b"), 2, 2, scale=scale, scale_axis=0)
    tensor = ConcatTensor([part], 0, ir.DataType.BFLOAT16, (2, 2), "fused", chunk_bytes=4)
    expected = (matrix.astype(np.float32) * scale[:, None]).astype(ml_dtypes.bfloat16)
    assert _written(tensor) == expected.tobytes()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_fields_concatenate_along_k(bits):
    """int4 zero points of parts whose block counts are odd: unpacked per chunk, concatenated, repacked."""
    rng = np.random.default_rng(bits)
    fields = [rng.integers(0, 1 << bits, size=(6, count), dtype=np.uint8) for count in (3, 5, 2)]
    packed = [_pack(f, bits) for f in fields]
    assert all(
        np.array_equal(_unpack(p, bits)[:, : f.shape[1]], f) for p, f in zip(packed, fields, strict=True)
    )
    parts = [
        Part(p, 6, p.shape[1], transform=lambda c, n=f.shape[1]: _unpack(c, bits)[:, :n], width=f.shape[1])
        for p, f in zip(packed, fields, strict=True)
    ]
    expected = _pack(np.concatenate(fields, axis=1), bits)
    tensor = ConcatTensor(
        parts, 1, ir.DataType.UINT8, (expected.size,), "zp", finish=lambda c: _pack(c, bits), chunk_bytes=3
    )
    assert _written(tensor) == expected.tobytes()


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


def test_float16_fold_equals_numpy_bit_for_bit():
    """Every float16 bit pattern (subnormals, infinities, NaNs) times scales that round, overflow to
    infinity and underflow to subnormals or zero: scale_rows (ONNX Runtime's casts) gives numpy's bits,
    float16(float32(w) * float32(g)), on rows (one scale per row) and on columns, contiguous or a view."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    specials = [1.0, 1 / 3, 1.00390625, -0.7, 0.0, -0.0, 1e-30, 3e-8, 7.3e-5, 1e5, 65504.0, np.inf, np.nan]
    scales = np.array(specials, np.float32)
    rng = np.random.default_rng(7)
    no_nan = np.resize(scales[:-1], 256)
    for scale in (np.resize(scales, 256), no_nan, rng.uniform(-3, 3, 256).astype(np.float32)):
        for axis in (0, 1):
            g = scale[:, None] if axis == 0 else scale[None, :]
            with np.errstate(all="ignore"):
                expected = (bits.astype(np.float32) * g).astype(np.float16)
            out = bits.copy()
            wide = np.zeros((256, 300), np.float16)  # a column slice of a wider chunk (gate/up interleave)
            wide[:, 20:276] = bits
            with np.errstate(all="ignore"):  # numpy's path (NaN scales) warns of inf * 0
                scale_rows(out, g)
                scale_rows(wide[:, 20:276], g)
            assert out.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()
            assert wide[:, 20:276].view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()
            assert not wide[:, :20].any() and not wide[:, 276:].any()
