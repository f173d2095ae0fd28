"""match_fp8_swiglu and quantized_weights (passes/patterns/fp8.py) on small fragments quantized by the FP8
pass itself: each SwiGLU form the pass quantizes gives the record of what the FP8 fragment computes
(passes/reference.ffn on it equals ONNX Runtime's run of the fragment); near-misses of the pass's form are
refused with NoMatch naming the projection and what differs.

runtime/verify/fp8.py calls it as `match_fp8_swiglu(fp8_value_named(source.output), source)`: the FP8 graph
keeps its source's value names, so the source's SwiGLU record finds its FP8 form.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes import reference
from passes.matching import NoMatch, graph_values
from passes.patterns.fp8 import match_fp8_swiglu, quantized_weights
from passes.patterns.linear import find_linears
from passes.patterns.swiglu import SwiGLU, match_swiglu
from passes.quant.fp8 import QuantizeFP8
from tests.passes.patterns.fragments import Fragment
from tests.passes.patterns.test_swiglu import FORMS, H, W, swiglu

SCALE = np.float32(0.02)  # every activation's: z and the hidden product stay well inside +-448 x SCALE
QUANTIZED_FORMS = [name for name, keywords in FORMS.items() if keywords.get("linear") != "gemm"]  # MatMuls


def quantized(**keywords) -> tuple[Fragment, SwiGLU, ir.Model, dict[str, str], str]:
    """(the float fragment, its SwiGLU record, its FP8 form written by QuantizeFP8, the stored weights'
    names, the output's name)."""
    f = Fragment(opset=21)
    out, weights = swiglu(f, **keywords)
    f.build(out)
    fp8 = ir.serde.deserialize_model(f.proto)
    scales = {linear.activation.name: float(SCALE) for linear in find_linears(fp8.graph)}
    QuantizeFP8(scales, quantize_lm_head=True)(fp8)  # the down projection alone reaches the output
    return f, match_swiglu(f[out]), fp8, weights, out


def value(model: ir.Model, name: str) -> ir.Value:
    """A node output or initializer by name."""
    graph = model.graph
    return graph.initializers.get(name) or next(v for v in graph_values(graph) if v.name == name)


def run(model: ir.Model, z: np.ndarray) -> np.ndarray:
    """ONNX Runtime's output of the model as written (graph optimizations off)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.serde.serialize_model(model).SerializeToString()
    session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"z": z})[0]


@pytest.mark.parametrize("name", QUANTIZED_FORMS)
def test_form_gives_the_record_of_what_the_fp8_graph_computes(name: str) -> None:
    _, source, fp8, weights, out = quantized(**FORMS[name])
    record = match_fp8_swiglu(value(fp8, out), source)
    assert record.width == W
    initializers = fp8.graph.initializers
    for role in ("gate", "up", "down"):
        weight = getattr(record, role)
        stored = weights.get(role, weights.get("gate_up"))
        assert weight.weight.source is initializers[f"{stored}_fp8"] and not weight.transposed
        assert weight.weight.columns == getattr(source, role).columns
        assert weight.input_scale == SCALE
        recorded = initializers[f"{stored}_fp8_scale"].const_value.numpy()
        np.testing.assert_array_equal(weight.scale, recorded.astype(np.float64))
    z = np.random.default_rng(3).standard_normal((2, 3, H)).astype(np.float32)
    got, want = reference.ffn(z.astype(np.float64), record), run(fp8, z)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def test_quantized_weights_gives_each_float8_weight_once_with_its_scale() -> None:
    _, _, fp8, weights, _ = quantized(gate_up="split")  # gate and up: two halves of one float8 weight
    found = [(q.name, scale.name) for q, scale in quantized_weights(fp8.graph)]
    stored = [weights["gate_up"], weights["down"]]
    assert sorted(found) == sorted((f"{w}_fp8", f"{w}_fp8_scale") for w in stored)


# ------------------------------------------------------------------------------------------ near-misses


def _dequantize_node(model: ir.Model, weight: str) -> ir.Node:
    return next(iter(value(model, f"{weight}_fp8").uses())).node


def _activation_pair(model: ir.Model, activation: str) -> tuple[ir.Node, ir.Node]:
    """(QuantizeLinear, DequantizeLinear) of the named activation."""
    quant = next(use.node for use in value(model, activation).uses() if use.node.op_type == "QuantizeLinear")
    return quant, next(iter(quant.outputs[0].uses())).node


def _bypassed_input(model: ir.Model, source: SwiGLU, weights: dict[str, str]) -> None:
    """The down projection reads its input itself, not DQ(Q(input))."""
    down = value(model, source.output.name).producer()
    down.replace_input_with(0, down.inputs[0].producer().inputs[0].producer().inputs[0])


def _two_scales(model: ir.Model, source: SwiGLU, weights: dict[str, str]) -> None:
    _, dequant = _activation_pair(model, source.input.name)
    other = ir.Value(name="other_scale", const_value=ir.tensor(np.array(2 * SCALE)))
    model.graph.register_initializer(other)
    dequant.replace_input_with(1, other)


def _not_saturating(model: ir.Model, source: SwiGLU, weights: dict[str, str]) -> None:
    quant, _ = _activation_pair(model, source.input.name)
    quant.attributes["saturate"] = ir.AttrInt64("saturate", 0)


def _another_weight(model: ir.Model, source: SwiGLU, weights: dict[str, str]) -> None:
    model.graph.initializers[f"{weights['gate']}_fp8"].name = "other_fp8"


def _scale_on_axis_0(model: ir.Model, source: SwiGLU, weights: dict[str, str]) -> None:
    _dequantize_node(model, weights["down"]).attributes["axis"] = ir.AttrInt64("axis", 0)


NEAR_MISSES: dict[str, tuple[Callable[[ir.Model, SwiGLU, dict[str, str]], None], str]] = {
    "bypassed input Q/DQ": (_bypassed_input, "down projection: expected DequantizeLinear, found Mul"),
    "two activation scales": (_two_scales, "gate projection: its input's Q/DQ is not one float8 pair"),
    "not saturating": (_not_saturating, "gate projection: its input's QuantizeLinear does not saturate"),
    "another weight": (_another_weight, "gate projection: it reads 'other_fp8', not the float8 form of"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_refused_saying_why(name: str) -> None:
    change, message = NEAR_MISSES[name]
    _, source, fp8, weights, out = quantized()
    assert match_fp8_swiglu(value(fp8, out), source).width == W  # the pass's form, before the change
    change(fp8, source, weights)
    with pytest.raises(NoMatch, match="^" + re.escape(message)):
        match_fp8_swiglu(value(fp8, out), source)


def test_scale_on_axis_0_names_the_weight_and_the_rule() -> None:
    _, source, fp8, weights, out = quantized()
    _scale_on_axis_0(fp8, source, weights)
    with pytest.raises(NoMatch) as refused:
        match_fp8_swiglu(value(fp8, out), source)
    assert str(refused.value) == (
        f"down projection: '{weights['down']}_fp8': its scale is neither per output channel (axis 1) nor per "
        "tensor"
    )


def test_the_float_graph_itself_is_not_its_fp8_form() -> None:
    f, source, _, _, out = quantized()
    with pytest.raises(NoMatch, match="^down projection: expected DequantizeLinear, found Mul$"):
        match_fp8_swiglu(f[out], source)  # its down projection reads the SiLU-gated product itself
