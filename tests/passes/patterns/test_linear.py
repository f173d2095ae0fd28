"""Linear layers and their weights (passes/patterns/linear.py): linear_weight on small fragments of every
weight form (initializer, Transpose, Gemm transB, Constant, FP8 DequantizeLinear, int4 MatMulNBits) and
the refusals with their reasons; find_linears on a fragment and on an exported Llama."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.io.model_io import load_model
from passes.matching import NoMatch
from passes.patterns.linear import find_linears, is_linear, linear_shape, linear_weight, weight_ref
from tests import fp8_fixtures as fx
from tests.passes.patterns.fragments import INT32, Fragment


def test_find_linears_in_exported_llama(tmp_path_factory):
    model = load_model(fx.model_path("tiny_llama", tmp_path_factory))
    linears = find_linears(model.graph)
    # 2 layers x (q, k, v, o, gate, up, down) + lm_head; attention's Q@K^T and P@V have no constant B.
    assert len(linears) == 2 * 7 + 1
    heads = [lin for lin in linears if lin.is_lm_head]
    assert len(heads) == 1 and heads[0].node.outputs[0].name == "logits"
    # tied embeddings: the lm_head weight is Transpose(embedding), found through the Transpose
    assert heads[0].weight.transpose and heads[0].width == (fx.HIDDEN, fx.VOCAB)
    widths = sorted({lin.width for lin in linears})
    assert (fx.HIDDEN, 128) in widths and (128, fx.HIDDEN) in widths


def test_wide_matmul_is_a_linear(tmp_path_factory):
    model = load_model(fx.model_path("wide_ffn", tmp_path_factory))
    assert max(lin.width[1] for lin in find_linears(model.graph)) == 1024


# ------------------------------------------------------------------------------------------ fragments

H, N = 8, 12  # in, out features
SEQ = ["batch", "seq", H]


def _fragment(build) -> tuple[Fragment, str, str]:
    """(fragment, the layer's output, its stored weight) for build(f, x) -> (output, weight)."""
    f = Fragment(21)  # DequantizeLinear of float8 from opset 19; 21 as the FP8 pass writes
    out, weight = build(f, f.input("x", ["tokens", H] if build in (_gemm, _gemm_transposed) else SEQ))
    f.build(out)
    return f, out, weight


def _matmul(f: Fragment, x: str, n_in: int = H, n_out: int = N) -> tuple[str, str]:
    w = f.weight(n_in, n_out)
    return f.op("MatMul", x, w), w


def _transposed(f: Fragment, x: str) -> tuple[str, str]:
    w = f.weight(N, H)
    return f.op("MatMul", x, f.op("Transpose", w, perm=[1, 0])), w


def _gemm(f: Fragment, x: str) -> tuple[str, str]:
    w = f.weight(N, H)
    return f.op("Gemm", x, w, transB=1), w


def _gemm_transposed(f: Fragment, x: str) -> tuple[str, str]:
    """Gemm transB=1 of Transpose(W[in, out]): two transposes, the stored weight is [in, out]."""
    w = f.weight(H, N)
    return f.op("Gemm", x, f.op("Transpose", w, perm=[1, 0]), transB=1), w


def _constant_node(f: Fragment, x: str) -> tuple[str, str]:
    tensor = numpy_helper.from_array(np.ones((H, N), np.float32), "w")
    w = f.op("Constant", value=tensor)
    return f.op("MatMul", x, w), w


def _cast_fp16(f: Fragment, x: str, n_in: int = H, n_out: int = N) -> tuple[str, str]:
    w = f.weight(n_in, n_out, dtype=np.float16)
    return f.op("MatMul", x, f.op("Cast", w, to=1)), w


def _fp8_dequantize(f: Fragment, x: str, n_in: int = H, n_out: int = N) -> tuple[str, str]:
    """FP8 Q/DQ as passes/quant/fp8.py writes it: DequantizeLinear(float8 weight, scale)."""
    name = f"w_fp8_{len(f.inits)}"
    f.inits.append(helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, [n_in, n_out], [0.5] * n_in * n_out))
    return f.op("MatMul", x, f.op("DequantizeLinear", name, f.scalar(0.5))), name


def _matmul_nbits(f: Fragment, x: str) -> tuple[str, str]:
    """ORT's int4 MatMulNBits: [N, blocks, block_size / 2] packed uint8; one block of 16 over K = 8."""
    w = f.const(np.zeros((N, 1, 8), np.uint8), "w_int4")
    scales = f.const(np.ones(N, np.float32), "scales")
    out = f.op("MatMulNBits", x, w, scales, domain="com.microsoft", K=H, N=N, bits=4, block_size=16)
    return out, w


WEIGHT_FORMS = {  # name: (builder, chain ops, transposed (Gemm transB), source_axis(0), (in, out))
    "matmul_initializer": (_matmul, [], False, 0, (H, N)),
    "matmul_transposed_initializer": (_transposed, ["Transpose"], False, 1, (H, N)),
    "gemm_trans_b": (_gemm, [], True, 1, (H, N)),
    "gemm_trans_b_of_a_transpose": (_gemm_transposed, ["Transpose"], True, 0, (H, N)),
    "constant_node": (_constant_node, [], False, 0, (H, N)),
    "cast_from_fp16": (_cast_fp16, ["Cast"], False, 0, (H, N)),
    "fp8_dequantize_linear": (_fp8_dequantize, ["DequantizeLinear"], False, 0, (H, N)),
}


@pytest.mark.parametrize("name", list(WEIGHT_FORMS))
def test_linear_weight_of_each_form(name: str) -> None:
    build, chain, transposed, axis, shape = WEIGHT_FORMS[name]
    f, out, w = _fragment(build)
    node = f.node(out)
    ref = linear_weight(node)
    assert ref.node is node and ref.value is node.inputs[1] and ref.source is f[w]
    assert [n.op_type for n in ref.chain] == chain and ref.transposed is transposed and not ref.nbits
    assert ref.source_axis(0) == axis and ref.source_axis(1) == 1 - axis
    assert ref.matrix_shape() == shape == linear_shape(node)
    assert ref.tensor.shape == (shape[::-1] if axis else shape)
    assert is_linear(node) and weight_ref(node) is not None


def test_matmul_nbits_weight() -> None:
    f, out, w = _fragment(_matmul_nbits)
    ref = linear_weight(f.node(out))
    assert ref.nbits and ref.source is f[w] and ref.chain == [] and ref.matrix_shape() == (H, N)


def _nbits_of_another_domain(f: Fragment, x: str) -> tuple[str, str]:
    w = f.const(np.zeros((N, 1, 8), np.uint8))
    return f.op("MatMulNBits", x, w, f.const(np.ones(N, np.float32)), domain="custom", K=H, N=N), w


def _nbits_2d_weight(f: Fragment, x: str) -> tuple[str, str]:
    w = f.const(np.zeros((N, 8), np.uint8))
    return f.op("MatMulNBits", x, w, f.const(np.ones(N, np.float32)), domain="com.microsoft", K=H, N=N), w


def _computed(f: Fragment, x: str) -> tuple[str, str]:
    """q @ k^T: the second operand is an activation, not a weight."""
    return f.op("MatMul", x, f.op("Transpose", f.input("k", SEQ), perm=[0, 2, 1])), "k"


def _through_reshape(f: Fragment, x: str) -> tuple[str, str]:
    w = f.weight(H * N)
    return f.op("MatMul", x, f.op("Reshape", w, f.ints(H, N))), w


def _three_d_constant(f: Fragment, x: str) -> tuple[str, str]:
    w = f.weight(2, H, N)
    return f.op("MatMul", x, w), w


def _gemm_trans_a(f: Fragment, x: str) -> tuple[str, str]:
    w = f.weight(H, N)
    return f.op("Gemm", f.op("Transpose", x, perm=[1, 0]), w, transA=1), w


def _relu(f: Fragment, x: str) -> tuple[str, str]:
    return f.op("Relu", x), x


REFUSALS = {  # name: (builder, what NoMatch says)
    "matmul_nbits_of_another_domain": (_nbits_of_another_domain, "MatMulNBits in domain 'custom'"),
    "matmul_nbits_without_3d_weight": (_nbits_2d_weight, "has no constant block-quantized weight"),
    "activation_times_activation": (_computed, "multiplies by a computed tensor"),
    "weight_through_a_reshape": (_through_reshape, "multiplies by a computed tensor"),
    "three_d_constant": (_three_d_constant, "has no 2-D constant weight"),
    "gemm_trans_a": (_gemm_trans_a, "Gemm with transA=1 is not a linear layer"),
    "not_a_matmul": (_relu, "Relu is not a linear layer"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_linear_weight_refuses_with_the_reason(name: str) -> None:
    build, reason = REFUSALS[name]
    f = Fragment(21)
    out, _ = build(f, f.input("x", ["tokens", H] if build is _gemm_trans_a else SEQ))
    f.build(out)
    node = f.node(out)
    with pytest.raises(NoMatch, match=reason):
        linear_weight(node)
    assert weight_ref(node) is None and not is_linear(node)


def test_find_linears_on_a_fragment() -> None:
    """Float-weight MatMuls in graph order; not Gemm, DequantizeLinear weights, activations or int MatMuls;
    the lm_head is the one whose output reaches a graph output without another MatMul."""
    f = Fragment(21)
    x = f.input("x", SEQ)
    plain, plain_w = _matmul(f, x, H, H)
    half, half_w = _cast_fp16(f, plain, H, H)
    quantized, _ = _fp8_dequantize(f, half, H, H)
    scores = f.op("MatMul", x, f.op("Transpose", x, perm=[0, 2, 1]))  # an attention score: no weight
    ints = f.op("MatMul", f.input("ids", ["n", H], INT32), f.const(np.ones((H, 2), np.int32)))
    gemm = f.op("Gemm", f.input("flat", ["tokens", H]), f.weight(N, H), transB=1)
    head_in = f.op("Relu", quantized)
    tied = f.op("Transpose", f.weight(16, H), perm=[1, 0])  # tied: the embedding [vocab, hidden]
    logits = f.op("MatMul", head_in, tied)
    f.build(logits, scores, ints, gemm)
    linears = find_linears(f.model.graph)
    assert [lin.node for lin in linears] == [f.node(plain), f.node(half), f.node(logits)]
    assert [lin.is_lm_head for lin in linears] == [False, False, True]
    first, second, lm_head = linears
    assert first.weight.value is f[plain_w] and not first.weight.transpose and first.width == (H, H)
    assert first.activation is f[x]
    assert second.weight.value is f[half_w] and second.weight.tensor.dtype.name == "FLOAT16"
    assert second.weight.dtype.name == "FLOAT"  # what the MatMul sees, after the Cast
    assert lm_head.weight.transpose and lm_head.width == (H, 16) and lm_head.activation is f[head_in]
