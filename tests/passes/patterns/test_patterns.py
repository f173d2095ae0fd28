"""Every RMSNorm and SwiGLU form of DESIGN 3 is recognized, fused, and checked by numbers."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from exporters.synthetic import FFNS, NORMS, SyntheticSpec, build_synthetic
from passes.blocks import find_blocks
from passes.model_io import load_model
from passes.pipeline import fuse_file
from passes.plan import Plan

WIDTHS = [48, 64, 40, 24]


def spec_for(norm: str, ffn: str, **overrides) -> SyntheticSpec:
    attention = norm != "skip_simplified_ln"  # the Skip form fuses the residual add into the next norm
    blocks = [(attention, WIDTHS[0])] + [(False, w) for w in WIDTHS[1:]]
    opset = 23 if norm == "rmsnorm_op" else 18
    return SyntheticSpec(norm=norm, ffn=ffn, blocks=blocks, opset=overrides.pop("opset", opset), **overrides)


@pytest.mark.parametrize("ffn", FFNS)
@pytest.mark.parametrize("norm", NORMS)
def test_pattern_is_recognized_and_fuses_exactly(tmp_path, norm, ffn):
    spec = spec_for(norm, ffn)
    path = build_synthetic(spec, tmp_path / "model.onnx")
    blocks = find_blocks(load_model(path))
    assert [b.width for b in blocks] == WIDTHS
    assert [b.attention for b in blocks] == [a for a, _ in spec.blocks]
    expected_kind = "decomposed" if norm in ("pow_reciprocal", "mul_div", "pow_rsqrt", "cast_fp32") else None
    assert blocks[1].norm.kind == (
        expected_kind or {"rmsnorm_op": "RMSNormalization"}.get(norm, blocks[1].norm.kind)
    )
    for mode in ("last", "fold"):
        result = fuse_file(path, Plan(((0, 2),), mode), tmp_path / f"{mode}.onnx")
        assert result.report.ok, result.report.lines()
        assert result.report.groups[0].rel_error < 1e-5
        assert [b.width for b in find_blocks(load_model(result.output))] == [sum(WIDTHS[:3]), WIDTHS[3]]


def test_reduce_mean_axes_attribute_before_opset_18(tmp_path):
    path = build_synthetic(spec_for("pow_reciprocal", "matmul", opset=17), tmp_path / "model.onnx")
    assert [b.width for b in find_blocks(load_model(path))] == WIDTHS


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_are_recognized_and_kept(tmp_path, dtype):
    path = build_synthetic(spec_for("cast_fp32", "matmul", dtype=dtype), tmp_path / "model.onnx")
    blocks = find_blocks(load_model(path))
    assert {b.dtype.name.lower() for b in blocks} == {dtype.replace("float32", "float")}
    # "last" only concatenates: exact. "fold" rounds the scaled rows to the weight dtype once more.
    last = fuse_file(path, Plan(((1, 2),), "last"), tmp_path / "last.onnx").report
    assert last.ok and last.groups[0].rel_error < 1e-5  # checked in fp32 activations
    result = fuse_file(path, Plan(((1, 2),), "fold"), tmp_path / "fused.onnx")
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    assert result.report.ok and 1e-5 < result.report.groups[0].rel_error < 2 * ulp
    fused = find_blocks(load_model(result.output))
    assert fused[1].width == WIDTHS[1] + WIDTHS[2] and fused[1].dtype == blocks[1].dtype


def test_layer_names_come_from_dynamo_metadata_when_present(tmp_path):
    path = build_synthetic(spec_for("pow_reciprocal", "matmul"), tmp_path / "model.onnx")
    assert all(b.layer_name is None for b in find_blocks(load_model(path)))


def test_skip_simplified_layer_norm_runs_in_onnx_runtime(tmp_path):
    path = build_synthetic(spec_for("skip_simplified_ln", "matmul"), tmp_path / "model.onnx")
    logits = ort.InferenceSession(str(path)).run(None, {"input_ids": np.arange(6).reshape(1, 6)})[0]
    assert logits.shape == (1, 6, 64) and np.isfinite(logits).all()
