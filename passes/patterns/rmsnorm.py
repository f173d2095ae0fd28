"""RMSNorm in every form exporters emit (docs/design.md §3).

Decomposed:  Pow(x, 2) | Mul(x, x) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Reciprocal | Div(1, .)
             | Pow(., -0.5) -> Mul(x, .) [-> Cast] -> Mul(weight, .)   (operands in either order;
             Cast to float32 and back around it in fp16/bf16 models).
Fused ops:   RMSNormalization (opset 23), SimplifiedLayerNormalization and
             SkipSimplifiedLayerNormalization (ONNX Runtime contrib ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from passes.matching import (
    NoMatch,
    attr,
    constant,
    first_match,
    is_initializer,
    is_last_axis,
    maybe_producer,
    producer,
    reduce_axes,
    scalar,
    strip_cast,
)

FUSED_NORM_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


@dataclass(frozen=True)
class Norm:
    """One RMSNorm: output = input / rms(input) * weight."""

    kind: str  # "decomposed" or the fused op type
    input: ir.Value  # the residual-stream tensor it normalizes
    output: ir.Value  # the normalized, scaled tensor
    weight: ir.Value | None  # the scale initializer (possibly behind a Cast); None: unit weight
    weight_slot: tuple[ir.Node, int] | None  # where the weight enters the graph
    unscaled: ir.Value | None  # input / rms(input) before the weight (decomposed form only)
    eps: float


def match_rmsnorm(output: ir.Value) -> Norm:
    """Recognize the RMSNorm that produces `output`."""
    node = producer(output, "Mul", "Div", "Cast", *FUSED_NORM_OPS)
    if node.op_type in FUSED_NORM_OPS:
        return _match_fused(node, output)
    weight_index = _weight_operand(node) if node.op_type == "Mul" else None
    if weight_index is None:  # x * rsqrt(.) or x / sqrt(.) alone: a unit weight ("fold"-fused models)
        stream, eps = _match_normalize(strip_cast(output))
        return Norm("decomposed", stream, output, None, None, output, eps)
    unscaled = node.inputs[1 - weight_index]
    stream, eps = _match_normalize(strip_cast(unscaled))
    return Norm("decomposed", stream, output, node.inputs[weight_index], (node, weight_index), unscaled, eps)


def _weight_operand(mul: ir.Node) -> int | None:
    for index in (0, 1):
        weight = strip_cast(mul.inputs[index])
        if is_initializer(weight) and len(weight.const_value.shape) == 1:
            return index
    return None


def _match_normalize(normalized: ir.Value) -> tuple[ir.Value, float]:
    """x / rms(x), as Mul(x, rsqrt(.)) or Div(x, sqrt(.)); returns (stream x, eps)."""
    node = producer(normalized, "Mul", "Div")
    if node.op_type == "Div":
        x, denominator = node.inputs
        return strip_cast(x), _match_mean_square(producer(denominator, "Sqrt").inputs[0], x)
    a, b = node.inputs[0], node.inputs[1]
    return first_match(lambda: _times_rsqrt(a, b), lambda: _times_rsqrt(b, a))


def _times_rsqrt(x: ir.Value, rsqrt: ir.Value) -> tuple[ir.Value, float]:
    return strip_cast(x), _match_mean_square(_match_rsqrt(rsqrt), x)


def _match_rsqrt(value: ir.Value) -> ir.Value:
    """Reciprocal(Sqrt(v)), Div(1, Sqrt(v)) or Pow(v, -0.5); returns v."""
    node = producer(value, "Reciprocal", "Div", "Pow")
    if node.op_type == "Pow":
        if scalar(node.inputs[1]) != -0.5:
            raise NoMatch("Pow exponent is not -0.5")
        return node.inputs[0]
    if node.op_type == "Div" and scalar(node.inputs[0]) != 1.0:
        raise NoMatch("Div numerator is not 1")
    return producer(node.inputs[-1], "Sqrt").inputs[0]


def _match_mean_square(value: ir.Value, x: ir.Value) -> float:
    """Add(ReduceMean(x * x, last axis), eps); returns eps."""
    add = producer(value, "Add")
    mean_index = 0 if maybe_producer(add.inputs[0], "ReduceMean") else 1
    eps = scalar(add.inputs[1 - mean_index])
    if eps is None:
        raise NoMatch("RMSNorm epsilon is not a constant")
    mean = producer(add.inputs[mean_index], "ReduceMean")
    square = producer(mean.inputs[0], "Pow", "Mul")
    if not is_last_axis(reduce_axes(mean), square.inputs[0]) or not attr(mean, "keepdims", 1):
        raise NoMatch("ReduceMean is not over the last axis with keepdims")
    base = square.inputs[0]
    if square.op_type == "Pow" and scalar(square.inputs[1]) != 2.0:
        raise NoMatch("Pow exponent is not 2")
    if square.op_type == "Mul" and square.inputs[1] is not base:
        raise NoMatch("Mul is not a square")
    if strip_cast(base) is not strip_cast(x):
        raise NoMatch("the mean square is not of the normalized tensor")
    return eps


def _match_fused(node: ir.Node, output: ir.Value) -> Norm:
    if node.outputs[0] is not output:
        raise NoMatch(f"{node.op_type} output {output.name} is not its normalized output")
    if node.op_type != "SkipSimplifiedLayerNormalization":  # the Skip op has no axis: always the last
        axis = int(attr(node, "axis", -1))
        if not is_last_axis([axis], node.inputs[0]):
            raise NoMatch(f"{node.op_type} is not over the last axis (axis {axis})")
    if node.op_type == "SkipSimplifiedLayerNormalization":
        if len(node.outputs) < 4 or not node.outputs[3].name:
            raise NoMatch("SkipSimplifiedLayerNormalization has no residual-sum output (output 3)")
        stream, weight_index = node.outputs[3], 2
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            raise NoMatch("SkipSimplifiedLayerNormalization with a bias is not supported")
    else:
        stream, weight_index = node.inputs[0], 1
    weight = node.inputs[weight_index]
    if constant(strip_cast(weight)) is None:
        raise NoMatch(f"{node.op_type} scale is not an initializer")
    eps = float(attr(node, "epsilon", 1e-5))
    return Norm(node.op_type, stream, output, weight, (node, weight_index), None, eps)
