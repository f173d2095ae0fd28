"""Small helpers over onnx-ir values and nodes that the recognizers (and the passes reading their records)
share: NoMatch and matching a producer, constants, attributes, casts, ranks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np
import onnx_ir as ir

from passes.shapes import graph_shapes

T = TypeVar("T")


class NoMatch(Exception):
    """A recognizer did not match; the message says what it found instead."""


class _Progress(threading.local):
    """How many nodes the recognizers have matched so far (in this thread): `first_match` compares attempts
    by it."""

    matched = 0


_progress = _Progress()


def producer(value: ir.Value | None, *op_types: str) -> ir.Node:
    """The node that produces `value`, which must be one of `op_types`."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type not in op_types:
        found = "a graph input or initializer" if node is None else node.op_type
        raise NoMatch(f"expected {' or '.join(op_types)}, found {found}")
    _progress.matched += 1
    return node


def maybe_producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type not in op_types:
        return None
    _progress.matched += 1
    return node


def first_match(*attempts: Callable[[], T]) -> T:
    """The result of the first attempt that matches. When none does, the NoMatch of the attempt that got
    furthest (matched the most nodes): a recognizer that tries a Mul's operands in both orders must say why
    the right order failed, not the wrong one. Attempts that got equally far give both reasons."""
    failures: list[tuple[int, NoMatch]] = []
    for attempt in attempts:
        before = _progress.matched
        try:
            return attempt()
        except NoMatch as exc:
            failures.append((_progress.matched - before, exc))
    furthest = max(depth for depth, _ in failures)
    reasons = list(dict.fromkeys(str(exc) for depth, exc in failures if depth == furthest))
    if len(reasons) == 1:
        raise next(exc for depth, exc in failures if depth == furthest)
    raise NoMatch("; or ".join(reasons))


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


def rank(value: ir.Value | None) -> int | None:
    """The rank of `value`: its annotation, else what the shape interpreter computes from the graph's inputs
    (a loaded graph has no value_info on computed tensors); None when neither knows."""
    if value is None:
        return None
    if value.shape is not None:
        return value.shape.rank()
    graph = value.graph
    shape = graph_shapes(graph).get(value).shape if graph is not None else None
    return None if shape is None else len(shape)


def is_last_axis(axes: list[int] | None, value: ir.Value) -> bool:
    """`axes` is the last axis of `value`: -1, or rank - 1 where the rank is known (never a guess)."""
    if axes is None or len(axes) != 1:
        return False
    if axes[0] == -1:
        return True
    known = rank(value) if axes[0] >= 0 else None
    return known is not None and axes[0] == known - 1


def graph_values(graph: ir.Graph) -> Iterable[ir.Value]:
    """The graph's inputs and every node's outputs."""
    yield from graph.inputs
    for node in graph:
        yield from node.outputs
