"""StripActivationQuantization and FoldWeightDequantization (passes/quant/dequantize.py) on a synthetic
model's FP8 graph: chained after QuantizeFP8 in one PassManager they make a float graph that holds exactly
the FP8 weights (its logits equal the FP8 graph's without its activation Q/DQ, where ONNX Runtime computes
each DequantizeLinear) and that the block walk reads; a float model is left as it is; each pass's ensures
names what is left; a DequantizeLinear outside the FP8 pass's forms stays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.io.model_io import load_model, save_model
from passes.io.sessions import open_session
from passes.model_map import find_blocks
from passes.quant.calibrate import ActivationScales, calibrate
from passes.quant.dequantize import FoldWeightDequantization, StripActivationQuantization
from passes.quant.fp8 import QuantizeFP8

SPEC = SyntheticSpec(hidden=32, blocks=[(True, 48), (False, 64), (False, 40)])
QDQ = ("QuantizeLinear", "DequantizeLinear")
FP8 = ir.DataType.FLOAT8E4M3FN


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, ActivationScales]:
    path = build_synthetic(SPEC, tmp_path_factory.mktemp("dequantize") / "m.onnx", external=True)
    ids = np.random.default_rng(1).integers(0, SPEC.vocab, (2, 16))
    return path, calibrate(path, [ids], progress=False)


def logits(path: Path) -> np.ndarray:
    ids = np.random.default_rng(2).integers(0, SPEC.vocab, (2, 16))
    return open_session(path).run(None, {"input_ids": ids})[0]


def fp8_model(source: tuple[Path, ActivationScales]) -> ir.Model:
    model = load_model(source[0])
    QuantizeFP8(source[1])(model)
    return model


def weight_dequantizations(model: ir.Model) -> list[ir.Node]:
    """The DequantizeLinear nodes of float8 initializers (not those of activations)."""
    return [n for n in model.graph if n.op_type == "DequantizeLinear" and n.inputs[0].const_value is not None]


def test_strip_then_fold_after_quantize_fp8_make_a_float_graph_of_the_fp8_weights(source, tmp_path):
    path, scales = source
    quantize, strip, fold = QuantizeFP8(scales), StripActivationQuantization(), FoldWeightDequantization()
    model = load_model(path)
    result = ir.passes.PassManager([quantize, strip, fold])(model)
    assert result.modified and result.model is model
    assert strip.removed == quantize.report.activations > 0
    assert fold.folded == quantize.report.weights > 0
    assert not [node.op_type for node in model.graph if node.op_type in QDQ]
    assert not [v.name for v in model.graph.initializers.values() if v.dtype == FP8]
    assert len(find_blocks(model)) == len(SPEC.blocks)  # a float graph: the block walk reads it
    save_model(model, tmp_path / "folded.onnx", external=True)
    stripped = fp8_model(source)  # the FP8 weights behind DequantizeLinear, computed by ONNX Runtime
    StripActivationQuantization()(stripped)
    save_model(stripped, tmp_path / "stripped.onnx", external=True)
    folded, reference = logits(tmp_path / "folded.onnx"), logits(tmp_path / "stripped.onnx")
    np.testing.assert_allclose(folded, reference, rtol=0, atol=1e-6 * np.abs(reference).max())
    assert not np.allclose(folded, logits(path), rtol=0, atol=1e-3 * np.abs(reference).max())  # FP8 weights


def test_a_float_model_is_left_as_it_is(source):
    model = load_model(source[0])
    for rewrite in (StripActivationQuantization(), FoldWeightDequantization()):
        assert not rewrite(model).modified
    assert (StripActivationQuantization().removed, FoldWeightDequantization().folded) == (0, 0)


def test_ensures_name_what_is_left(source):
    model = fp8_model(source)
    with pytest.raises(AssertionError, match=r"activation Q/DQ pair\(s\) left, first"):
        StripActivationQuantization().ensures(model)
    with pytest.raises(AssertionError, match=r"float8 weight\(s\) not folded, first '.*_fp8'"):
        FoldWeightDequantization().ensures(model)


def test_a_dequantize_linear_outside_the_pass_forms_stays(source):
    """A float8 weight whose per-channel scale is on axis 0 is not the FP8 pass's: it stays behind its
    DequantizeLinear, read, while every other weight is folded."""
    model = fp8_model(source)
    weights = weight_dequantizations(model)
    weights[0].attributes["axis"] = ir.AttrInt64("axis", 0)
    fold = FoldWeightDequantization()
    assert fold(model).modified
    left = weight_dequantizations(model)
    assert left == weights[:1] and fold.folded == len(weights) - 1 > 0
