"""Linear layers and their weights: the one recognizer of what multiplies by a constant weight.

A linear layer is a MatMul/Gemm whose weight input is an initializer or a Constant reached through
Transpose/Cast/Identity/DequantizeLinear (FP8 Q/DQ), or ORT's MatMulNBits (int4).

    ref = linear_weight(node)    # WeightRef, or raises NoMatch saying why not
    ref = weight_ref(node)       # WeightRef | None
    linear_shape(node)           # (in, out) as the layer multiplies; NoMatch when it is no such layer
    find_linears(graph)          # every MatMul with a float 2-D weight, in graph order (what FP8 quantizes)

The attention and SwiGLU recognizers (passes.patterns.attention, .swiglu), the sharder (passes.shard.roles)
and FP8 (passes.quant.fp8, .calibrate) all read linear layers through this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from passes.matching import NoMatch, attr

WEIGHT_CHAIN_OPS = ("Transpose", "Cast", "Identity", "DequantizeLinear")


@dataclass
class WeightRef:
    """The constant behind a linear layer's weight input, and the nodes between them."""

    node: ir.Node  # the MatMul/Gemm (or MatMulNBits)
    value: ir.Value  # its weight input
    source: ir.Value  # the initializer (or Constant output)
    chain: list[ir.Node]  # from the source to `value`, in data order
    transposed: bool = False  # Gemm transB=1: the weight input is [out, in]
    nbits: bool = False  # MatMulNBits: the source is [N, K / block_size, blob] with scales per block

    @property
    def tensor(self) -> ir.TensorProtocol:
        return constant_tensor(self.source)

    def matrix_shape(self) -> tuple[int, int]:
        """(in, out) of the weight as the layer multiplies by it."""
        if self.nbits:
            return int(attr(self.node, "K", 0)), int(attr(self.node, "N", 0))
        dims = [int(d) for d in self.tensor.shape]
        for node in self.chain:
            if node.op_type == "Transpose":
                dims = [dims[p] for p in _perm(node)]
        rows, cols = dims
        return (cols, rows) if self.transposed else (rows, cols)

    def source_axis(self, matmul_axis: int) -> int:
        """The axis of the source tensor that is the layer's input (0) or output (1) axis."""
        axis = 1 - matmul_axis if self.transposed else matmul_axis
        for node in reversed(self.chain):
            if node.op_type == "Transpose":
                axis = _perm(node)[axis]
        return axis


def _perm(node: ir.Node) -> list[int]:
    return [int(p) for p in attr(node, "perm", [1, 0])]


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of an initializer or a Constant node's output, else None."""
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:
        return value.const_value
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        attribute = node.attributes["value"]
        if attribute.type == ir.AttributeType.TENSOR:
            return attribute.value
    return None


def linear_weight(node: ir.Node) -> WeightRef:
    """The constant 2-D weight of a MatMul/Gemm (or the block-quantized weight of a MatMulNBits); NoMatch
    when `node` is no linear layer or its weight input is computed."""
    if node.op_type == "MatMulNBits":
        if node.domain != "com.microsoft":
            raise NoMatch(f"MatMulNBits in domain {node.domain!r} is not ONNX Runtime's")
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        tensor = constant_tensor(weight)
        if weight is None or tensor is None or len(tensor.shape) != 3:
            raise NoMatch(f"MatMulNBits {node.name!r} has no constant block-quantized weight")
        return WeightRef(node, weight, weight, [], nbits=True)
    if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2 or node.inputs[1] is None:
        raise NoMatch(f"{node.op_type} is not a linear layer")
    if node.op_type == "Gemm" and attr(node, "transA", 0):
        raise NoMatch("Gemm with transA=1 is not a linear layer")
    value = current = node.inputs[1]
    chain: list[ir.Node] = []
    while constant_tensor(current) is None:
        producer = current.producer() if current is not None else None
        if (
            producer is None
            or producer.op_type not in WEIGHT_CHAIN_OPS
            or producer.domain not in ("", "ai.onnx")
        ):
            raise NoMatch(f"{node.op_type} {node.name!r} multiplies by a computed tensor")
        chain.append(producer)
        current = producer.inputs[0]
    if len(constant_tensor(current).shape) != 2:
        raise NoMatch(f"{node.op_type} {node.name!r} has no 2-D constant weight")
    transposed = node.op_type == "Gemm" and bool(attr(node, "transB", 0))
    return WeightRef(node, value, current, chain[::-1], transposed)


def weight_ref(node: ir.Node) -> WeightRef | None:
    """linear_weight(node), or None when `node` is no linear layer with a constant weight."""
    try:
        return linear_weight(node)
    except NoMatch:
        return None


def linear_shape(node: ir.Node) -> tuple[int, int]:
    """(in, out) of a linear layer with a constant weight; NoMatch otherwise."""
    return linear_weight(node).matrix_shape()


def is_linear(node: ir.Node) -> bool:
    return weight_ref(node) is not None


# ------------------------------------------------------------------------------- every linear layer

# What may sit between a float weight and its MatMul: no DequantizeLinear, a weight behind one is
# quantized already.
FLOAT_WEIGHT_CHAIN_OPS = ("Transpose", "Cast", "Identity")


@dataclass(frozen=True)
class FloatWeight:
    """The float constant 2-D weight behind a MatMul's B input, as FP8 quantizes it."""

    value: ir.Value  # initializer, or the output of a Constant node
    tensor: ir.TensorProtocol
    transpose: bool  # True when the stored tensor is [out, in]
    dtype: ir.DataType  # what the MatMul sees (after any Cast)


@dataclass(frozen=True)
class Linear:
    """A linear layer of a graph. The lm_head is the one from which a graph output is reached without
    passing another MatMul."""

    node: ir.Node
    activation: ir.Value
    weight: FloatWeight
    is_lm_head: bool

    @property
    def width(self) -> tuple[int, int]:
        """(in, out) of the weight as the MatMul sees it."""
        rows, cols = (int(d) for d in self.weight.tensor.shape)
        return (cols, rows) if self.weight.transpose else (rows, cols)


def _float_weight(node: ir.Node) -> FloatWeight | None:
    """The float constant 2-D weight behind a MatMul's B input; None if B is not one."""
    ref = weight_ref(node)
    if ref is None or any(n.op_type not in FLOAT_WEIGHT_CHAIN_OPS for n in ref.chain):
        return None
    tensor = ref.tensor
    if not tensor.dtype.is_floating_point():
        return None
    casts = [n for n in ref.chain if n.op_type == "Cast"]
    dtype = ref.value.dtype or (ir.DataType(attr(casts[-1], "to", 0)) if casts else tensor.dtype)
    return FloatWeight(value=ref.source, tensor=tensor, transpose=ref.source_axis(0) == 1, dtype=dtype)


# Consumers through which no value flows, only a shape (Optimum reads the stream's batch size with Shape to
# reshape the KV cache: followed, every projection writing the stream would "reach" a present.* output).
_SHAPE_ONLY = ("Shape", "Size")


def _reaches_logits_without_matmul(value: ir.Value, logits: ir.Value) -> bool:
    """Whether `value` flows into the logits (the graph's first output, in every exporter's graphs) through
    no other MatMul: the lm_head. k/v projections reach the present.* cache outputs, not the logits."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        current = stack.pop()
        if current is logits:
            return True
        for node in current.consumers():
            if id(node) in seen or node.op_type in ("MatMul", "Gemm", *_SHAPE_ONLY):
                continue
            seen.add(id(node))
            stack.extend(node.outputs)
    return False


def find_linears(graph: ir.Graph) -> list[Linear]:
    """All linear layers (MatMul with a float constant 2-D B) in graph order."""
    found = []
    for node in graph:
        if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if a is None or b is None or (a.dtype is not None and not a.dtype.is_floating_point()):
            continue
        weight = _float_weight(node)
        if weight is None or not weight.dtype.is_floating_point():
            continue
        lm_head = bool(graph.outputs) and _reaches_logits_without_matmul(node.outputs[0], graph.outputs[0])
        found.append(Linear(node=node, activation=a, weight=weight, is_lm_head=lm_head))
    return found
