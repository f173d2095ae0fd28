"""The FFN Fusion rewrite: each planned group [i, j] becomes one wide SwiGLU FFN (paper Theorem 3.1).

    x_out = x + sum_k FFN_k(norm(x))  ==  x + W_down_cat (silu(z W_gate_cat) * (z W_up_cat))

with gate and up concatenated along the intermediate dimension and down along its input dimension.
"last" normalizes with the group's last norm weight (the paper); "fold" multiplies each block's own norm
weight into the rows of its W_gate and W_up, so every FFN sees exactly the input it saw in the parallel
form. Fused weights are LazyTensors: they are computed one at a time while the model is saved.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from passes.blocks import Block, find_blocks
from passes.graph import strip_cast
from passes.patterns.swiglu import Weight
from passes.plan import Plan, validate_plan

PLAN_METADATA_KEY = "ffn_fusion.plan"


class FuseFFNGroups(ir.passes.InPlacePass):
    """Rewrite every group of the plan into one wide SwiGLU FFN; record the plan in the metadata."""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        blocks = find_blocks(model)
        validate_plan(self.plan, blocks)
        self._expected_blocks = len(blocks) - self.plan.removed_ffns
        for first, last in self.plan.groups:
            _fuse_group(model.graph, blocks[first : last + 1], self.plan.norm)
        model.metadata_props[PLAN_METADATA_KEY] = self.plan.to_json()
        if self.plan.groups:
            RemoveUnusedNodesPass()(model)
            model.graph.sort()
        return ir.passes.PassResult(model, modified=bool(self.plan.groups))

    def ensures(self, model: ir.Model) -> None:
        count = len(find_blocks(model))
        if count != self._expected_blocks:
            raise AssertionError(f"fused model has {count} blocks, expected {self._expected_blocks}")


def _fuse_group(graph: ir.Graph, group: list[Block], mode: str) -> None:
    first, last = group[0], group[-1]
    prefix = f"ffn_fusion.{first.index}_{last.index}"
    z, row_scales = _shared_norm(graph, group, mode, prefix)
    gate = _initializer(graph, f"{prefix}.gate_proj.weight", [b.ffn.gate for b in group], 1, row_scales)
    up = _initializer(graph, f"{prefix}.up_proj.weight", [b.ffn.up for b in group], 1, row_scales)
    down = _initializer(graph, f"{prefix}.down_proj.weight", [b.ffn.down for b in group], 0, None)
    nodes, output = _swiglu_nodes(z, gate, up, down, prefix)
    residual = last.residual
    graph.insert_before(residual.node, nodes)
    residual.node.replace_input_with(residual.stream_slot, first.ffn_input)
    residual.node.replace_input_with(residual.branch_slot, output)


def _shared_norm(
    graph: ir.Graph, group: list[Block], mode: str, prefix: str
) -> tuple[ir.Value, list[ir.Value] | None]:
    """The fused FFN's input, and the per-block norm weights to fold into gate/up rows ("fold")."""
    norm = group[0].norm
    node, slot = norm.weight_slot
    if mode == "last":
        node.replace_input_with(slot, group[-1].norm.weight)
        return norm.output, None
    row_scales = [strip_cast(b.norm.weight) for b in group]
    if norm.unscaled is not None:
        return norm.unscaled, row_scales
    scale = strip_cast(norm.weight).const_value
    ones = ir.Value(
        name=f"{prefix}.norm_ones", const_value=ir.tensor(np.ones(scale.shape, scale.dtype.numpy()))
    )
    graph.register_initializer(ones)
    node.replace_input_with(slot, ones)
    return norm.output, row_scales


def _initializer(
    graph: ir.Graph, name: str, weights: list[Weight], axis: int, row_scales: list[ir.Value] | None
) -> ir.Value:
    rows, cols = weights[0].shape
    shape = (
        (rows, sum(w.shape[1] for w in weights)) if axis == 1 else (sum(w.shape[0] for w in weights), cols)
    )
    dtype = weights[0].dtype

    def concatenate() -> ir.TensorProtocol:
        # One output buffer, each part copied (and row-scaled for "fold") straight into its slice.
        fused = np.empty(shape, dtype=dtype.numpy())
        offset = 0
        for k, weight in enumerate(weights):
            part = weight.matrix()
            width = part.shape[axis]
            target = fused[:, offset : offset + width] if axis == 1 else fused[offset : offset + width]
            if row_scales is None:
                target[...] = part
            else:
                scale = row_scales[k].const_value.numpy().astype(np.float32)[:, None]
                target[...] = (part.astype(np.float32, copy=False) * scale).astype(fused.dtype, copy=False)
            offset += width
            del part
            weight.release()
        return ir.tensor(fused, dtype=dtype, name=name)

    tensor = ir.LazyTensor(concatenate, dtype=dtype, shape=ir.Shape(shape), name=name)
    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _swiglu_nodes(
    z: ir.Value, gate: ir.Value, up: ir.Value, down: ir.Value, prefix: str
) -> tuple[list[ir.Node], ir.Value]:
    def node(op: str, inputs: list[ir.Value], suffix: str) -> ir.Node:
        out = ir.Value(name=f"{prefix}.{suffix}")
        return ir.Node("", op, inputs, outputs=[out], name=f"{prefix}/{suffix}")

    gate_out = node("MatMul", [z, gate], "gate")
    sigmoid = node("Sigmoid", [gate_out.outputs[0]], "sigmoid")
    silu = node("Mul", [gate_out.outputs[0], sigmoid.outputs[0]], "silu")
    up_out = node("MatMul", [z, up], "up")
    product = node("Mul", [silu.outputs[0], up_out.outputs[0]], "product")
    down_out = node("MatMul", [product.outputs[0], down], "down")
    nodes = [gate_out, sigmoid, silu, up_out, product, down_out]
    return nodes, down_out.outputs[0]
