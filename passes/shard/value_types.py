"""Element types for values the fusion pass leaves untyped (the sharding pass writes their shapes)."""

from __future__ import annotations

import onnx_ir as ir

_TYPE_KEEPING = {
    "MatMul",
    "Gemm",
    "Mul",
    "Add",
    "Sub",
    "Div",
    "Sigmoid",
    "Neg",
    "Identity",
    "Reshape",
    "Transpose",
    "Expand",
    "Concat",
    "Slice",
    "Squeeze",
    "Unsqueeze",
    "Softmax",
    "Where",
}


def walk_type(value: ir.Value, depth: int = 0) -> ir.TypeProtocol | None:
    """The element type of an untyped value, from the op that made it (types the fusion pass leaves out)."""
    if value.type is not None or depth > 32:
        return value.type
    node = value.producer()
    if node is None or node.op_type not in _TYPE_KEEPING:
        return None
    inputs = node.inputs[1:] if node.op_type == "Where" else node.inputs
    for v in inputs:
        if v is not None and (found := walk_type(v, depth + 1)) is not None:
            return found
    return None
