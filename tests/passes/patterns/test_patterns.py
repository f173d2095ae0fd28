"""Every RMSNorm and SwiGLU form of docs/design.md §3 is recognized, fused, and checked by numbers."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

from exporters.synthetic import FFNS, NORMS, SyntheticSpec, build_synthetic
from passes.io.model_io import load_model, load_proto
from passes.model_map import find_blocks
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


class _DivNorm(torch.nn.Module):
    """weight * (x / sqrt(mean(x^2) + eps)): TorchScript writes Div(x, Sqrt(.)) -> Mul(weight, .)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


class _DivNormModel(torch.nn.Module):
    def __init__(self, hidden: int = 32, widths=(48, 64, 40), vocab: int = 64) -> None:
        super().__init__()
        linear = torch.nn.Linear
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norms = torch.nn.ModuleList(_DivNorm(hidden) for _ in widths)
        self.ffns = torch.nn.ModuleList(
            torch.nn.ModuleList(
                [linear(hidden, w, bias=False), linear(hidden, w, bias=False), linear(w, hidden, bias=False)]
            )
            for w in widths
        )
        self.final = _DivNorm(hidden)
        self.head = linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for norm, (gate, up, down) in zip(self.norms, self.ffns, strict=True):
            z = norm(x)
            x = x + down(torch.nn.functional.silu(gate(z)) * up(z))
        return self.head(self.final(x))


def test_torchscript_div_sqrt_norm_fuses_in_both_modes(tmp_path):
    """Issue 9.6: "fold" left the fused FFN reading Div(x, Sqrt(.)), which the recognizer did not know,
    so the fuse pass's post-condition failed with a traceback."""
    torch.manual_seed(0)
    path = tmp_path / "torchscript.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _DivNormModel().eval(),
            (torch.zeros(2, 7, dtype=torch.int64),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_axes={"input_ids": {0: "batch", 1: "seq"}},
        )
    assert "Div" in {n.op_type for n in load_proto(path).graph.node}
    assert [b.width for b in find_blocks(load_model(path))] == [48, 64, 40]
    for mode in ("last", "fold"):
        result = fuse_file(path, Plan(((0, 1),), mode), tmp_path / f"{mode}.onnx")
        assert result.report.ok and result.report.groups[0].rel_error < 1e-5, result.report.lines()
        assert [b.width for b in find_blocks(load_model(result.output))] == [112, 40]
