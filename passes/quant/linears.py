"""Linear layers of a graph: MatMuls whose B input is a constant 2-D float weight (FP8 quantizes them).

The weight may be an initializer or a Constant node, reached through Transpose, Cast and Identity nodes
(passes.patterns.linear finds it).
The lm_head is the linear layer from which a graph output is reached without passing another MatMul.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir

from passes.graph import attr
from passes.patterns.linear import weight_ref

_PASSTHROUGH_WEIGHT_OPS = ("Transpose", "Cast", "Identity")


@dataclass(frozen=True)
class WeightSource:
    """The constant weight behind a MatMul's B input."""

    value: ir.Value  # initializer, or the output of a Constant node
    tensor: ir.TensorProtocol
    transpose: bool  # True when the stored tensor is [out, in]
    dtype: ir.DataType  # what the MatMul sees (after any Cast)


@dataclass(frozen=True)
class Linear:
    node: ir.Node
    activation: ir.Value
    weight: WeightSource
    is_lm_head: bool

    @property
    def width(self) -> tuple[int, int]:
        """(in, out) of the weight as the MatMul sees it."""
        rows, cols = (int(d) for d in self.weight.tensor.shape)
        return (cols, rows) if self.weight.transpose else (rows, cols)


def _weight_source(node: ir.Node) -> WeightSource | None:
    """The float constant 2-D weight behind a MatMul's B input; None if B is not one. DequantizeLinear is
    no passthrough here: a weight behind one is quantized already."""
    ref = weight_ref(node)
    if ref is None or any(n.op_type not in _PASSTHROUGH_WEIGHT_OPS for n in ref.chain):
        return None
    tensor = ref.tensor
    if not tensor.dtype.is_floating_point():
        return None
    casts = [n for n in ref.chain if n.op_type == "Cast"]
    dtype = ref.value.dtype or (ir.DataType(attr(casts[-1], "to", 0)) if casts else tensor.dtype)
    return WeightSource(value=ref.source, tensor=tensor, transpose=ref.source_axis(0) == 1, dtype=dtype)


def _reaches_output_without_matmul(value: ir.Value) -> bool:
    seen: set[int] = set()
    stack = [value]
    while stack:
        current = stack.pop()
        if current.is_graph_output():
            return True
        for node in current.consumers():
            if id(node) in seen or node.op_type in ("MatMul", "Gemm"):
                continue
            seen.add(id(node))
            stack.extend(node.outputs)
    return False


def find_linears(graph: ir.Graph) -> list[Linear]:
    """All linear layers (MatMul with a constant 2-D B) in graph order."""
    found = []
    for node in graph:
        if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if a is None or b is None or (a.dtype is not None and not a.dtype.is_floating_point()):
            continue
        source = _weight_source(node)
        if source is None or not source.dtype.is_floating_point():
            continue
        lm_head = _reaches_output_without_matmul(node.outputs[0])
        found.append(Linear(node=node, activation=a, weight=source, is_lm_head=lm_head))
    return found


def graph_values(graph: ir.Graph) -> Iterable[ir.Value]:
    """The graph's inputs and every node's outputs."""
    yield from graph.inputs
    for node in graph:
        yield from node.outputs
