"""passes.io.sessions: one session factory, safe for FP8 Q/DQ graphs, for files and in-memory protos."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.errors import UserError
from passes.io.sessions import open_session, providers_for


def _relu_fp8_matmul(folder=None) -> onnx.ModelProto:
    """x -> Relu -> QuantizeLinear(float8e4m3fn, zero point 0) -> DequantizeLinear -> MatMul(w)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.float32(0.05), "scale"),
        helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0]),
        numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "scale", "zero"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"]),
        helper.make_node("MatMul", ["dq", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_fp8_relu_is_kept(tmp_path):
    """With ORT's ReluQuantRewrite on, the Relu is dropped and negative inputs leak through."""
    model = _relu_fp8_matmul()
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    w = numpy_helper.to_array(model.graph.initializer[2])
    expected = np.maximum(x, 0) @ w
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for source in (model, path):
        (got,) = open_session(source, threads=1).run(None, {"x": x})
        np.testing.assert_allclose(got, expected, rtol=0.1, atol=0.05)


def test_providers():
    assert providers_for("cpu") == ["CPUExecutionProvider"]
    assert providers_for("auto")[-1] == "CPUExecutionProvider"
    with pytest.raises(UserError, match="unknown device"):
        providers_for("tpu")


def test_bfloat16_graph_on_cpu_is_a_user_error() -> None:
    """The CPU provider has no bfloat16 Mul: the user is told to export float32, not to report a bug."""
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UserError, match=r"cannot run this bfloat16 graph .*--dtype float32"):
        open_session(model)
