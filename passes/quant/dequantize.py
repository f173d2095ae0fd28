"""Undoing the FP8 pass's quantization (passes/quant/fp8.py), in two in-place onnx-ir passes:

- `StripActivationQuantization`: every activation QuantizeLinear -> DequantizeLinear pair removed, its
  readers reading the QuantizeLinear's input; the weights' DequantizeLinear stay.
- `FoldWeightDequantization`: each DequantizeLinear of a float8 [in, out] initializer (per-tensor scale, or
  per output channel on axis 1: the pass's forms) replaced by a float initializer of what it computes
  (float8 x scale, in the scale's dtype), written band by band when the model is saved.

Both together make an FP8 graph a float graph holding exactly the FP8 weights: one the block walk
(passes/model_map.py) reads, so that its logits stream block by block like any float graph's, and a
reference that differs from an FP8 checkpoint's float re-import only by the order of float32 sums
(runtime/verify/checkpoint_fp8.py). They chain in one PassManager (strip, then fold), after QuantizeFP8 too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from passes.quant.fp8 import BandedTensor, weight_bands

FP8 = ir.DataType.FLOAT8E4M3FN


class StripActivationQuantization(ir.passes.InPlacePass):
    """Remove every QuantizeLinear -> DequantizeLinear pair on an activation, in place. `removed` holds the
    pairs the last call removed.

    requires: any model (one without such a pair is left as it is: not modified).
    ensures: no DequantizeLinear reads a QuantizeLinear.
    """

    def __init__(self) -> None:
        super().__init__()
        self.removed = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        pairs = _activation_pairs(model.graph)
        for quant, dequant in pairs:
            ir.convenience.replace_all_uses_with(dequant.outputs[0], quant.inputs[0])
            alone = all(user is dequant for user, _ in quant.outputs[0].uses())
            model.graph.remove([dequant, quant] if alone else [dequant], safe=True)
        self.removed = len(pairs)
        return ir.passes.PassResult(model, modified=bool(pairs))

    def ensures(self, model: ir.Model) -> None:
        left = _activation_pairs(model.graph)
        if left:
            raise AssertionError(f"{len(left)} activation Q/DQ pair(s) left, first {left[0][1].name!r}")


def _activation_pairs(graph: ir.Graph) -> list[tuple[ir.Node, ir.Node]]:
    """(QuantizeLinear, DequantizeLinear) of every DequantizeLinear that reads a QuantizeLinear."""
    pairs = []
    for node in graph:
        if node.op_type != "DequantizeLinear" or node.inputs[0] is None:
            continue
        producer = node.inputs[0].producer()
        if producer is not None and producer.op_type == "QuantizeLinear":
            pairs.append((producer, node))
    return pairs


class FoldWeightDequantization(ir.passes.InPlacePass):
    """Replace each DequantizeLinear of a float8 [in, out] initializer in the FP8 pass's forms by a float
    initializer `<float8 name>_dequantized` of its values (float8 x scale, what DequantizeLinear computes, in
    the scale's dtype), computed band by band when it is written; float8 initializers nothing reads then are
    dropped. `folded` holds the weights the last call folded. Another DequantizeLinear of a float8 tensor
    (a computed scale, axis 0, a 3-D weight) stays as it is.

    requires: any model (one without such a weight is left as it is: not modified).
    ensures: no DequantizeLinear of a float8 initializer in the pass's forms left, and no float8 initializer
    that nothing reads. The weights are not read, so the post-conditions cost no memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.folded = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.folded = 0
        for node in _foldable(graph):
            q, scale = node.inputs[0], node.inputs[1]
            factor = scale.const_value.numpy()
            dtype, name = scale.const_value.dtype, f"{q.name}_dequantized"
            bands = functools.partial(_dequantized_bands, q.const_value, factor.reshape(1, -1), dtype)
            value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(q.shape))
            value.const_value = BandedTensor(name, dtype, ir.Shape(q.shape), bands)
            graph.register_initializer(value)
            ir.convenience.replace_all_uses_with(node.outputs[0], value)
            graph.remove(node, safe=True)
            self.folded += 1
        unread = _unread_float8(graph)  # float8 weights and zero points nothing reads now
        for value in unread:
            graph.initializers.pop(value.name)
        return ir.passes.PassResult(model, modified=bool(self.folded or unread))

    def ensures(self, model: ir.Model) -> None:
        left = _foldable(model.graph)
        if left:
            first = left[0].inputs[0].name
            raise AssertionError(f"{len(left)} float8 weight(s) not folded, first {first!r}")
        unread = _unread_float8(model.graph)
        if unread:
            raise AssertionError(f"float8 initializer {unread[0].name!r} is read by nothing")


def _foldable(graph: ir.Graph) -> list[ir.Node]:
    """The DequantizeLinear nodes of a 2-D float8 initializer with a constant per-tensor scale, or one per
    output channel on axis 1 (the FP8 pass's forms)."""
    found = []
    for node in graph:
        if node.op_type != "DequantizeLinear" or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        q, scale = node.inputs[0], node.inputs[1]
        if q is None or q.dtype != FP8 or None in (q.const_value, scale.const_value):
            continue
        factor, axis = scale.const_value, node.attributes.get_int("axis", 1)
        if len(q.shape) == 2 and (factor.size == 1 or (len(factor.shape) == 1 and axis in (1, -1))):
            found.append(node)
    return found


def _unread_float8(graph: ir.Graph) -> list[ir.Value]:
    """Float8 initializers no node reads (and no graph output)."""
    values = graph.initializers.values()
    return [v for v in values if v.dtype == FP8 and not v.uses() and not v.is_graph_output()]


def _dequantized_bands(
    tensor: ir.TensorProtocol, factor: np.ndarray, dtype: ir.DataType
) -> Iterator[np.ndarray]:
    """float8 rows x their scale, a band of rows at a time."""
    for band in weight_bands(tensor, False, stored=True):
        yield (band * factor).astype(dtype.numpy())
