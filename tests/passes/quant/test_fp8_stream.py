"""FP8 weights are quantized band by band from the file (issue 13): same bytes as the whole-matrix formula."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

import passes.quant.fp8
from passes.quant.calibrate import FP8_MAX
from passes.quant.fp8 import _FP8Weight, channel_scales


def _external(array: np.ndarray, folder) -> ir.ExternalTensor:
    (folder / "w.data").write_bytes(b"\0" * 3 + array.tobytes())
    dtype = ir.DataType.FLOAT if array.dtype == np.float32 else ir.DataType.BFLOAT16
    return ir.ExternalTensor(
        "w.data", 3, array.nbytes, dtype, shape=ir.Shape(array.shape), name="w", base_dir=folder
    )


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_banded_quantization_equals_the_whole_matrix(tmp_path, monkeypatch, transpose, dtype):
    monkeypatch.setattr(passes.quant.fp8, "_BAND_BYTES", 4 * 37)  # a row or two per band
    rng = np.random.default_rng(0)
    stored = (rng.standard_normal((23, 17)) * rng.uniform(0.1, 10, 17)).astype(np.float32).astype(dtype)
    stored[:, 5] = 0  # an all-zero channel keeps scale 1
    tensor = _external(stored, tmp_path)
    matrix = stored.astype(np.float32).T if transpose else stored.astype(np.float32)  # [in, out]
    amax = np.abs(matrix).max(axis=0)
    expected_scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(dtype).astype(np.float32)
    weight_type = ir.DataType.FLOAT if dtype == np.float32 else ir.DataType.BFLOAT16
    scale = channel_scales(tensor, transpose, weight_type)
    np.testing.assert_array_equal(scale, expected_scale)
    fp8 = _FP8Weight(tensor, transpose, scale, "w_fp8")
    expected = np.clip(matrix / expected_scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    buffer = io.BytesIO()
    fp8.tofile(buffer)
    assert buffer.getvalue() == expected.tobytes() and tuple(fp8.shape) == matrix.shape
    assert fp8.numpy().tobytes() == expected.tobytes()
