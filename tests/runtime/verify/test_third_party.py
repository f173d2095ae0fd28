"""The verifier on a third-party export (issue 39): Optimum's SmolLM2 export (the cached corpus,
tests/corpora/) fused and then quantized to FP8, each verified against its source; a tampered FP8 scale is
named."""

from __future__ import annotations

import pytest

from passes.io.model_io import load_model
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.quant.calibrate import calibrate
from runtime.deploy import quantize_file, with_side_inputs
from runtime.text_sets import calibration_windows
from runtime.verify import verify_artifact
from runtime.verify.options import VerifyOptions
from tests.corpora.fixtures import GROUPS
from tests.runtime.verify.artifacts import tampered


@pytest.mark.slow  # a 135M-parameter model fused, quantized and run four times
def test_optimum_fused_and_fp8_verify(third_party_corpus, tmp_path):
    source = third_party_corpus["optimum"]
    fused = fuse_file(source, Plan(GROUPS, "fold"), tmp_path / "model.fused.onnx").output
    report = verify_artifact(source, fused)
    assert report.ok and report.kind == "fused", report.lines()
    # real text: random ids land outside the ranges text reaches (0.18 against 0.15 on Optimum, whose every
    # projection is quantized since the lm_head is found by the path into the logits)
    ids, _ = calibration_windows(49152, None, 128, 64)
    scales = calibrate(fused, with_side_inputs([ids[:2]], fused), progress=False)
    fp8 = quantize_file(fused, scales, tmp_path, False, lambda message: None)
    # the logits check runs a seeded random prompt, farther from the calibrated ranges than text (the corpus'
    # FP8 test bounds held-out text at 0.15; here 0.154 was measured)
    report = verify_artifact(fused, fp8, VerifyOptions(max_error=0.2))
    assert report.ok and report.kind == "fp8", report.lines()
    scale = next(n for n in load_model(fp8).graph.initializers if n.endswith("_fp8_scale"))
    bad = verify_artifact(fused, tampered(fp8, tmp_path / "bad.onnx", scale, lambda a: a * 1.05))
    failed = {c.name: c.message for c in bad.failures}
    assert repr(scale) in failed["weight scales"]
