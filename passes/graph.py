"""Small helpers over onnx-ir values and nodes that the recognizers share."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir


class NoMatch(Exception):
    """A recognizer did not match; the message says what it found instead."""


def producer(value: ir.Value | None, *op_types: str) -> ir.Node:
    """The node that produces `value`, which must be one of `op_types`."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type not in op_types:
        found = "a graph input or initializer" if node is None else node.op_type
        raise NoMatch(f"expected {' or '.join(op_types)}, found {found}")
    return node


def maybe_producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type in op_types else None


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or Constant-node output, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None


def scalar(value: ir.Value | None) -> float | None:
    array = constant(value)
    return float(array.reshape(())) if array is not None and array.size == 1 else None


def other_input(node: ir.Node, value: ir.Value) -> ir.Value:
    """For a binary node with `value` as one operand, the other operand."""
    a, b = node.inputs[0], node.inputs[1]
    if a is value:
        return b
    if b is value:
        return a
    raise NoMatch(f"{node.op_type} does not consume {value.name}")


def attr(node: ir.Node, name: str, default):
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def strip_cast(value: ir.Value) -> ir.Value:
    """Look through Cast nodes (fp16/bf16 models compute norms in float32)."""
    while (node := maybe_producer(value, "Cast")) is not None:
        value = node.inputs[0]
    return value


def is_initializer(value: ir.Value | None) -> bool:
    return value is not None and value.const_value is not None


def reduce_axes(node: ir.Node) -> list[int] | None:
    """ReduceMean axes from the attribute (opset < 18) or the second input (opset >= 18)."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = constant(node.inputs[1])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    axes = attr(node, "axes", None)
    return None if axes is None else [int(a) for a in axes]


def is_last_axis(axes: list[int] | None, value: ir.Value) -> bool:
    if axes is None or len(axes) != 1:
        return False
    rank = value.shape.rank() if value.shape is not None else None
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def graph_values(graph: ir.Graph) -> Iterable[ir.Value]:
    """The graph's inputs and every node's outputs."""
    yield from graph.inputs
    for node in graph:
        yield from node.outputs
