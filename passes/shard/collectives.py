"""The collectives of tensor-parallel rank graphs: DistCollective nodes, and counting all-reduces.

After each row-parallel MatMul comes exactly one all-reduce: a `DistCollective` node (domain "trt";
TensorRT's ONNX parser matches the op by name and ignores the domain) with
collective_operation="all_reduce", reduce_op="sum", root=-1, group_size=0, nb_rank=N. A vocabulary-split
lm_head gathers its logits with one all_gather. A parallel group of blocks reduces its members' attention
outputs in one all-reduce (Concat on the last axis -> all_reduce -> Split back) and the sum of its FFN
outputs in another.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx_ir as ir

from passes.errors import UserError
from passes.io.model_io import load_model, load_proto
from passes.metadata import HF_METADATA_KEY, recorded_plan
from passes.shard.roles import WeightRef, find_structure
from passes.shard.value_types import walk_type

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
    _redirect(graph, value, reduced, list(value.uses()))
    node = collective_node([value], reduced, operation, tp, name=f"{value.name}/{operation}")
    graph.insert_after(value.producer(), node)
    return reduced


def insert_stacked_allreduce(graph: ir.Graph, values: list[ir.Value], width: int, tp: int, name: str) -> None:
    """One all-reduce for several values of last dim `width`: Concat(values, axis=-1) -> all_reduce ->
    Split(axis=-1) back, each value's readers reading its reduced part. The graph needs sorting after."""
    for value in values:
        if value.type is None:
            value.type = walk_type(value)
    readers = [list(value.uses()) for value in values]  # before the Concat reads them too
    first = values[0]
    shape = None
    if first.shape is not None and first.shape.rank():
        shape = ir.Shape([*first.shape[:-1], width * len(values)])
    stacked = ir.Value(name=f"{name}_stacked", type=first.type, shape=shape)
    concat = ir.Node("", "Concat", values, attributes=[ir.AttrInt64("axis", -1)], outputs=[stacked],
                     name=f"{name}/stack")
    reduced = ir.Value(name=f"{name}_all_reduce", type=first.type, shape=shape)
    collective = collective_node([stacked], reduced, "all_reduce", tp, name=f"{name}/all_reduce")
    parts = [ir.Value(name=f"{v.name}_all_reduce", type=v.type, shape=v.shape) for v in values]
    sizes = np.full(len(values), width, dtype=np.int64)
    if graph.opset_imports.get("", 13) >= 13:  # split sizes are an input from opset 13, an attribute before
        split_sizes = ir.Value(name=f"{name}_split", shape=ir.Shape([len(values)]),
                               type=ir.TensorType(ir.DataType.INT64),
                               const_value=ir.tensor(sizes, name=f"{name}_split"))
        graph.register_initializer(split_sizes)
        split = ir.Node("", "Split", [reduced, split_sizes], attributes=[ir.AttrInt64("axis", -1)],
                        outputs=parts, name=f"{name}/unstack")
    else:
        split = ir.Node("", "Split", [reduced], attributes=[ir.AttrInt64("axis", -1),
                        ir.AttrInt64s("split", sizes.tolist())], outputs=parts, name=f"{name}/unstack")
    for value, part, uses in zip(values, parts, readers, strict=True):
        _redirect(graph, value, part, uses)
    graph.extend([concat, collective, split])


def _redirect(graph: ir.Graph, value: ir.Value, replacement: ir.Value, uses: list) -> None:
    """`uses` (readers of `value`, taken before the collective that reads it was made) and any graph output
    that is `value` read `replacement` instead."""
    for use in uses:
        use.node.replace_input_with(use.idx, replacement)
    for i, out in enumerate(graph.outputs):
        if out is value:
            graph.outputs[i] = replacement


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
    counts 1 instead of k, and a parallel group of k blocks 2 instead of 2k.
    """
    if not isinstance(model, ir.Model):
        model = load_model(Path(model))
    found = collectives(model)
    if found:
        return sum(collective_op(n) == "all_reduce" for n in found)
    return find_structure(model).allreduces


def allreduce_line(path: str | Path) -> str:
    """'PATH: N all-reduces per forward pass' and what the model's plan (its metadata) saved: k - 1 per fused
    group of k FFNs, 2k - 2 per parallel group of k blocks."""
    path = Path(path)
    line = f"{path}: {count_allreduces(path)} all-reduces per forward pass"
    recorded = {p.key: p.value for p in load_proto(path).metadata_props}
    plan = recorded_plan(recorded, source=str(path))
    if plan is None:
        return line
    notes = []
    if groups := plan.groups:
        removed = sum(_ffn_members(recorded, i, j) - 1 for i, j in groups)
        notes.append(f"fused: {len(groups)} group(s), {removed} FFN all-reduce(s) removed")
    if parallel := plan.parallel:
        removed = sum(2 * (j - i) for i, j in parallel)
        shown = ", ".join(f"[{i}, {j}]" for i, j in parallel)
        notes.append(f"parallel blocks {shown}: 2 all-reduces per group, {removed} removed")
    return line + (f" ({'; '.join(notes)})" if notes else "")


def _ffn_members(metadata: dict[str, str], first: int, last: int) -> int:
    """SwiGLU FFNs a group [first, last] fused: by the exporter's layer map when the model has one (an
    identity or attention-only layer inside a group has no FFN), else every layer of the group."""
    try:
        kinds = json.loads(metadata[HF_METADATA_KEY])["layer_kinds"][first : last + 1]
        return sum(kind.split("+")[1].startswith("swiglu") for kind in kinds)
    except (KeyError, IndexError, TypeError, ValueError):
        return last - first + 1


def collective_op(node: ir.Node) -> str:
    attr = node.attributes.get("collective_operation")
    value = attr.value if attr is not None else ""
    return value.decode() if isinstance(value, bytes) else str(value)


def reject_rank_graph(model: ir.Model) -> None:
    if collectives(model):
        raise UserError("the model already has DistCollective nodes (it is a rank graph); shard the original")
