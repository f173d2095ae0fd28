"""SwiGLU FFN: down(silu(z @ W_gate) * (z @ W_up)) in the forms exporters emit (docs/design.md §3).

Weights are initializers used as [in, out], Transpose(initializer) or Gemm(transB=1) over [out, in],
optionally behind a Cast, or ONNX Runtime's int4 com.microsoft MatMulNBits (GenAI's int4 export). Gate and
up are two MatMuls, or one gate_up MatMul split by Split or Slice along the last axis (Phi-3 style: the
first half is the gate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.matching import (
    NoMatch,
    attr,
    constant,
    first_match,
    is_initializer,
    is_last_axis,
    maybe_producer,
    producer,
)
from passes.patterns.linear import WeightRef, linear_weight
from passes.patterns.nbits import NBits


@dataclass(frozen=True)
class Weight:
    """A linear layer's weight, readable as the [in, out] matrix its MatMul multiplies by."""

    source: ir.Value  # the initializer (for MatMulNBits: the packed quantized values)
    transposed: bool  # stored as [out, in]
    columns: tuple[int, int] | None = None  # a column range of a shared gate_up weight
    nbits: NBits | None = None  # an int4 MatMulNBits weight ([out, in], always transposed)

    @property
    def dtype(self) -> ir.DataType:
        """The float type the layer computes in (for MatMulNBits: its scales' type)."""
        tensor = self.nbits.scales if self.nbits is not None else self.source
        return tensor.const_value.dtype

    @property
    def shape(self) -> tuple[int, int]:
        if self.nbits is not None:
            return self.nbits.k, self.nbits.n
        rows, cols = (int(d) for d in self.source.const_value.shape)
        rows, cols = (cols, rows) if self.transposed else (rows, cols)
        return (rows, cols) if self.columns is None else (rows, self.columns[1] - self.columns[0])

    def matrix(self) -> np.ndarray:
        """The [in, out] matrix in its stored dtype (reads the initializer; external data stays mapped).
        MatMulNBits weights are dequantized (float64, passes/patterns/nbits.py)."""
        if self.nbits is not None:
            return self.dequantized()
        array = self.source.const_value.numpy()
        array = array.T if self.transposed else array
        return array if self.columns is None else array[:, self.columns[0] : self.columns[1]]

    def dequantized(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Columns start:stop of a MatMulNBits weight's [in, out] matrix, float64 (only those rows are
        read)."""
        first = self.columns[0] if self.columns is not None else 0
        stop = self.shape[1] if stop is None else stop
        matrix = self.nbits.dequantize(self.source.const_value.numpy(), slice(first + start, first + stop))
        self.release()
        return matrix

    def release(self) -> None:
        """Unmap external data after reading, so memory does not grow with the model."""
        for value in (self.source, *((self.nbits.scales, self.nbits.zero_points) if self.nbits else ())):
            release = getattr(value.const_value if value is not None else None, "release", None)
            if release is not None:
                release()


@dataclass(frozen=True)
class SwiGLU:
    input: ir.Value  # z, the normalized stream
    gate: Weight
    up: Weight
    down: Weight
    output: ir.Value

    @property
    def width(self) -> int:
        return self.gate.shape[1]


def match_swiglu(output: ir.Value) -> SwiGLU:
    """Recognize the SwiGLU FFN whose down projection produces `output`."""
    hidden, down = _match_linear(output)
    a, b = producer(hidden, "Mul").inputs[:2]
    # silu(gate) * up in either order (exporters write silu first)
    z, gate, up = first_match(
        lambda: _match_gate_up(_match_silu(a), b),
        lambda: _match_gate_up(_match_silu(b), a),
    )
    if not gate.shape == up.shape or gate.shape[1] != down.shape[0]:
        raise NoMatch(f"SwiGLU weight shapes disagree: gate {gate.shape}, up {up.shape}, down {down.shape}")
    return SwiGLU(z, gate, up, down, output)


def _match_silu(value: ir.Value) -> ir.Value:
    """Mul(g, Sigmoid(g)) in either order; returns g."""
    mul = producer(value, "Mul")
    for index in (0, 1):
        sigmoid = maybe_producer(mul.inputs[index], "Sigmoid")
        if sigmoid is not None and sigmoid.inputs[0] is mul.inputs[1 - index]:
            return sigmoid.inputs[0]
    raise NoMatch("no silu: Mul(x, Sigmoid(x))")


def _match_gate_up(gate_out: ir.Value, up_out: ir.Value) -> tuple[ir.Value, Weight, Weight]:
    split = maybe_producer(gate_out, "Split", "Slice")
    if split is not None:
        return _match_split_gate_up(gate_out, up_out)
    z, gate = _match_linear(gate_out)
    z_up, up = _match_linear(up_out)
    if z_up is not z:
        raise NoMatch("gate and up projections read different tensors")
    return z, gate, up


def _match_split_gate_up(gate_out: ir.Value, up_out: ir.Value) -> tuple[ir.Value, Weight, Weight]:
    gate_node, up_node = gate_out.producer(), up_out.producer()
    fused = gate_node.inputs[0]
    if up_node is None or up_node.op_type not in ("Split", "Slice") or up_node.inputs[0] is not fused:
        raise NoMatch("gate and up are not halves of one gate_up projection")
    z, weight = _match_linear(fused)
    gate_cols, up_cols = _columns(gate_node, gate_out, weight), _columns(up_node, up_out, weight)
    return z, _sliced(weight, gate_cols), _sliced(weight, up_cols)


def _sliced(weight: Weight, columns: tuple[int, int]) -> Weight:
    return Weight(weight.source, weight.transposed, columns)


def _columns(node: ir.Node, value: ir.Value, weight: Weight) -> tuple[int, int]:
    """The column range of the gate_up output that a Split output or a Slice selects."""
    width = weight.shape[1]
    if node.op_type == "Split":
        if not is_last_axis([int(attr(node, "axis", 0))], node.inputs[0]):
            raise NoMatch("gate_up Split is not along the last axis")
        given = node.inputs[1] if len(node.inputs) > 1 else None
        sizes = constant(given) if given is not None else attr(node, "split", None)
        count = len(node.outputs)
        if (given is not None and sizes is None) or (sizes is None and width % count):
            raise NoMatch("gate_up Split sizes are not constant, or not equal parts")
        sizes = [width // count] * count if sizes is None else [int(s) for s in np.reshape(sizes, -1)]
        index = list(node.outputs).index(value)
        start = sum(sizes[:index])
        return start, start + sizes[index]
    starts, ends = constant(node.inputs[1]), constant(node.inputs[2])
    axes, steps = _slice_input(node, 3, default=0), _slice_input(node, 4, default=1)
    ranges = (starts, ends, axes, steps)
    if any(a is None or a.size != 1 for a in ranges) or int(steps[0]) != 1:
        raise NoMatch("gate_up Slice is not a constant range of the last axis")
    if not is_last_axis([int(axes[0])], node.inputs[0]):
        raise NoMatch("gate_up Slice is not a constant range of the last axis")
    start, end = int(starts.reshape(-1)[0]), min(int(ends.reshape(-1)[0]), width)
    return start % width if start < 0 else start, end % width if end < 0 else end


def _slice_input(node: ir.Node, index: int, default: int) -> np.ndarray | None:
    """A Slice's optional axes or steps: the constant, the default when absent (axis 0, step 1), None when
    computed."""
    if len(node.inputs) <= index or node.inputs[index] is None:
        return np.array([default])
    value = constant(node.inputs[index])
    return None if value is None else value.reshape(-1)


def _match_linear(output: ir.Value) -> tuple[ir.Value, Weight]:
    """MatMul(x, W) | MatMul(x, Transpose(W)) | Gemm(x, W, transB=1) | MatMulNBits; returns (x, weight)."""
    node = producer(output, "MatMul", "Gemm", "MatMulNBits")
    if node.op_type == "Gemm" and (
        len(node.inputs) > 2 or attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0
    ):
        raise NoMatch("Gemm with bias, transA or alpha is not a plain linear layer")
    ref = linear_weight(node)
    return node.inputs[0], _nbits_weight(ref) if ref.nbits else _weight(ref)


def _weight(ref: WeightRef) -> Weight:
    """The fuser reads the initializer itself, so the weight is one used as is, or (MatMul) through one
    Transpose; Cast, Identity, DequantizeLinear or a Constant node in between are not fused."""
    through = [n.op_type for n in ref.chain]
    plain = through == [] or (through == ["Transpose"] and ref.node.op_type == "MatMul")
    if not plain or not is_initializer(ref.source):
        raise NoMatch(f"linear weight {ref.value.name} is not a 2-D initializer")
    return Weight(ref.source, transposed=ref.source_axis(0) == 1)


def _nbits_weight(ref: WeightRef) -> Weight:
    node = ref.node
    scales = node.inputs[2]
    zero_points = node.inputs[3] if len(node.inputs) > 3 else None
    if any(v is not None for v in node.inputs[4:]):
        raise NoMatch("MatMulNBits with g_idx or bias is not a plain linear layer")
    if not all(is_initializer(v) for v in (ref.source, scales)) or (
        zero_points is not None and not is_initializer(zero_points)
    ):
        raise NoMatch("MatMulNBits weights, scales or zero points are not initializers")
    k, n = ref.matrix_shape()
    bits, block_size = int(attr(node, "bits", 4)), int(attr(node, "block_size", 0))
    nbits = NBits(node, scales, zero_points, k, n, bits, block_size)
    shape = tuple(ref.tensor.shape)
    if shape != (n, nbits.blocks, block_size * bits // 8):
        raise NoMatch(f"MatMulNBits weight shape {shape} disagrees with K={k}, N={n}, bits={bits}")
    return Weight(ref.source, True, None, nbits)
