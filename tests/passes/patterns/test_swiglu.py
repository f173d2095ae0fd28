"""match_swiglu (passes/patterns/swiglu.py) on small fragments: every weight and gate/up form of
docs/design.md §3 gives the right record, whose weights reproduce what the fragment computes in ONNX
Runtime; near-misses are refused with NoMatch saying why.

passes/model_map.py calls it as `match_swiglu(residual.branch)`: the value the residual Add adds to the
stream, i.e. the down projection's output.
"""

from __future__ import annotations

import numpy as np
import pytest

from passes.matching import NoMatch
from passes.patterns.swiglu import SwiGLU, match_swiglu
from tests.passes.patterns.fragments import FLOAT, FLOAT16, Fragment

H, W = 8, 12  # hidden, FFN width
SIGMOID_FIRST = "sigmoid_first"


def _linear(f: Fragment, x: str, n_in: int, n_out: int, form: str, dtype=np.float32) -> tuple[str, str]:
    """(output, stored weight) of x @ W in one of the weight forms."""
    if form == "matmul":
        w = f.weight(n_in, n_out, base="w", dtype=dtype)
        return f.op("MatMul", x, w), w
    w = f.weight(n_out, n_in, base="w", dtype=dtype)  # [out, in], as torch stores it
    if form == "gemm":
        return f.op("Gemm", x, w, transB=1), w
    return f.op("MatMul", x, f.op("Transpose", w, perm=[1, 0])), w


def swiglu(
    f: Fragment,
    *,
    linear: str = "matmul",
    gate_up: str | None = None,
    silu: str = "gate_first",
    silu_first: bool = True,
    half: bool = False,
) -> tuple[str, dict[str, str]]:
    """down(silu(z @ W_gate) * (z @ W_up)); returns (output, {"gate", "up", "down" or "gate_up": weight})."""
    dtype = np.float16 if half else np.float32
    z = f.input("z", ["tokens", H] if linear == "gemm" else ["batch", "seq", H], FLOAT16 if half else FLOAT)
    weights = {}
    if gate_up is None:
        gate, weights["gate"] = _linear(f, z, H, W, linear, dtype)
        up, weights["up"] = _linear(f, z, H, W, linear, dtype)
    else:
        fused, weights["gate_up"] = _linear(f, z, H, 2 * W, linear, dtype)
        if gate_up == "split":
            gate, up = f.ops("Split", fused, f.ints(W, W), outputs=2, axis=-1)
        elif gate_up == "split_equal":
            gate, up = f.ops("Split", fused, outputs=2, axis=-1, num_outputs=2)
        else:
            gate = f.op("Slice", fused, f.ints(0), f.ints(W), f.ints(-1))
            up = f.op("Slice", fused, f.ints(W), f.ints(2**62), f.ints(-1))
    sigmoid = f.op("Sigmoid", gate)
    act = f.op("Mul", sigmoid, gate) if silu == SIGMOID_FIRST else f.op("Mul", gate, sigmoid)
    product = f.op("Mul", act, up) if silu_first else f.op("Mul", up, act)
    out, weights["down"] = _linear(f, product, W, H, linear, dtype)
    return out, weights


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def evaluate(record: SwiGLU, z: np.ndarray) -> np.ndarray:
    """What the record says the FFN computes, from its [in, out] matrices (float64)."""
    gate, up, down = (w.matrix().astype(np.float64) for w in (record.gate, record.up, record.down))
    return (_silu(z @ gate) * (z @ up)) @ down


FORMS = {  # name: swiglu() keywords
    "matmul": {},
    "matmul_up_first": {"silu_first": False},
    "sigmoid_first_silu": {"silu": SIGMOID_FIRST},
    "transposed_initializer": {"linear": "transpose"},
    "gemm_trans_b": {"linear": "gemm"},
    "gate_up_split": {"gate_up": "split"},
    "gate_up_split_num_outputs": {"gate_up": "split_equal"},
    "gate_up_slice": {"gate_up": "slice"},
    "gate_up_slice_transposed": {"gate_up": "slice", "linear": "transpose"},
}


@pytest.mark.parametrize("name", list(FORMS))
def test_form_gives_its_record(name: str) -> None:
    keywords = FORMS[name]
    f = Fragment()
    out, weights = swiglu(f, **keywords)
    f.build(out)
    record = match_swiglu(f[out])
    assert record.input is f["z"] and record.output is f[out] and record.width == W
    transposed = keywords.get("linear", "matmul") != "matmul"
    if "gate_up" in weights:
        assert record.gate.source is record.up.source is f[weights["gate_up"]]
        assert (record.gate.columns, record.up.columns) == ((0, W), (W, 2 * W))  # Phi-3: the gate first
    else:
        assert (record.gate.source, record.up.source) == (f[weights["gate"]], f[weights["up"]])
        assert record.gate.columns is None and record.up.columns is None
    assert record.down.source is f[weights["down"]]
    assert {w.transposed for w in (record.gate, record.up, record.down)} == {transposed}
    assert (record.gate.shape, record.up.shape, record.down.shape) == ((H, W), (H, W), (W, H))
    z = np.random.default_rng(2).standard_normal((4, H) if keywords.get("linear") == "gemm" else (2, 3, H))
    z = z.astype(np.float32)
    np.testing.assert_allclose(f.run({"z": z}), evaluate(record, z), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["Split", "Slice"])
def test_gate_up_along_the_positive_last_axis(op: str) -> None:
    """axis 2 of the rank-3 gate_up output (computed: its rank comes from the graph's inputs) is its last."""
    f = Fragment()
    z = f.input("z", ["batch", "seq", H])
    fused = f.op("MatMul", z, f.weight(H, 2 * W))
    if op == "Split":
        gate, up = f.ops("Split", fused, f.ints(W, W), outputs=2, axis=2)
    else:
        gate = f.op("Slice", fused, f.ints(0), f.ints(W), f.ints(2))
        up = f.op("Slice", fused, f.ints(W), f.ints(2 * W), f.ints(2))
    out = _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first=True)
    f.build(out)
    record = match_swiglu(f[out])
    assert (record.gate.columns, record.up.columns) == ((0, W), (W, 2 * W))
    z_value = np.random.default_rng(5).standard_normal((2, 3, H)).astype(np.float32)
    np.testing.assert_allclose(f.run({"z": z_value}), evaluate(record, z_value), rtol=1e-4, atol=1e-5)


def test_half_precision_weights_keep_their_dtype() -> None:
    f = Fragment()
    out, weights = swiglu(f, linear="transpose", half=True)
    f.build(out, elem=FLOAT16)
    record = match_swiglu(f[out])
    assert record.gate.source is f[weights["gate"]] and record.gate.transposed
    assert {w.dtype.name for w in (record.gate, record.up, record.down)} == {"FLOAT16"}
    assert record.gate.matrix().dtype == np.float16 and record.gate.matrix().shape == (H, W)


# ------------------------------------------------------------------------------------------ near-misses


def _product(f: Fragment, act: str, up: str, silu_first: bool) -> str:
    product = f.op("Mul", act, up) if silu_first else f.op("Mul", up, act)
    return f.op("MatMul", product, f.weight(W, H))


def _gelu(f: Fragment, silu_first: bool) -> str:
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.op("MatMul", z, f.weight(H, W)), f.op("MatMul", z, f.weight(H, W))
    return _product(f, f.op("Gelu", gate), up, silu_first)


def _erf_gelu(f: Fragment, silu_first: bool) -> str:
    """0.5 * g * (1 + erf(g / sqrt 2)), as torch exports nn.GELU at older opsets."""
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.op("MatMul", z, f.weight(H, W)), f.op("MatMul", z, f.weight(H, W))
    erf = f.op("Erf", f.op("Div", gate, f.scalar(2**0.5)))
    act = f.op("Mul", f.op("Mul", gate, f.scalar(0.5)), f.op("Add", erf, f.scalar(1.0)))
    return _product(f, act, up, silu_first)


def _different_inputs(f: Fragment, silu_first: bool) -> str:
    z, y = f.input("z", ["batch", "seq", H]), f.input("y", ["batch", "seq", H])
    gate, up = f.op("MatMul", z, f.weight(H, W)), f.op("MatMul", y, f.weight(H, W))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _silu_of_the_wrong_operand(f: Fragment, silu_first: bool) -> str:
    """gate * sigmoid(z @ W'): the Sigmoid does not read the tensor it multiplies."""
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.op("MatMul", z, f.weight(H, W)), f.op("MatMul", z, f.weight(H, W))
    other = f.op("MatMul", z, f.weight(H, W))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", other)), up, silu_first)


def _gate_gemm_with_bias(f: Fragment, silu_first: bool) -> str:
    z = f.input("z", ["tokens", H])
    gate = f.op("Gemm", z, f.weight(W, H), f.weight(W), transB=1)
    up = f.op("Gemm", z, f.weight(W, H), transB=1)
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _gate_weight_behind_cast(f: Fragment, silu_first: bool) -> str:
    """A Cast between weight and MatMul: a linear layer, but not one the fuser can concatenate."""
    z = f.input("z", ["batch", "seq", H])
    gate = f.op("MatMul", z, f.op("Cast", f.weight(H, W, dtype=np.float16), to=1))
    up = f.op("MatMul", z, f.weight(H, W))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _gate_weight_computed(f: Fragment, silu_first: bool) -> str:
    z = f.input("z", ["batch", "seq", H])
    gate = f.op("MatMul", z, f.input("gate_weight", [H, W]))
    up = f.op("MatMul", z, f.weight(H, W))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _split_on_axis_0(f: Fragment, silu_first: bool) -> str:
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.ops("Split", f.op("MatMul", z, f.weight(H, 2 * W)), outputs=2, axis=0, num_outputs=2)
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _split_on_the_sequence_axis(f: Fragment, silu_first: bool) -> str:
    """axis 1 is the last axis of a [tokens, 2W] Gemm output, but the sequence axis here."""
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.ops("Split", f.op("MatMul", z, f.weight(H, 2 * W)), outputs=2, axis=1, num_outputs=2)
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _split_sizes_computed(f: Fragment, silu_first: bool) -> str:
    z, sizes = f.input("z", ["batch", "seq", H]), f.input("sizes", [2], 7)
    gate, up = f.ops("Split", f.op("MatMul", z, f.weight(H, 2 * W)), sizes, outputs=2, axis=-1)
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _slices_without_axes(f: Fragment, silu_first: bool) -> str:
    """Slice's default axis is 0 (the batch), not the last."""
    z = f.input("z", ["batch", "seq", H])
    fused = f.op("MatMul", z, f.weight(H, 2 * W))
    gate, up = f.op("Slice", fused, f.ints(0), f.ints(W)), f.op("Slice", fused, f.ints(W), f.ints(2 * W))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _interleaved_slices(f: Fragment, silu_first: bool) -> str:
    """Every other column (step 2): an interleaved gate_up, not two halves."""
    z = f.input("z", ["batch", "seq", H])
    fused = f.op("MatMul", z, f.weight(H, 2 * W))
    gate = f.op("Slice", fused, f.ints(0), f.ints(2 * W), f.ints(-1), f.ints(2))
    up = f.op("Slice", fused, f.ints(1), f.ints(2 * W), f.ints(-1), f.ints(2))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _up_is_no_half(f: Fragment, silu_first: bool) -> str:
    """The gate is a Slice of a projection, the up another op of the same projection (it once crashed the
    recognizer, which read the op's Slice inputs)."""
    z = f.input("z", ["batch", "seq", H])
    fused = f.op("MatMul", z, f.weight(H, 2 * W))
    gate = f.op("Slice", fused, f.ints(0), f.ints(2 * W), f.ints(-1))
    up = f.op("Relu", fused)
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _halves_of_two_projections(f: Fragment, silu_first: bool) -> str:
    z = f.input("z", ["batch", "seq", H])
    gate = f.ops("Split", f.op("MatMul", z, f.weight(H, 2 * W)), outputs=2, axis=-1, num_outputs=2)[0]
    up = f.op("MatMul", z, f.weight(H, W))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


def _slice_with_computed_start(f: Fragment, silu_first: bool) -> str:
    z, start = f.input("z", ["batch", "seq", H]), f.input("start", [1], 7)
    fused = f.op("MatMul", z, f.weight(H, 2 * W))
    gate = f.op("Slice", fused, start, f.ints(W), f.ints(-1))
    up = f.op("Slice", fused, f.ints(W), f.ints(2 * W), f.ints(-1))
    return _product(f, f.op("Mul", gate, f.op("Sigmoid", gate)), up, silu_first)


# name: (builder(f, silu_first), what NoMatch says). Each is refused in the silu operand's two orders; the
# product's operands are tried in both orders, and the reason of the order that got furthest is raised.
GATE_UP_NEAR_MISSES = {
    "gelu_op_instead_of_silu": (_gelu, "expected Mul, found Gelu"),
    "erf_gelu_instead_of_silu": (_erf_gelu, r"no silu: Mul\(x, Sigmoid\(x\)\)"),
    "silu_of_the_wrong_operand": (_silu_of_the_wrong_operand, "no silu"),
    "gate_and_up_read_different_inputs": (_different_inputs, "gate and up projections read different"),
    "gate_gemm_with_bias": (_gate_gemm_with_bias, "Gemm with bias, transA or alpha is not a plain linear"),
    "gate_weight_behind_a_cast": (_gate_weight_behind_cast, "is not a 2-D initializer"),
    "gate_weight_computed": (_gate_weight_computed, "multiplies by a computed tensor"),
    "gate_up_split_on_axis_0": (_split_on_axis_0, "gate_up Split is not along the last axis"),
    "gate_up_split_on_the_sequence_axis": (_split_on_the_sequence_axis, "Split is not along the last axis"),
    "gate_up_split_sizes_computed": (_split_sizes_computed, "Split sizes are not constant"),
    "gate_up_slices_without_axes": (_slices_without_axes, "not a constant range of the last axis"),
    "gate_up_interleaved_slices": (_interleaved_slices, "not a constant range of the last axis"),
    "up_is_no_half_of_gate_up": (_up_is_no_half, "not halves of one gate_up projection"),
    "halves_of_two_projections": (_halves_of_two_projections, "not halves of one gate_up projection"),
    "slice_with_computed_start": (_slice_with_computed_start, "not a constant range of the last axis"),
}


def _near_miss(name: str, silu_first: bool) -> Fragment:
    f = Fragment(20)  # Gelu is an ONNX op from opset 20
    f.build(GATE_UP_NEAR_MISSES[name][0](f, silu_first))
    return f


@pytest.mark.parametrize("name", list(GATE_UP_NEAR_MISSES))
def test_near_miss_is_refused_with_the_reason(name: str) -> None:
    f = _near_miss(name, silu_first=False)
    with pytest.raises(NoMatch, match=GATE_UP_NEAR_MISSES[name][1]):
        match_swiglu(f.model.graph.outputs[0])


@pytest.mark.parametrize("name", list(GATE_UP_NEAR_MISSES))
def test_near_miss_is_refused_in_the_exporters_operand_order(name: str) -> None:
    """Mul(silu(gate), up), as HF's LlamaMLP is exported: refused too (the reason: the test below)."""
    f = _near_miss(name, silu_first=True)
    with pytest.raises(NoMatch):
        match_swiglu(f.model.graph.outputs[0])


@pytest.mark.parametrize("name", list(GATE_UP_NEAR_MISSES))
def test_near_miss_reason_in_the_exporters_operand_order(name: str) -> None:
    f = _near_miss(name, silu_first=True)
    with pytest.raises(NoMatch, match=GATE_UP_NEAR_MISSES[name][1]):
        match_swiglu(f.model.graph.outputs[0])


def test_neither_operand_a_silu_gives_both_reasons() -> None:
    """Mul(gelu(gate), up): neither operand order gets past its first node, so both reasons are given, the
    exporters' order first."""
    f = _near_miss("gelu_op_instead_of_silu", silu_first=True)
    with pytest.raises(NoMatch) as refused:
        match_swiglu(f.model.graph.outputs[0])
    assert str(refused.value) == "expected Mul, found Gelu; or expected Mul, found MatMul"


def test_missing_down_projection_is_refused() -> None:
    f = Fragment()
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.op("MatMul", z, f.weight(H, W)), f.op("MatMul", z, f.weight(H, W))
    out = f.op("Mul", f.op("Mul", gate, f.op("Sigmoid", gate)), up)
    f.build(out)
    with pytest.raises(NoMatch, match="expected MatMul or Gemm or MatMulNBits, found Mul"):
        match_swiglu(f[out])


def test_no_gated_product_is_refused() -> None:
    """A plain MLP: down(silu(z @ W)), no up projection to multiply by."""
    f = Fragment()
    z = f.input("z", ["batch", "seq", H])
    gate = f.op("MatMul", z, f.weight(H, W))
    out = f.op("MatMul", f.op("Sigmoid", gate), f.weight(W, H))
    f.build(out)
    with pytest.raises(NoMatch, match="expected Mul, found Sigmoid"):
        match_swiglu(f[out])


def test_weight_shapes_that_disagree_are_refused() -> None:
    """Structure alone would match: gate and up of different widths, or a down of another width."""
    f = Fragment()
    z = f.input("z", ["batch", "seq", H])
    gate, up = f.op("MatMul", z, f.weight(H, W)), f.op("MatMul", z, f.weight(H, W + 4))
    out = f.op("MatMul", f.op("Mul", f.op("Mul", gate, f.op("Sigmoid", gate)), up), f.weight(W, H))
    f.build(out)
    with pytest.raises(NoMatch, match=r"SwiGLU weight shapes disagree: gate \(8, 12\), up \(8, 16\)"):
        match_swiglu(f[out])


def test_down_gemm_with_alpha_is_refused() -> None:
    f = Fragment()
    z = f.input("z", ["tokens", H])
    gate, up = f.op("Gemm", z, f.weight(W, H), transB=1), f.op("Gemm", z, f.weight(W, H), transB=1)
    product = f.op("Mul", f.op("Mul", gate, f.op("Sigmoid", gate)), up)
    out = f.op("Gemm", product, f.weight(H, W), transB=1, alpha=0.5)
    f.build(out)
    with pytest.raises(NoMatch, match="Gemm with bias, transA or alpha"):
        match_swiglu(f[out])
