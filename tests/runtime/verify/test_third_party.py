"""The verifier on a third-party export (issue 39): Optimum's SmolLM2 export (the cached corpus,
tests/corpora/) fused and then quantized to FP8, each verified against its source; a tampered FP8 scale is
named."""

from __future__ import annotations

import numpy as np
import pytest

from passes.io.model_io import load_model
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.quant.calibrate import calibrate
from runtime.deploy import quantize_file, with_side_inputs
from runtime.verify import verify_artifact
from tests.corpora.fixtures import GROUPS
from tests.runtime.verify.artifacts import tampered


@pytest.mark.slow  # a 135M-parameter model fused, quantized and run four times
def test_optimum_fused_and_fp8_verify(third_party_corpus, tmp_path):
    source = third_party_corpus["optimum"]
    fused = fuse_file(source, Plan(GROUPS, "fold"), tmp_path / "model.fused.onnx").output
    report = verify_artifact(source, fused)
    assert report.ok and report.kind == "fused", report.lines()
    ids = np.random.default_rng(0).integers(0, 49152, (1, 32), dtype=np.int64)
    scales = calibrate(fused, with_side_inputs([ids], fused), progress=False)
    fp8 = quantize_file(fused, scales, tmp_path, False, lambda message: None)
    report = verify_artifact(fused, fp8)
    assert report.ok and report.kind == "fp8", report.lines()
    scale = next(n for n in load_model(fp8).graph.initializers if n.endswith("_fp8_scale"))
    bad = verify_artifact(fused, tampered(fp8, tmp_path / "bad.onnx", scale, lambda a: a * 1.05))
    failed = {c.name: c.message for c in bad.failures}
    assert repr(scale) in failed["weight scales"]
