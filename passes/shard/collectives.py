"""The collectives of tensor-parallel rank graphs: DistCollective nodes, and counting all-reduces.

After each row-parallel MatMul comes exactly one all-reduce: a `DistCollective` node (domain "trt";
TensorRT's ONNX parser matches the op by name and ignores the domain) with
collective_operation="all_reduce", reduce_op="sum", root=-1, group_size=0, nb_rank=N. A vocabulary-split
lm_head gathers its logits with one all_gather.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx_ir as ir

from passes.errors import UserError
from passes.io.model_io import load_model
from passes.shard.graph import WeightRef, find_structure
from passes.shard.types import walk_type

COLLECTIVE_OP = "DistCollective"


COLLECTIVE_DOMAIN = "trt"


def collective_node(inputs: list[ir.Value], output: ir.Value, operation: str, tp: int, name: str) -> ir.Node:
    attributes = [
        ir.AttrString("collective_operation", operation),
        ir.AttrString("reduce_op", "sum" if operation == "all_reduce" else "none"),
        ir.AttrInt64("root", -1),
        ir.AttrInt64("group_size", 0),
        ir.AttrInt64("nb_rank", tp),
    ]
    return ir.Node(
        COLLECTIVE_DOMAIN, COLLECTIVE_OP, inputs, attributes=attributes, outputs=[output], name=name
    )


def insert_collective(graph: ir.Graph, value: ir.Value, operation: str, tp: int) -> ir.Value:
    """Insert value -> DistCollective -> new value, moving every use of `value` to the new value."""
    if value.type is None:
        value.type = walk_type(value)
    reduced = ir.Value(name=f"{value.name}_{operation}", type=value.type, shape=value.shape)
    for use in list(value.uses()):
        use.node.replace_input_with(use.idx, reduced)
    for i, out in enumerate(graph.outputs):
        if out is value:
            graph.outputs[i] = reduced
    node = collective_node([value], reduced, operation, tp, name=f"{value.name}/{operation}")
    graph.insert_after(value.producer(), node)
    return reduced


def gather_logits(graph: ir.Graph, head: WeightRef, vocab: int, tp: int) -> None:
    """logits_r [.., V/tp] -> transpose to axis 0 -> all_gather -> transpose back -> slice to V."""
    value = head.node.outputs[0]
    rank = value.shape.rank() if value.shape is not None else 3
    perm = list(range(rank))
    perm[0], perm[-1] = perm[-1], perm[0]
    name = value.name
    value.name = f"{name}_vocab_shard"
    uses = list(value.uses())
    outputs = [i for i, o in enumerate(graph.outputs) if o is value]
    t1 = ir.node("Transpose", [value], attributes={"perm": perm})
    t1.outputs[0].name = f"{name}_vocab_shard_t"
    gathered = ir.Value(name=f"{name}_gathered_t", type=value.type)
    gather = collective_node([t1.outputs[0]], gathered, "all_gather", tp, name=f"{name}/all_gather")
    t2 = ir.node("Transpose", [gathered], attributes={"perm": perm})
    nodes = [t1, gather, t2]
    last = t2.outputs[0]
    padded = math.ceil(vocab / tp) * tp
    if padded != vocab:
        t2.outputs[0].name = f"{name}_padded"
        starts = ir.tensor(np.array([0], np.int64), name=f"{name}_slice_start")
        ends = ir.tensor(np.array([vocab], np.int64), name=f"{name}_slice_end")
        axes = ir.tensor(np.array([-1], np.int64), name=f"{name}_slice_axis")
        consts = []
        for t in (starts, ends, axes):
            v = ir.Value(
                name=t.name, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64), const_value=t
            )
            graph.register_initializer(v)
            consts.append(v)
        sl = ir.node("Slice", [last, *consts])
        nodes.append(sl)
        last = sl.outputs[0]
    last.name = name
    last.type = value.type
    last.shape = None
    graph.insert_after(head.node, nodes)
    for use in uses:
        use.node.replace_input_with(use.idx, last)
    for i in outputs:
        graph.outputs[i] = last
    value.shape = None


def collectives(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == COLLECTIVE_OP]


def count_allreduces(model: ir.Model | str | Path) -> int:
    """All-reduces per forward pass under tensor parallelism.

    For a rank graph: its all_reduce DistCollective nodes. For a single-device model: one per residual
    branch (every attention and every FFN ends in a row-parallel projection), so a fused group of k FFNs
    counts 1 instead of k.
    """
    if not isinstance(model, ir.Model):
        model = load_model(Path(model))
    found = collectives(model)
    if found:
        return sum(collective_op(n) == "all_reduce" for n in found)
    return len(find_structure(model).branches)


def collective_op(node: ir.Node) -> str:
    attr = node.attributes.get("collective_operation")
    value = attr.value if attr is not None else ""
    return value.decode() if isinstance(value, bytes) else str(value)


def reject_rank_graph(model: ir.Model) -> None:
    if collectives(model):
        raise UserError("the model already has DistCollective nodes (it is a rank graph); shard the original")
