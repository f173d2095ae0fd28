"""The symbolic shape interpreter (passes/shapes.py): its rule table against ONNX's own shape inference on
one-node graphs, symbolic dims and shape vectors, and what an op without a rule gets."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.shapes import ONE, UNKNOWN, Dim, Info, World, broadcast, infer_node

FLOAT = TensorProto.FLOAT


def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list[int | str]],
    constants: dict[str, np.ndarray] | None = None,
    outputs: tuple[str, ...] = ("y",),
    annotations: dict[str, list[int | str]] | None = None,
) -> onnx.ModelProto:
    """A float graph; `constants` become initializers; outputs have no shape unless `annotations` gives one
    (and no element type, which ONNX infers)."""
    annotations = annotations or {}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, annotations.get(n)) for n in outputs],
        [numpy_helper.from_array(a, n) for n, a in (constants or {}).items()],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _world(model: onnx.ModelProto) -> tuple[World, dict[str, ir.Value]]:
    graph = ir.from_proto(model).graph
    values = {v.name: v for node in graph for v in node.outputs}
    return World(graph).run(), values


def _ints(info: Info) -> list[int]:
    assert info.shape is not None and all(d is not None and d.is_int for d in info.shape), info
    return [int(d) for d in info.shape]  # type: ignore[arg-type]


def _onnx_shape(model: onnx.ModelProto, name: str) -> list[int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    for value in inferred.graph.output:
        if value.name == name:
            return [d.dim_value for d in value.type.tensor_type.shape.dim]
    raise KeyError(name)


i64 = np.array

# op -> (node, input shapes, constants): every output shape is concrete, so ONNX infers it too.
CASES = {
    "Transpose": (helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1]), {"x": [2, 3, 4]}, {}),
    "Transpose reversed": (helper.make_node("Transpose", ["x"], ["y"]), {"x": [2, 3, 4]}, {}),
    "Reshape 0 and -1": (
        helper.make_node("Reshape", ["x", "s"], ["y"]),
        {"x": [2, 3, 4]},
        {"s": i64([0, -1, 2])},
    ),
    "Squeeze": (helper.make_node("Squeeze", ["x", "a"], ["y"]), {"x": [2, 1, 4, 1]}, {"a": i64([-1])}),
    "Squeeze all": (helper.make_node("Squeeze", ["x"], ["y"]), {"x": [1, 3, 1]}, {}),
    "Unsqueeze": (helper.make_node("Unsqueeze", ["x", "a"], ["y"]), {"x": [2, 4]}, {"a": i64([0, -1])}),
    "Concat": (
        helper.make_node("Concat", ["x", "z"], ["y"], axis=-1),
        {"x": [2, 3, 4], "z": [2, 3, 5]},
        {},
    ),
    "Gather": (
        helper.make_node("Gather", ["x", "i"], ["y"], axis=1),
        {"x": [2, 5, 4]},
        {"i": i64([[0, 1, 2], [3, 4, 0]])},
    ),
    "Slice with steps": (
        helper.make_node("Slice", ["x", "b", "e", "a", "st"], ["y"]),
        {"x": [6, 10]},
        {"b": i64([1, -1]), "e": i64([2**63 - 1, 0]), "a": i64([0, 1]), "st": i64([2, -3])},
    ),
    "Expand": (helper.make_node("Expand", ["x", "s"], ["y"]), {"x": [3, 1]}, {"s": i64([2, 3, 5])}),
    "MatMul batched": (
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        {"x": [2, 1, 3, 4], "w": [5, 4, 6]},
        {},
    ),
    "Gemm transB": (helper.make_node("Gemm", ["x", "w"], ["y"], transB=1), {"x": [3, 4], "w": [7, 4]}, {}),
    "ReduceMean": (
        helper.make_node("ReduceMean", ["x", "a"], ["y"], keepdims=0),
        {"x": [2, 3, 4]},
        {"a": i64([1])},
    ),
    "ReduceSum keepdims": (
        helper.make_node("ReduceSum", ["x", "a"], ["y"]),
        {"x": [2, 3, 4]},
        {"a": i64([0, 2])},
    ),
    "Where": (helper.make_node("Where", ["c", "x", "z"], ["y"]), {"c": [3, 1], "x": [1, 4], "z": [4]}, {}),
    "Add broadcast": (helper.make_node("Add", ["x", "z"], ["y"]), {"x": [2, 1, 4], "z": [3, 1]}, {}),
    "Softmax": (helper.make_node("Softmax", ["x"], ["y"], axis=-1), {"x": [2, 3]}, {}),
    "Tile": (helper.make_node("Tile", ["x", "r"], ["y"]), {"x": [2, 3]}, {"r": i64([3, 2])}),
    "Shape start end": (helper.make_node("Shape", ["x"], ["y"], start=1, end=-1), {"x": [2, 3, 4, 5]}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_rules_agree_with_onnx_shape_inference(case: str) -> None:
    node, inputs, constants = CASES[case]
    model = _model([node], inputs, constants)
    world, values = _world(model)
    assert _ints(world.get(values["y"])) == _onnx_shape(model, "y")


def test_split_into_given_and_equal_parts() -> None:
    sizes = helper.make_node("Split", ["x", "s"], ["a", "b"], axis=1)
    equal = helper.make_node("Split", ["x"], ["c", "d", "e"], axis=2, num_outputs=3)
    model = _model([sizes, equal], {"x": [2, 6, 9]}, {"s": i64([2, 4])}, outputs=("a", "b", "c", "d", "e"))
    world, values = _world(model)
    for name in "abcde":
        assert _ints(world.get(values[name])) == _onnx_shape(model, name), name


def test_symbolic_dims_and_shape_vectors() -> None:
    """Shape -> Gather -> Unsqueeze -> Concat carries [batch, seq] into a Reshape; Div splits a symbolic
    product; MatMul keeps the symbols."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["b"]),
        helper.make_node("Gather", ["shape", "one"], ["s"]),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
        helper.make_node("Unsqueeze", ["s", "axis0"], ["s1"]),
        helper.make_node("Concat", ["b1", "s1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Mul", ["b1", "s1"], ["tokens"]),
        helper.make_node("Div", ["tokens", "s1"], ["back"]),
        helper.make_node("MatMul", ["x", "w"], ["proj"]),
    ]
    constants = {
        "zero": i64(0),
        "one": i64(1),
        "axis0": i64([0]),
        "heads": i64([4, 16]),
        "w": np.zeros((64, 32), np.float32),
    }
    model = _model(nodes, {"x": ["batch", "seq", 64]}, constants, outputs=("y", "back", "proj"))
    world, values = _world(model)
    batch, seq = Dim.of("batch"), Dim.of("seq")
    assert world.get(values["target"]).value == (batch, seq, Dim(4), Dim(16))
    assert world.get(values["y"]).shape == (batch, seq, Dim(4), Dim(16))
    assert world.get(values["tokens"]).value == (Dim(1, ("batch", "seq")),)
    assert world.get(values["back"]).value == (batch,)
    assert world.get(values["proj"]).shape == (batch, seq, Dim(32))


def test_an_op_without_a_rule_falls_back_to_the_annotation() -> None:
    """TopK has no rule: its output keeps the exporter's annotation, or stays unknown without one; a
    contrib op is looked up in its own domain (com.microsoft Gelu has no rule, its RotaryEmbedding has)."""
    nodes = [
        helper.make_node("TopK", ["x", "k"], ["annotated", "idx"], axis=-1),
        helper.make_node("TopK", ["x", "k"], ["bare", "idx2"], axis=-1),
        helper.make_node("Gelu", ["x"], ["ms_gelu"], domain="com.microsoft"),
        helper.make_node("RotaryEmbedding", ["x", "p", "c", "c"], ["rotated"], domain="com.microsoft"),
        helper.make_node("Relu", ["x"], ["relu"], domain="ai.onnx"),
    ]
    constants = {"k": i64([2]), "p": i64([[0, 1, 2]]), "c": np.zeros((3, 4), np.float32)}
    model = _model(
        nodes,
        {"x": [1, 3, 8]},
        constants,
        outputs=("annotated", "bare", "ms_gelu", "rotated", "relu"),
        annotations={"annotated": [1, 3, 2]},
    )
    graph = ir.from_proto(model).graph
    topk = graph.node(0)
    assert infer_node(topk, [Info((Dim(1), Dim(3), Dim(8))), Info((Dim(1),), (Dim(2),))]) is None
    world, values = _world(model)
    assert _ints(world.get(values["annotated"])) == [1, 3, 2]
    assert world.get(values["bare"]) == UNKNOWN
    assert world.get(values["ms_gelu"]) == UNKNOWN
    assert _ints(world.get(values["rotated"])) == [1, 3, 8]
    assert _ints(world.get(values["relu"])) == [1, 3, 8]


def test_grouped_query_attention_shapes() -> None:
    """ONNX Runtime's GroupQueryAttention: the output has the query width, present K/V the KV heads."""
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v"],
        ["y", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=8,
        kv_num_heads=2,
    )
    model = _model(
        [node],
        {"q": ["batch", "seq", 64], "k": ["batch", "seq", 16], "v": ["batch", "seq", 16]},
        outputs=("y", "present_key", "present_value"),
    )
    world, values = _world(model)
    batch, seq = Dim.of("batch"), Dim.of("seq")
    assert world.get(values["y"]).shape == (batch, seq, Dim(64))
    assert world.get(values["present_key"]).shape == (batch, Dim(2), None, Dim(8))


def test_broadcast_conflict_raises() -> None:
    node = ir.node("Add", [ir.Value(name="a"), ir.Value(name="b")])
    with pytest.raises(ValueError, match=r"cannot broadcast \[2, 3\] with \[1, 4\]"):
        infer_node(node, [Info((Dim(2), Dim(3))), Info((Dim(4),))])


def test_broadcast_of_symbolic_dims_follows_onnx() -> None:
    """A symbol may be 1 at run time: against an integer it gives the integer, against another symbol an
    unknown dim (a mask's 'total' and the scores' 'seq'); only two integers conflict."""
    batch, seq, total = Dim.of("batch"), Dim.of("seq"), Dim.of("total")
    assert broadcast((batch, Dim(4), seq, seq), (batch, ONE, seq, total)) == (batch, Dim(4), seq, None)
    assert broadcast((seq, Dim(4)), (Dim(8), seq)) == (Dim(8), Dim(4))


def test_world_gives_unknown_outputs_where_a_rule_cannot_reconcile_its_inputs() -> None:
    """A graph whose shapes conflict (it would fail at run time): the node's outputs are unknown, not an
    exception out of World.run (the recognizers read the world and must refuse, not crash)."""
    model = _model([helper.make_node("Add", ["x", "z"], ["y"])], {"x": [2, 3], "z": [4]})
    world, values = _world(model)
    assert world.get(values["y"]).shape is None
