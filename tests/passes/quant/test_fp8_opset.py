"""FP8 on graphs below opset 19 (issue 9.4): the opset is raised with every op converted on the way, so
the FP8 model is valid ONNX and runs in ONNX Runtime; weights are not read to do it."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from exporters.llama import build_model
from exporters.spec import BlockSpec, ModelSpec
from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import UserError
from passes.io.model_io import load_model, load_proto, save_model
from passes.io.sessions import ORT_DISABLED_OPTIMIZERS
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import MIN_FP8_OPSET, quantize_fp8
from passes.quant.opset import raise_opset

SPEC = ModelSpec(
    hidden=64, heads=4, kv_heads=2, vocab=128, blocks=[BlockSpec(True, 96), BlockSpec(False, 128)]
)
IDS = np.random.default_rng(0).integers(0, SPEC.vocab, size=(2, 16), dtype=np.int64)


@pytest.fixture(scope="module")
def torchscript_opset17(tmp_path_factory) -> Path:
    """exporters/llama.py through the TorchScript exporter at opset 17, weights in external data."""
    folder = tmp_path_factory.mktemp("ts17")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            build_model(SPEC, seed=0).eval(),
            (torch.zeros(2, 7, dtype=torch.int64),),
            str(folder / "inline.onnx"),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_axes={"input_ids": {0: "batch", 1: "seq"}},
        )
    path = folder / "model.onnx"
    save_model(load_model(folder / "inline.onnx"), path, external=True)
    return path


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(path), providers=["CPUExecutionProvider"], disabled_optimizers=ORT_DISABLED_OPTIMIZERS
    )


def _fp8(source: Path, out: Path, ids: np.ndarray = IDS) -> Path:
    scales = calibrate(source, [ids], progress=False)
    model = load_model(source)
    report = quantize_fp8(model, scales)
    assert report.opset == (17, 21) and report.weights > 0
    save_model(model, out, external=True)
    return out


def test_fp8_of_an_opset17_torchscript_export_runs_in_onnx_runtime(torchscript_opset17, tmp_path):
    proto = load_proto(torchscript_opset17)
    assert proto.opset_import[0].version == 17
    assert any(a.name == "axes" for n in proto.graph.node if n.op_type == "ReduceMean" for a in n.attribute)
    fp8 = _fp8(torchscript_opset17, tmp_path / "fp8.onnx")
    onnx.checker.check_model(str(fp8), full_check=True)
    means = [n for n in load_proto(fp8).graph.node if n.op_type == "ReduceMean"]
    assert means and all(len(n.input) == 2 and not any(a.name == "axes" for a in n.attribute) for n in means)
    reference = _session(torchscript_opset17).run(None, {"input_ids": IDS})[0]
    logits = _session(fp8).run(None, {"input_ids": IDS})[0]
    error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
    assert 0 < error < 0.15, error  # FP8 rounding: not exact, not far


def test_contrib_ops_in_the_default_domain_survive_the_upgrade(tmp_path):
    """ONNX Runtime's SimplifiedLayerNormalization has no ONNX schema; onnx's converter alone refuses it."""
    source = build_synthetic(SyntheticSpec(opset=17, norm="simplified_ln"), tmp_path / "model.onnx")
    ids = IDS % 64
    fp8 = _fp8(source, tmp_path / "fp8.onnx", ids)
    proto = load_proto(fp8)
    assert {(n.op_type, n.domain) for n in proto.graph.node} >= {("SimplifiedLayerNormalization", "")}
    assert {o.domain for o in proto.opset_import} <= {"", "com.microsoft"}
    reference = _session(source).run(None, {"input_ids": ids})[0]
    error = np.linalg.norm(_session(fp8).run(None, {"input_ids": ids})[0] - reference) / np.linalg.norm(
        reference
    )
    assert error < 0.15


def test_raising_the_opset_reads_no_large_weight(torchscript_opset17, monkeypatch):
    read: list[str] = []
    for method in ("numpy", "tobytes"):
        original = getattr(ir.ExternalTensor, method)

        def spy(self, _original=original):
            if self.size > 1000:
                read.append(self.name)
            return _original(self)

        monkeypatch.setattr(ir.ExternalTensor, method, spy)
    model = load_model(torchscript_opset17)
    assert raise_opset(model, 21, MIN_FP8_OPSET, "FP8 Q/DQ") == (17, 21)
    assert read == []
    assert sum(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()) > 5


def test_a_conversion_that_leaves_an_invalid_node_is_refused(tmp_path):
    """Opset 18 declared over a ReduceMean that still has its opset-17 axes attribute: nothing converts it."""
    path = build_synthetic(SyntheticSpec(opset=17), tmp_path / "model.onnx")
    model = load_model(path)
    model.opset_imports[""] = 18
    with pytest.raises(UserError, match="ReduceMean .*'axes'"):
        raise_opset(model, 21, MIN_FP8_OPSET, "FP8 Q/DQ")
