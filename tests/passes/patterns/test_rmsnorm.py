"""match_rmsnorm (passes/patterns/rmsnorm.py) on small fragments: every form of docs/design.md §3 gives the
right record (input, weight, epsilon), and near-misses are refused with NoMatch saying why.

passes/model_map.py calls it as `match_rmsnorm(ffn.input)`: the value the SwiGLU's gate and up read, i.e.
the norm's output. The epsilon here is 1e-6, not the ops' default 1e-5, so a test sees it read from the graph.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from passes.matching import NoMatch
from passes.patterns.rmsnorm import match_rmsnorm
from tests.passes.patterns.fragments import FLOAT, FLOAT16, Fragment

H = 8
EPS = 1e-6
X = np.random.default_rng(1).standard_normal((2, 3, H)).astype(np.float32)


def decomposed(
    f: Fragment,
    x: str | None = None,
    *,
    square: str = "pow",
    axes: tuple[int, ...] = (-1,),
    keepdims: int | None = None,
    power: float = 2.0,
    eps: str | None = None,
    eps_first: bool = False,
    no_eps: bool = False,
    rsqrt: str = "reciprocal",
    x_first: bool = True,
    weight: str | None = "first",
    cast: bool = False,
) -> tuple[str, str | None]:
    """weight * (x * rsqrt(mean(x^2) + eps)) as exporters write it; returns (output, weight)."""
    x = x or f.input("x", ["batch", "seq", H], FLOAT16 if cast else FLOAT)
    h = f.op("Cast", x, to=FLOAT) if cast else x
    sq = f.op("Mul", h, h) if square == "mul" else f.op("Pow", h, f.scalar(power))
    kept = {} if keepdims is None else {"keepdims": keepdims}
    if f.opset >= 18:
        mean = f.op("ReduceMean", sq, f.ints(*axes), **kept)
    else:
        mean = f.op("ReduceMean", sq, axes=list(axes), **kept)
    eps = eps or f.scalar(EPS)
    var = f.op("Add", eps, mean) if eps_first else f.op("Add", mean, eps)
    var = mean if no_eps else var
    if rsqrt == "div_sqrt":  # TorchScript's x / sqrt(.)
        normed = f.op("Div", h, f.op("Sqrt", var))
    else:
        if rsqrt == "reciprocal":
            inv = f.op("Reciprocal", f.op("Sqrt", var))
        elif rsqrt == "div_one":
            inv = f.op("Div", f.scalar(1.0), f.op("Sqrt", var))
        else:
            inv = f.op("Pow", var, f.scalar(-0.5))
        normed = f.op("Mul", h, inv) if x_first else f.op("Mul", inv, h)
    if cast:
        normed = f.op("Cast", normed, to=FLOAT16)
    if weight is None:
        return normed, None
    w = f.weight(H, base="norm_weight", offset=1.0, dtype=np.float16 if cast else np.float32)
    return (f.op("Mul", w, normed) if weight == "first" else f.op("Mul", normed, w)), w


def reference(x: np.ndarray, eps: float, weight: np.ndarray | None) -> np.ndarray:
    y = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


DECOMPOSED = {  # name: (opset, builder keywords)
    "pow_reciprocal": (18, {}),
    "mul_square": (18, {"square": "mul"}),
    "axes_attribute_opset17": (17, {}),
    "positive_axis_attribute_opset17": (17, {"axes": (2,)}),
    "positive_axis_input_opset18": (18, {"axes": (2,)}),
    "keepdims_explicit": (18, {"keepdims": 1}),
    "div_one_sqrt": (18, {"rsqrt": "div_one"}),
    "pow_minus_half": (18, {"rsqrt": "pow"}),
    "div_by_sqrt": (17, {"rsqrt": "div_sqrt"}),
    "rsqrt_first": (18, {"x_first": False}),
    "eps_first": (18, {"eps_first": True}),
    "eps_constant_node": (18, {"eps": "constant_node"}),
    "weight_second": (18, {"weight": "second"}),
    "cast_fp16": (18, {"cast": True}),
}


@pytest.mark.parametrize("name", list(DECOMPOSED))
def test_decomposed_form_gives_its_record(name: str) -> None:
    opset, keywords = DECOMPOSED[name]
    f = Fragment(opset)
    if keywords.get("eps") == "constant_node":
        eps = helper.make_tensor("eps", TensorProto.FLOAT, [], [EPS])
        keywords = {**keywords, "eps": f.op("Constant", value=eps)}
    out, w = decomposed(f, **keywords)
    f.build(out, elem=FLOAT16 if keywords.get("cast") else FLOAT)
    norm = match_rmsnorm(f[out])
    assert norm.kind == "decomposed"
    assert norm.input is f["x"] and norm.output is f[out] and norm.weight is f[w]
    node, index = norm.weight_slot
    assert node is f.node(out) and node.inputs[index] is f[w]
    assert norm.unscaled is node.inputs[1 - index] and norm.unscaled is not f[w]
    assert norm.eps == pytest.approx(EPS, rel=1e-6)
    if not keywords.get("cast"):  # the record reproduces what the fragment computes
        got = f.run({"x": X})
        np.testing.assert_allclose(got, reference(X, norm.eps, f.array(w)), rtol=1e-5, atol=1e-6)


def test_unit_weight_norm_has_no_weight() -> None:
    """A "fold"-fused model's norm: x * rsqrt(.) with no weight Mul."""
    f = Fragment()
    out, _ = decomposed(f, weight=None)
    f.build(out)
    norm = match_rmsnorm(f[out])
    assert norm.input is f["x"] and norm.weight is None and norm.weight_slot is None
    assert norm.unscaled is f[out] and norm.eps == pytest.approx(EPS, rel=1e-6)


# ------------------------------------------------------------------------------------------ fused ops


def test_rmsnormalization_op_opset23() -> None:
    f = Fragment(23)
    x, w = f.input("x", ["batch", "seq", H]), f.weight(H, offset=1.0)
    out = f.op("RMSNormalization", x, w, axis=-1, epsilon=EPS)
    f.build(out)
    norm = match_rmsnorm(f[out])
    assert (norm.kind, norm.input, norm.output, norm.weight) == ("RMSNormalization", f[x], f[out], f[w])
    assert norm.weight_slot == (f.node(out), 1) and norm.unscaled is None
    assert norm.eps == pytest.approx(EPS)
    np.testing.assert_allclose(f.run({"x": X}), reference(X, norm.eps, f.array(w)), rtol=1e-5, atol=1e-6)


def test_simplified_layer_normalization_contrib_op() -> None:
    """ONNX Runtime's contrib op (registered in the default domain); output 1 is its inverse std."""
    f = Fragment(18)
    x, w = f.input("x", ["batch", "seq", H]), f.weight(H, offset=1.0)
    out, _ = f.ops("SimplifiedLayerNormalization", x, w, outputs=2, axis=-1, epsilon=EPS)
    f.build(out)
    norm = match_rmsnorm(f[out])
    assert (norm.kind, norm.input, norm.weight) == ("SimplifiedLayerNormalization", f[x], f[w])
    assert norm.weight_slot == (f.node(out), 1) and norm.eps == pytest.approx(EPS)
    np.testing.assert_allclose(f.run({"x": X}), reference(X, norm.eps, f.array(w)), rtol=1e-5, atol=1e-6)


def test_simplified_layer_normalization_over_axis_1_is_refused() -> None:
    f = Fragment(18)
    x, w = f.input("x", ["batch", 3, H]), f.weight(3, H, offset=1.0)
    out = f.op("SimplifiedLayerNormalization", x, w, axis=1, epsilon=EPS)
    f.build(out)
    with pytest.raises(NoMatch, match="last axis"):
        match_rmsnorm(f[out])


def test_default_epsilon_of_a_fused_op_is_1e5() -> None:
    f = Fragment(18)
    x, w = f.input("x", ["batch", "seq", H]), f.weight(H, offset=1.0)
    out = f.op("SimplifiedLayerNormalization", x, w)
    f.build(out)
    assert match_rmsnorm(f[out]).eps == pytest.approx(1e-5)


def test_skip_simplified_layer_normalization_normalizes_the_sum() -> None:
    """GenAI's residual add + norm: the record's input is output 3 (stream + branch), the new stream."""
    f = Fragment(18)
    stream, branch = f.input("stream", ["batch", "seq", H]), f.input("branch", ["batch", "seq", H])
    w = f.weight(H, offset=1.0)
    out, _, _, total = f.ops(
        "SkipSimplifiedLayerNormalization", stream, branch, w, outputs=4, domain="com.microsoft", epsilon=EPS
    )
    f.build(out, total)
    norm = match_rmsnorm(f[out])
    assert norm.kind == "SkipSimplifiedLayerNormalization"
    assert norm.input is f[total] and norm.output is f[out] and norm.weight is f[w]
    assert norm.weight_slot == (f.node(out), 2) and norm.eps == pytest.approx(EPS)
    skip = X[::-1].copy()
    got = f.run({"stream": X, "branch": skip})
    np.testing.assert_allclose(got, reference(X + skip, norm.eps, f.array(w)), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ near-misses


def _not_a_square(f: Fragment) -> str:
    x, y = f.input("x", ["batch", "seq", H]), f.input("y", ["batch", "seq", H])
    var = f.op("Add", f.op("ReduceMean", f.op("Mul", x, y), f.ints(-1)), f.scalar(EPS))
    return f.op("Mul", f.weight(H), f.op("Div", x, f.op("Sqrt", var)))


def _mean_square_of_another_tensor(f: Fragment) -> str:
    x, y = f.input("x", ["batch", "seq", H]), f.input("y", ["batch", "seq", H])
    var = f.op("Add", f.op("ReduceMean", f.op("Pow", y, f.scalar(2.0)), f.ints(-1)), f.scalar(EPS))
    return f.op("Mul", f.weight(H), f.op("Div", x, f.op("Sqrt", var)))


def _rsqrt_exponent(f: Fragment) -> str:
    x = f.input("x", ["batch", "seq", H])
    var = f.op("Add", f.op("ReduceMean", f.op("Pow", x, f.scalar(2.0)), f.ints(-1)), f.scalar(EPS))
    return f.op("Mul", f.weight(H), f.op("Div", x, f.op("Pow", var, f.scalar(-1.0))))


def _div_numerator(f: Fragment) -> str:
    x = f.input("x", ["batch", "seq", H])
    var = f.op("Add", f.op("ReduceMean", f.op("Pow", x, f.scalar(2.0)), f.ints(-1)), f.scalar(EPS))
    inv = f.op("Div", f.scalar(2.0), f.op("Sqrt", var))
    return f.op("Mul", f.weight(H), f.op("Mul", inv, x))


def _layer_norm_op(f: Fragment) -> str:
    x = f.input("x", ["batch", "seq", H])
    return f.op("LayerNormalization", x, f.weight(H), f.weight(H), axis=-1, epsilon=EPS)


def _rmsnormalization_axis_1(f: Fragment) -> str:
    x = f.input("x", ["batch", 3, H])
    return f.op("RMSNormalization", x, f.weight(3, H), axis=1, epsilon=EPS)


def _fused_scale_is_an_input(f: Fragment) -> str:
    x, w = f.input("x", ["batch", "seq", H]), f.input("w", [H])
    return f.op("SimplifiedLayerNormalization", x, w, axis=-1, epsilon=EPS)


def _inverse_std_output(f: Fragment) -> str:
    x = f.input("x", ["batch", "seq", H])
    return f.ops("SimplifiedLayerNormalization", x, f.weight(H), outputs=2, axis=-1, epsilon=EPS)[1]


def _skip_without_sum(f: Fragment) -> str:
    a, b = f.input("a", ["batch", "seq", H]), f.input("b", ["batch", "seq", H])
    return f.op("SkipSimplifiedLayerNormalization", a, b, f.weight(H), domain="com.microsoft", epsilon=EPS)


def _skip_with_bias(f: Fragment) -> str:
    a, b = f.input("a", ["batch", "seq", H]), f.input("b", ["batch", "seq", H])
    outs = f.ops(
        "SkipSimplifiedLayerNormalization", a, b, f.weight(H), f.weight(H), outputs=4, domain="com.microsoft"
    )
    return outs[0]


def _relu(f: Fragment) -> str:
    return f.op("Relu", f.input("x", ["batch", "seq", H]))


NEAR_MISSES = {  # name: (builder, opset, what NoMatch says)
    "mul_of_two_tensors": (_not_a_square, 18, "Mul is not a square"),
    "mean_square_of_another_tensor": (_mean_square_of_another_tensor, 18, "not of the normalized tensor"),
    "div_by_pow_minus_one": (_rsqrt_exponent, 18, "expected Sqrt, found Pow"),
    "div_numerator_not_one": (_div_numerator, 18, "Div numerator is not 1"),
    "layer_normalization_op": (_layer_norm_op, 18, "found LayerNormalization"),
    "rmsnormalization_axis_1": (_rmsnormalization_axis_1, 23, "RMSNormalization is not over the last axis"),
    "fused_scale_not_an_initializer": (_fused_scale_is_an_input, 18, "scale is not an initializer"),
    "fused_output_not_the_normalized_one": (_inverse_std_output, 18, "is not its normalized output"),
    "skip_norm_without_output_3": (_skip_without_sum, 18, r"no residual-sum output \(output 3\)"),
    "skip_norm_with_bias": (_skip_with_bias, 18, "with a bias is not supported"),
    "not_a_norm": (_relu, 18, "expected Mul or Div or Cast or .*found Relu"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_refused_with_the_reason(name: str) -> None:
    build, opset, reason = NEAR_MISSES[name]
    f = Fragment(opset)
    out = build(f)
    f.build(out)
    with pytest.raises(NoMatch, match=reason):
        match_rmsnorm(f[out])


def test_weight_that_is_not_a_constant_is_not_taken_as_the_weight() -> None:
    """Mul(w, normed) with w a graph input: no weight is recorded, and the Mul is no x * rsqrt either."""
    f = Fragment()
    out, _ = decomposed(f, weight=None)
    scaled = f.op("Mul", f.input("w", [H]), out)
    f.build(scaled)
    with pytest.raises(NoMatch, match="expected Reciprocal or Div or Pow"):
        match_rmsnorm(f[scaled])


def test_two_dimensional_weight_is_not_a_norm_weight() -> None:
    f = Fragment()
    out, _ = decomposed(f, weight=None)
    scaled = f.op("Mul", f.weight(3, H), out)
    f.build(scaled)
    with pytest.raises(NoMatch):
        match_rmsnorm(f[scaled])


def test_layer_norm_mean_subtraction_is_not_the_stream() -> None:
    """LayerNorm without bias, decomposed: (x - mean(x)) / sqrt(mean((x - mean)^2) + eps) * w. It is an
    RMSNorm of the centered tensor, and the record says so: its input is the Sub, not x, so the model map
    (which requires the norm to read the residual stream) refuses it as an FFN's norm."""
    f = Fragment()
    x = f.input("x", ["batch", "seq", H])
    centered = f.op("Sub", x, f.op("ReduceMean", x, f.ints(-1)))
    out, _ = decomposed(f, centered, rsqrt="div_sqrt")
    f.build(out)
    norm = match_rmsnorm(f[out])
    assert norm.input is f[centered] and norm.input is not f[x]


def test_positive_last_axis_of_a_computed_tensor() -> None:
    f = Fragment()
    x = f.op("Add", f.input("a", ["batch", "seq", H]), f.input("b", ["batch", "seq", H]))
    out, _ = decomposed(f, x, axes=(2,))
    f.build(out)
    assert match_rmsnorm(f[out]).input is f[x]


def test_positive_last_axis_through_a_cast_of_a_computed_fp16_tensor() -> None:
    """An fp16 model: the computed stream is cast to float32 before Pow; its rank is read through the Cast."""
    f = Fragment()
    x = f.op("Add", f.input("a", ["batch", "seq", H], FLOAT16), f.input("b", ["batch", "seq", H], FLOAT16))
    out, _ = decomposed(f, x, axes=(2,), cast=True)
    f.build(out, elem=FLOAT16)
    assert match_rmsnorm(f[out]).input is f[x]


@pytest.mark.parametrize("dims", [["batch", "seq", "heads", H], None], ids=["rank_4", "rank_unknown"])
def test_positive_axis_is_refused_unless_it_is_known_to_be_the_last(dims) -> None:
    """ReduceMean over axis 2 of a rank-4 tensor is no RMSNorm over the last axis; where the rank cannot be
    known (a graph input without a shape), the axis is not guessed."""
    f = Fragment()
    x = f.op("Add", f.input("a", dims), f.input("b", dims))
    out, _ = decomposed(f, x, axes=(2,))
    f.build(out)
    with pytest.raises(NoMatch, match="ReduceMean is not over the last axis"):
        match_rmsnorm(f[out])


@pytest.mark.parametrize("op", ["RMSNormalization", "SimplifiedLayerNormalization"])
def test_fused_op_over_the_positive_last_axis(op: str) -> None:
    """axis=2 of a rank-3 stream is the last axis (the stream is computed: its rank comes from the graph's
    inputs); axis=2 where the rank is unknown is refused."""
    f = Fragment(23)
    x = f.op("Add", f.input("a", ["batch", "seq", H]), f.input("b", ["batch", "seq", H]))
    w = f.weight(H, offset=1.0)
    out = f.op(op, x, w, axis=2, epsilon=EPS)
    unknown = f.op(op, f.op("Add", f.input("c", None), f.input("d", None)), w, axis=2, epsilon=EPS)
    f.build(out, unknown)
    norm = match_rmsnorm(f[out])
    assert (norm.kind, norm.input, norm.weight) == (op, f[x], f[w])
    with pytest.raises(NoMatch, match=f"{op} is not over the last axis"):
        match_rmsnorm(f[unknown])
    got = f.run({"a": X, "b": X, "c": X, "d": X})
    np.testing.assert_allclose(got, reference(2 * X, norm.eps, f.array(w)), rtol=1e-5, atol=1e-6)


# Near-misses below the x * rsqrt(.) Mul. The recognizer tries both operand orders of that Mul and reports
# the reason of the order that got furthest, whichever order the graph writes.
MEAN_SQUARE_NEAR_MISSES = {  # name: (decomposed() keywords, what NoMatch says)
    "mean_over_the_wrong_axis": ({"axes": (1,)}, "ReduceMean is not over the last axis"),
    "mean_over_two_axes": ({"axes": (1, 2)}, "ReduceMean is not over the last axis"),
    "mean_without_keepdims": ({"keepdims": 0}, "not over the last axis with keepdims"),
    "missing_eps_add": ({"no_eps": True}, "expected Add, found ReduceMean"),
    "eps_not_a_constant": ({"eps": "eps"}, "RMSNorm epsilon is not a constant"),
    "cube_not_square": ({"power": 3.0}, "Pow exponent is not 2"),
}


def _mean_square_near_miss(name: str, x_first: bool) -> Fragment:
    keywords, _ = MEAN_SQUARE_NEAR_MISSES[name]
    f = Fragment()
    if keywords.get("eps"):
        keywords = {**keywords, "eps": f.input("eps", [1])}
    out, _ = decomposed(f, x_first=x_first, **keywords)
    f.build(out)
    return f


@pytest.mark.parametrize("name", list(MEAN_SQUARE_NEAR_MISSES))
def test_mean_square_near_miss_is_refused_with_the_reason(name: str) -> None:
    f = _mean_square_near_miss(name, x_first=False)
    with pytest.raises(NoMatch, match=MEAN_SQUARE_NEAR_MISSES[name][1]):
        match_rmsnorm(f.model.graph.outputs[0])


@pytest.mark.parametrize("name", list(MEAN_SQUARE_NEAR_MISSES))
def test_mean_square_near_miss_is_refused_in_the_exporters_operand_order(name: str) -> None:
    """Mul(x, rsqrt(.)), as HF's LlamaRMSNorm is exported: refused too (the reason: the test below)."""
    f = _mean_square_near_miss(name, x_first=True)
    with pytest.raises(NoMatch):
        match_rmsnorm(f.model.graph.outputs[0])


@pytest.mark.parametrize("name", list(MEAN_SQUARE_NEAR_MISSES))
def test_mean_square_near_miss_reason_in_the_exporters_operand_order(name: str) -> None:
    f = _mean_square_near_miss(name, x_first=True)
    with pytest.raises(NoMatch, match=MEAN_SQUARE_NEAR_MISSES[name][1]):
        match_rmsnorm(f.model.graph.outputs[0])
