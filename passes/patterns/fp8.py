"""The FP8 pass's forms (passes/quant/fp8.py) in an FP8 graph, recognized by its source graph's records.

A linear layer the pass wrote is MatMul(DQ(Q(x)), DQ(W8, scale)): a per-tensor float8e4m3fn activation
Q/DQ pair (one scale, zero point 0, saturating) and W8 a 2-D float8e4m3fn initializer `<source>_fp8`,
stored [in, out], scaled per output channel (axis 1) or per tensor. A SwiGLU FFN is three of them (gate and
up halves of one gate_up weight through its unchanged Split/Slice). The records say what the graph computes
(FP8Weight: DQ(Q(x)) @ DQ(W8)), so that passes/reference.py can evaluate an FFN a row block at a time
without dequantizing a float8 matrix whole (runtime/verify/fp8.py runs a large FP8 block so).

An FP8 graph has no block walk of its own (passes/model_map.py reads float weights): its FFN is found by the
source's SwiGLU record, whose value names the pass keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.matching import NoMatch, attr, producer
from passes.patterns.swiglu import SwiGLU, Weight
from passes.quant.fp8 import source_weight_name, to_fp8

FP8 = ir.DataType.FLOAT8E4M3FN


@dataclass(frozen=True, eq=False)
class FP8Weight:
    """A linear layer of an FP8 graph as that graph computes it: DQ(Q(x)) @ DQ(W8). The input goes through
    QuantizeLinear -> DequantizeLinear with one `input_scale` (saturating float8e4m3fn rounding: the pass's
    own `to_fp8` rule, here in float64); the float8e4m3fn weight, stored [in, out] as the pass writes it, is
    dequantized a row block at a time by `scale`, one per output channel of the stored matrix
    (DequantizeLinear axis=1) or one for the whole tensor. passes/reference.matmul reads it like a Weight."""

    weight: Weight  # the float8e4m3fn initializer, stored [in, out] (columns: a gate_up half of it)
    scale: np.ndarray  # float64: one per stored column, or one value (per tensor)
    input_scale: float

    def __post_init__(self) -> None:
        if self.weight.transposed or self.weight.nbits is not None:
            raise ValueError("an FP8 graph's float8 weight is stored [in, out]")

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def transposed(self) -> bool:
        return False

    def quantized_input(self, x: np.ndarray) -> np.ndarray:
        """DequantizeLinear(QuantizeLinear(x)): x / scale saturated to +-448, rounded to float8e4m3fn,
        times scale."""
        scale = np.float64(self.input_scale)
        return to_fp8(x, scale).astype(np.float64) * scale

    def dequantized_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of the [in, out] matrix, float8 values times their channel's scale, float64 (only
        those rows are read; the memory map is released after)."""
        array = self.weight.source.const_value.numpy()
        rows = array[start:stop].astype(np.float64)  # the float8 values, exact in float64 (a new array)
        del array  # no view of the memory map may outlive it
        self.weight.release()
        first, last = self.weight.columns or (0, len(self.scale))
        rows = rows if self.weight.columns is None else rows[:, first:last]
        rows *= self.scale if self.scale.size == 1 else self.scale[first:last]  # in place: one row block
        return rows


@dataclass(frozen=True)
class FP8SwiGLU:
    """A SwiGLU FFN of an FP8 graph, for passes/reference.ffn: its three linear layers as FP8Weights."""

    gate: FP8Weight
    up: FP8Weight
    down: FP8Weight

    @property
    def width(self) -> int:
        return self.gate.shape[1]


def quantized_weights(graph: ir.Graph) -> list[tuple[ir.Value, ir.Value]]:
    """(float8 weight, its scale) of every DequantizeLinear of a float8 initializer, each weight once: what
    the pass quantized, for a check to compare with the source's weights."""
    found, seen = [], set()
    for node in graph:
        if node.op_type != "DequantizeLinear" or len(node.inputs) < 2:
            continue
        q, scale = node.inputs[0], node.inputs[1]
        if q is None or scale is None or q.dtype != FP8 or q.const_value is None or q.name in seen:
            continue
        seen.add(q.name)
        found.append((q, scale))
    return found


def match_fp8_swiglu(output: ir.Value | None, source: SwiGLU) -> FP8SwiGLU:
    """The FP8 form of `source` (the unquantized graph's record) whose down projection produces `output` in
    the FP8 graph: down(silu(z @ gate) * (z @ up)), each MatMul reading DQ(Q(x)) and DQ(W8) with W8 the
    float8 form of the source's weight, z the source's normalized stream; NoMatch naming what differs."""
    hidden, down = _projection("down projection", output, source.down)
    mul = producer(hidden, "Mul")
    for i in (0, 1):
        gate_out, up_out = mul.inputs[i], mul.inputs[1 - i]
        silu = gate_out.producer() if gate_out is not None else None
        if silu is None or silu.op_type != "Mul":
            continue
        g = next((v for j, v in enumerate(silu.inputs) if _is_sigmoid_of(silu.inputs[1 - j], v)), None)
        if g is not None:
            break
    else:
        raise NoMatch("no silu(gate) * up before the down projection")
    z, gate = _projection("gate projection", g, source.gate)
    z_up, up = _projection("up projection", up_out, source.up)
    if z is not z_up or z.name != source.input.name:
        raise NoMatch(f"gate and up do not both quantize the normalized stream {source.input.name!r}")
    return FP8SwiGLU(gate, up, down)


def _is_sigmoid_of(value: ir.Value | None, x: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    return node is not None and node.op_type == "Sigmoid" and x is not None and node.inputs[0] is x


def _projection(role: str, value: ir.Value | None, weight: Weight) -> tuple[ir.Value, FP8Weight]:
    """The MatMul behind `value` (a gate or up half: through the unchanged Split/Slice of a gate_up weight)
    as _match_linear reads it; NoMatch saying which `role` differs and how."""
    try:
        if weight.columns is not None:
            value = producer(value, "Split", "Slice").inputs[0]
        return _match_linear(producer(value, "MatMul"), weight)
    except NoMatch as exc:
        raise NoMatch(f"{role}: {exc}") from None


def _match_linear(matmul: ir.Node, source: Weight) -> tuple[ir.Value, FP8Weight]:
    """(x, the FP8Weight) of MatMul(DQ(Q(x)), DQ(W8, scale)) as the pass writes it, W8 quantized from
    `source`: a per-tensor float8 activation Q/DQ (one scale, zero point 0, saturating) and W8 a float8
    [in, out] initializer with per-output-channel (axis 1) or per-tensor scales."""
    a, b = matmul.inputs[0], matmul.inputs[1]
    dq = producer(a, "DequantizeLinear")
    q = producer(dq.inputs[0], "QuantizeLinear")
    act_scale, dq_scale = (_initializer_array(n.inputs[1] if len(n.inputs) > 1 else None) for n in (q, dq))
    if act_scale is None or act_scale.size != 1 or dq_scale is None or dq_scale.size != 1:
        raise NoMatch("its input's Q/DQ has no constant per-tensor scale")
    if act_scale.item() != dq_scale.item() or not (_fp8_zero(q) and _fp8_zero(dq)):
        raise NoMatch("its input's Q/DQ is not one float8 pair (same scale, zero point 0)")
    if int(attr(q, "saturate", 1)) != 1:
        raise NoMatch("its input's QuantizeLinear does not saturate")
    wdq = producer(b, "DequantizeLinear")
    w8 = wdq.inputs[0]
    if w8 is None or w8.dtype != FP8 or w8.const_value is None or len(w8.const_value.shape) != 2:
        raise NoMatch("its weight is not a 2-D float8 initializer")
    if source_weight_name(w8.name) != source.source.name:
        raise NoMatch(f"it reads {w8.name!r}, not the float8 form of {source.source.name!r}")
    stored = tuple(int(d) for d in source.source.const_value.shape)
    if tuple(int(d) for d in w8.const_value.shape) != (stored[::-1] if source.transposed else stored):
        raise NoMatch(f"{w8.name!r} has another shape than {source.source.name!r}")
    scale = _initializer_array(wdq.inputs[1] if len(wdq.inputs) > 1 else None)
    per_channel = scale is not None and scale.size == int(w8.const_value.shape[1]) and scale.ndim == 1
    if scale is None or not (scale.size == 1 or (per_channel and int(attr(wdq, "axis", 1)) == 1)):
        raise NoMatch(f"{w8.name!r}: its scale is neither per output channel (axis 1) nor per tensor")
    if len(wdq.inputs) > 2 and wdq.inputs[2] is not None and not _fp8_zero(wdq):
        raise NoMatch(f"{w8.name!r}: a zero point other than 0")
    weight = Weight(w8, transposed=False, columns=source.columns)
    return q.inputs[0], FP8Weight(weight, scale.astype(np.float64).reshape(-1), float(act_scale.item()))


def _initializer_array(value: ir.Value | None) -> np.ndarray | None:
    """An initializer's values (the pass writes its scales as initializers; a Constant node is not its)."""
    return value.const_value.numpy() if value is not None and value.const_value is not None else None


def _fp8_zero(node: ir.Node) -> bool:
    """A Q/DQ node's zero point is a float8e4m3fn zero (the pass writes one: it also types Q's output)."""
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    return (
        zero is not None
        and zero.dtype == FP8
        and zero.const_value is not None
        and not np.any(zero.const_value.numpy().astype(np.float32))
    )
