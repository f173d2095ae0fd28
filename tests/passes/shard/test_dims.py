"""The symbolic shape interpreter (passes.shapes) and the rank world (passes.shard.dims) on small graphs."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.errors import UserError
from passes.shapes import Dim, Info, World
from passes.shard.dims import HeadMap, RankWorld, _map_group

D = Dim


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.shape, value.type = ir.Shape(list(array.shape)), ir.TensorType(ir.tensor(array).dtype)
    graph.register_initializer(value)
    return value


def _graph(build) -> tuple[ir.Graph, dict[str, ir.Value]]:
    x = ir.Value(name="x", shape=ir.Shape([ir.SymbolicDim("batch"), ir.SymbolicDim("seq"), 72]))
    x.type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 18})
    values = build(graph, x)
    graph.outputs.append(values["out"])
    return graph, values


def _add(graph: ir.Graph, op: str, inputs: list[ir.Value], **attributes) -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes)
    graph.append(node)
    return node.outputs[0]


# ------------------------------------------------------------------------------------------ head mapping


@pytest.mark.parametrize(
    ("dims", "want", "full", "rank", "expect"),
    [
        ((9, 8), 16, (9, 3, 3), (2, 1, 2), (2, 8)),  # SmolLM2 q view at tp=8: heads, not head_dim
        ((3, 3), 2, (9, 3, 3), (2, 1, 2), (1, 2)),  # [KV, G] at tp=8: KV outer, group inner
        ((3, 3), 6, (9, 3, 3), (6, 2, 3), (2, 3)),  # tp=2: two KV heads of three queries
        ((8, 8), 8, (8, 2, 4), (1, 1, 1), (1, 8)),  # one change suffices: the heads
    ],
)
def test_head_groups_map_to_the_rank(dims, want, full, rank, expect) -> None:
    heads = HeadMap(full, rank)
    assert _map_group([D(d) for d in dims], D(want), heads) == [D(e) for e in expect]


def test_repeat_axis_maps_to_the_rank_group() -> None:
    heads = HeadMap((9, 3, 3), (2, 1, 2))
    assert heads.candidates(D(3), repeat=True)[0] == D(2)  # G, not KV (both 3 in SmolLM2)
    assert heads.candidates(D(72, ("batch",)))[-1] == D(72, ("batch",))  # unchanged is the last resort


# ------------------------------------------------------------------------------------------ shape vectors


def test_torchscript_shape_vectors_carry_values() -> None:
    """Shape -> Mod -> Reshape -> Slice, and expand's Where(Equal(shape, -1), 1, shape), keep values."""

    def build(graph: ir.Graph, x: ir.Value) -> dict[str, ir.Value]:
        shape = _add(graph, "Shape", [x])
        end = _add(graph, "Mod", [_const(graph, "two", np.array([2])), _const(graph, "three", np.array([3]))])
        end = _add(graph, "Reshape", [end, _const(graph, "one", np.array([1]))])
        head = _add(graph, "Slice", [shape, _const(graph, "zero", np.array([0])), end])
        target = _add(graph, "Concat", [head, _const(graph, "hd", np.array([9, 8]))], axis=0)
        ones = _add(
            graph, "ConstantOfShape", [_add(graph, "Shape", [target])], value=ir.tensor(np.array([1]))
        )
        minus = _add(graph, "Mul", [ones, _const(graph, "m1", np.array([-1]))])
        safe = _add(graph, "Where", [_add(graph, "Equal", [target, minus]), ones, target])
        tiled = _add(graph, "Tile", [x, _const(graph, "reps", np.array([1, 1, 2]))])
        return {"target": target, "safe": safe, "tiled": tiled, "out": safe}

    graph, v = _graph(build)
    world = World(graph).run()
    expected = (D(1, ("batch",)), D(1, ("seq",)), D(9), D(8))
    assert world.get(v["target"]).value == expected
    assert world.get(v["safe"]).value == expected
    assert world.get(v["tiled"]).shape == (D(1, ("batch",)), D(1, ("seq",)), D(144))


# ------------------------------------------------------------------------------------------ rank world


def _q_view(graph: ir.Graph, x: ir.Value) -> dict[str, ir.Value]:
    weight = _const(graph, "q", np.zeros((72, 72), np.float32))
    q = _add(graph, "MatMul", [x, weight])
    view = _add(graph, "Reshape", [q, _const(graph, "view", np.array([0, 0, 9, 8]))])
    return {"weight": weight, "view": view, "out": _add(graph, "Softmax", [view], axis=-1)}


def test_rank_world_rewrites_the_head_count() -> None:
    graph, v = _graph(_q_view)
    full = World(graph).run()
    heads = HeadMap((9, 3, 3), (2, 1, 2))
    seeds = {v["weight"]: Info((D(72), D(16)))}
    rank = RankWorld(full, seeds, lambda node: heads, set(), lambda node: "test").run()
    assert [(r.node.op_type, r.values) for r in rank.rewrites] == [("Reshape", [None, None, 2, None])]
    assert rank.get(v["view"]).shape == (D(1, ("batch",)), D(1, ("seq",)), D(2), D(8))


def test_rank_world_refuses_work_along_a_sharded_axis() -> None:
    def build(graph: ir.Graph, x: ir.Value) -> dict[str, ir.Value]:
        weight = _const(graph, "w", np.zeros((72, 40), np.float32))
        scores = _add(graph, "MatMul", [x, weight])
        return {"weight": weight, "out": _add(graph, "Softmax", [scores], axis=-1)}

    graph, v = _graph(build)
    seeds = {v["weight"]: Info((D(72), D(20)))}
    with pytest.raises(UserError, match="Softmax node .* works along a sharded axis"):
        RankWorld(World(graph).run(), seeds, lambda node: None, set(), lambda node: "branch 1").run()
