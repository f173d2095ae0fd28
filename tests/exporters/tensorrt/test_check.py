"""Checking TensorRT engines against ONNX Runtime (exporters/tensorrt/check.py).

Without a GPU the Comparator machinery runs with two ONNX Runtime runners; tests/tools covers --check.
"""

from __future__ import annotations

import numpy as np
import pytest

from exporters.tensorrt import check as tc
from exporters.tensorrt import shim as trt_shim
from passes.errors import UserError
from tests import fp8_fixtures as fx


def test_check_needs_datacenter_tensorrt_and_a_gpu(fp8_model, tmp_path):
    if not trt_shim.load().is_rtx and trt_shim.current_gpu_compute_capability() is not None:
        pytest.skip("a GPU with datacenter TensorRT is here; tests/tools covers --check")
    with pytest.raises(UserError, match="needs datacenter TensorRT|needs a GPU"):
        tc.check_engine(tmp_path / "none.engine", fp8_model("tiny_llama"), [(1, 8)], vocab=fx.VOCAB)


def test_polygraphy_comparator_with_onnxrt_runners(fp8_model, tmp_path_factory):
    """The --check machinery (data loader, ORT runner, Comparator) with ORT fp32 as the reference."""
    src = fx.model_path("tiny_llama", tmp_path_factory)
    fp8 = fp8_model("tiny_llama")
    feeds = tc.token_feeds([(1, 1), (1, 16), (2, 64)], fx.VOCAB, seed=3)
    assert [f["input_ids"].shape for f in feeds] == [(1, 1), (1, 16), (2, 64)]
    assert all(f["input_ids"].dtype == np.int64 and f["input_ids"].max() < fx.VOCAB for f in feeds)
    loose = tc.compare_runners([tc.onnxrt_runner(src), tc.onnxrt_runner(fp8)], feeds, atol=0.5, rtol=0.5)
    (out,) = loose.outputs
    fx.log(f"Comparator fp32 vs FP8 (ORT): rel err {out.rel_error:.4f}, min cosine {out.min_cosine:.5f}")
    assert loose.passed and out.passed and out.name == "logits"
    assert 1e-4 < out.rel_error < 0.07 and out.min_cosine > 0.99
    ref = np.concatenate([fx.run_logits(src, f["input_ids"]).ravel() for f in feeds])
    got = np.concatenate([fx.run_logits(fp8, f["input_ids"]).ravel() for f in feeds])
    assert out.rel_error == pytest.approx(np.linalg.norm(got - ref) / np.linalg.norm(ref), rel=1e-4)
    assert out.max_abs_error == pytest.approx(np.abs(got - ref).max(), rel=1e-4)
    tight = tc.compare_runners([tc.onnxrt_runner(src), tc.onnxrt_runner(fp8)], feeds, atol=1e-6, rtol=1e-6)
    assert not tight.passed and not tight.outputs[0].passed
