"""Linear layers of a graph: MatMuls whose B input is a constant 2-D float weight (FP8 quantizes them).

The weight may be an initializer or a Constant node, reached through Transpose, Cast and Identity nodes.
The lm_head is the linear layer from which a graph output is reached without passing another MatMul.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir

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


def _constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    if value.is_graph_input():
        return None
    if value.const_value is not None and value.is_initializer():
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.value
    return None


def _weight_source(value: ir.Value) -> WeightSource | None:
    """Follow Transpose/Cast/Identity back to a constant 2-D weight; None if B is not constant."""
    transpose = False
    dtype = value.dtype
    for _ in range(8):
        tensor = _constant_tensor(value)
        if tensor is not None:
            if len(tensor.shape) != 2 or not tensor.dtype.is_floating_point():
                return None
            return WeightSource(value=value, tensor=tensor, transpose=transpose, dtype=dtype or tensor.dtype)
        producer = value.producer()
        if producer is None or producer.domain != "" or producer.op_type not in _PASSTHROUGH_WEIGHT_OPS:
            return None
        if producer.op_type == "Transpose":
            perm = producer.attributes.get("perm")
            if perm is not None and list(perm.as_ints()) != [1, 0]:
                return None
            transpose = not transpose
        if producer.op_type == "Cast" and dtype is None:
            dtype = ir.DataType(producer.attributes["to"].as_int())
        value = producer.inputs[0]
        if value is None:
            return None
    return None


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
        source = _weight_source(b)
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
