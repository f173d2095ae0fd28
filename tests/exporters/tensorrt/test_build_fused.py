"""A real engine from a fused model: export -> fuse -> FP8 Q/DQ -> TensorRT-RTX ahead of time (sm89)."""

from __future__ import annotations

import json

import numpy as np

from exporters.spec import BlockSpec, ModelSpec
from exporters.tensorrt import build as te
from passes.io.model_io import load_model, save_model
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from tests.artifacts import spec_export


def test_fused_fp8_model_builds_an_engine(tmp_path):
    blocks = [
        BlockSpec(True, 64),
        BlockSpec(False, 48),
        BlockSpec(False, 80),
        BlockSpec(False, 32),
        BlockSpec(True, 64),
    ]
    spec = ModelSpec(hidden=64, heads=4, kv_heads=2, vocab=256, blocks=blocks)
    model = spec_export(spec, tmp_path / "model.onnx")
    fused = fuse_file(model, Plan(((0, 2),), "fold"), tmp_path / "fused.onnx").output
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 1, 16))
    scales = calibrate(fused, list(tokens), progress=False)
    quantized = load_model(fused)
    report = quantize_fp8(quantized, scales)
    assert "ffn_fusion.0_2/gate" in report.quantized  # the wide fused FFN is quantized like any linear layer
    save_model(quantized, tmp_path / "fused_fp8.onnx", external=False)
    build = te.build_engine(
        tmp_path / "fused_fp8.onnx",
        tmp_path / "fused.engine",
        profile=te.Profile(min=(1, 1), opt=(1, 16), max=(2, 64)),
    )
    assert (tmp_path / "fused.engine").stat().st_size > 0
    sidecar = json.loads(te.sidecar_path(tmp_path / "fused.engine").read_text())
    assert sidecar["compute_capability"] == "sm89" and sidecar["strongly_typed"]
    assert sidecar["onnx_sha256"] == te.onnx_sha256(tmp_path / "fused_fp8.onnx")
    assert [i["name"] for i in sidecar["inputs"]] == ["input_ids"] and build is not None
