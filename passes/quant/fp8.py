"""FP8 (float8e4m3fn) explicit quantization: QuantizeLinear/DequantizeLinear on the inputs of linear layers.

A *linear layer* is a MatMul whose B input is a constant 2-D weight (an initializer or a Constant node),
possibly reached through Transpose and Cast nodes. Every attention and FFN projection is one, and so is a
fused FFN (a wide MatMul). Each gets

- its weight stored as a float8e4m3fn initializer in [in, out] layout, scaled per output channel
  (scale = amax / 448 over the input dimension), feeding DequantizeLinear(axis=1);
- its activation input quantized per tensor: QuantizeLinear -> DequantizeLinear with a scale from
  calibration (amax, or a percentile of |x|, over calibration tokens run through ONNX Runtime), divided
  by 448. One Q/DQ pair is shared by all linear layers reading the same tensor.

Embeddings (Gather) are untouched; the lm_head (the linear layer from which a graph output is reached
without passing another MatMul) keeps its precision unless `quantize_lm_head=True`.

Weights are streamed: the scales are computed eagerly from bands of rows read from the source file (never
mapped whole), and the FP8 values are computed band by band again while the model is saved, so memory
stays near one band whatever the weight size.

Finding the linear layers is passes/patterns/linear.py, calibration passes/quant/calibrate.py, raising
the opset passes/quant/opset.py; this module writes the weights and Q/DQ nodes. `QuantizeFP8` is the
onnx-ir pass (it chains after passes.fuse.FuseFFNGroups in one PassManager); `quantize_fp8` runs it on one
model and returns its report.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from passes.errors import PassInputError, UserError
from passes.io.stream_concat import read_columns, read_rows
from passes.matching import graph_values
from passes.patterns.linear import Linear, find_linears
from passes.quant.calibrate import FP8_MAX, ActivationScales
from passes.quant.opset import raise_opset, schema_violation

__all__ = [
    "MIN_FP8_OPSET",
    "TARGET_OPSET",
    "QuantReport",
    "QuantizeFP8",
    "channel_scales",
    "quantize_fp8",
    "source_weight_name",
    "to_fp8",
    "weight_bands",
]

MIN_FP8_OPSET = 19
TARGET_OPSET = 21


@dataclass
class QuantReport:
    quantized: list[str] = field(default_factory=list)  # MatMul node names
    skipped: dict[str, str] = field(default_factory=dict)  # MatMul node name -> reason
    weights: int = 0
    activations: int = 0
    source_weight_bytes: int = 0
    fp8_weight_bytes: int = 0
    max_width: int = 0  # widest output dimension quantized (a fused FFN shows up here)
    opset: tuple[int, int] = (0, 0)


# Weights are read a band of rows at a time (about this many bytes in float32), straight from the file:
# quantizing holds one band, not one weight, so memory does not grow with the matrix size.
_BAND_BYTES = 8 << 20


def weight_bands(tensor: ir.TensorProtocol, transpose: bool, stored: bool = False) -> Iterator[np.ndarray]:
    """The weight in float32 bands of rows: of the [in, out] matrix the MatMul sees, or (`stored`) of the
    tensor as stored."""
    rows, cols = (int(d) for d in tensor.shape)
    read_stored = stored or not transpose
    height, width = (rows, cols) if read_stored else (cols, rows)
    step = max(1, _BAND_BYTES // (4 * width))
    for start in range(0, height, step):
        stop = min(start + step, height)
        if read_stored:
            band = read_rows(tensor, rows, cols, start, stop)
        else:  # rows of the [in, out] matrix are columns of the stored [out, in] one
            band = read_columns(tensor, rows, cols, start, stop).T
        yield band.astype(np.float32, copy=False)


def channel_scales(tensor: ir.TensorProtocol, transpose: bool, dtype: ir.DataType) -> np.ndarray:
    """amax / 448 per output channel (over the input dimension), in the weight's dtype, as float32."""
    if transpose:  # output channels are the stored rows
        bands = weight_bands(tensor, True, stored=True)
        amax = np.concatenate([np.abs(band).max(axis=1) for band in bands])
    else:
        bands = weight_bands(tensor, False)
        amax = functools.reduce(np.maximum, (np.abs(band).max(axis=0) for band in bands))
    scale = np.where((amax > 0) & np.isfinite(amax), amax / FP8_MAX, 1.0)
    return scale.astype(dtype.numpy()).astype(np.float32)


def to_fp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Q(weight): weight / scale (per output channel) saturated to +-448, rounded to float8e4m3fn."""
    return np.clip(weight / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


class BandedTensor(ir.LazyTensor):
    """A tensor computed a band of rows at a time (`bands()`, each call a fresh pass) while it is written
    (the tensor writer calls `tofile`): one band in memory, never the whole tensor."""

    def __init__(self, name: str, dtype: ir.DataType, shape: ir.Shape,
                 bands: Callable[[], Iterator[np.ndarray]]) -> None:
        super().__init__(self._materialize, dtype=dtype, shape=shape, name=name)
        self.bands = bands

    def __repr__(self) -> str:  # LazyTensor's would print `func`, a bound method whose repr is this one
        return f"{type(self).__name__}({self.name!r}, {list(self.shape)})"

    def tofile(self, file) -> None:
        for band in self.bands():
            file.write(memoryview(np.ascontiguousarray(band).reshape(-1).view(np.uint8)))

    def _materialize(self) -> ir.TensorProtocol:
        return ir.Tensor(np.concatenate(list(self.bands())), dtype=self.dtype, name=self.name)


class _FP8Weight(BandedTensor):
    """The [in, out] float8e4m3fn weight, quantized band by band from its source while it is written."""

    def __init__(self, tensor: ir.TensorProtocol, transpose: bool, scale: np.ndarray, name: str) -> None:
        rows, cols = (int(d) for d in tensor.shape)
        shape = ir.Shape([cols, rows] if transpose else [rows, cols])
        bands = lambda: (to_fp8(band, scale) for band in weight_bands(tensor, transpose))  # noqa: E731
        super().__init__(name, ir.DataType.FLOAT8E4M3FN, shape, bands)
        self.source = tensor

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {list(self.shape)}, from {self.source.name!r})"


class _Namer:
    def __init__(self, graph: ir.Graph) -> None:
        self.used = {v.name for v in graph_values(graph)} | set(graph.initializers)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name


def source_weight_name(fp8_name: str) -> str:
    """The source weight's name of a float8 weight the pass wrote: it names it `<source>_fp8` (`_fp8_<k>` on a
    name clash, _Namer); any other name is returned as it is."""
    base, _, tail = fp8_name.rpartition("_fp8")
    return base if tail == "" or tail.lstrip("_").isdigit() else fp8_name


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


class _Rewriter:
    def __init__(self, model: ir.Model) -> None:
        self.graph = model.graph
        self.name = _Namer(model.graph)
        self.zero = _initializer(
            self.graph,
            self.name("fp8_zero_point"),
            ir.Tensor(np.zeros((), dtype=ml_dtypes.float8_e4m3fn), dtype=ir.DataType.FLOAT8E4M3FN),
        )
        self.weights: dict[tuple[int, bool, ir.DataType], ir.Value] = {}
        self.activations: dict[str, ir.Value] = {}

    def weight(self, linear: Linear, report: QuantReport) -> ir.Value:
        source, dtype = linear.weight, linear.weight.dtype
        key = (id(source.tensor), source.transpose, dtype)
        if key in self.weights:
            return self.weights[key]
        base = source.value.name or "weight"
        scale = channel_scales(source.tensor, source.transpose, dtype)
        fp8_name = self.name(f"{base}_fp8")
        q = _initializer(self.graph, fp8_name, _FP8Weight(source.tensor, source.transpose, scale, fp8_name))
        s_name = self.name(f"{base}_fp8_scale")
        s = _initializer(self.graph, s_name, ir.Tensor(scale.astype(dtype.numpy()), dtype=dtype, name=s_name))
        node = ir.node(
            "DequantizeLinear",
            [q, s],
            {"axis": 1},
            name=self.name(f"{base}_DequantizeLinear"),
        )
        node.outputs[0].name = self.name(f"{base}_dq")
        node.outputs[0].dtype = dtype
        node.outputs[0].shape = ir.Shape(list(linear.width))
        self.graph.insert_before(linear.node, node)
        self.weights[key] = node.outputs[0]
        report.weights += 1
        report.source_weight_bytes += int(source.tensor.nbytes)
        report.fp8_weight_bytes += math.prod(linear.width)
        report.max_width = max(report.max_width, linear.width[1])
        return node.outputs[0]

    def activation(self, linear: Linear, scale: float, report: QuantReport) -> ir.Value:
        x, dtype = linear.activation, linear.weight.dtype
        if x.name in self.activations:
            return self.activations[x.name]
        s_name = self.name(f"{x.name}_act_scale")
        s = _initializer(
            self.graph, s_name, ir.Tensor(np.array(scale, dtype=dtype.numpy()), dtype=dtype, name=s_name)
        )
        quant = ir.node("QuantizeLinear", [x, s, self.zero], name=self.name(f"{x.name}_QuantizeLinear"))
        quant.outputs[0].name = self.name(f"{x.name}_q")
        quant.outputs[0].dtype = ir.DataType.FLOAT8E4M3FN
        quant.outputs[0].shape = x.shape
        dequant = ir.node(
            "DequantizeLinear", [quant.outputs[0], s, self.zero], name=self.name(f"{x.name}_DequantizeLinear")
        )
        dequant.outputs[0].name = self.name(f"{x.name}_dq")
        dequant.outputs[0].dtype = dtype
        dequant.outputs[0].shape = x.shape
        self.graph.insert_before(linear.node, [quant, dequant])
        self.activations[x.name] = dequant.outputs[0]
        report.activations += 1
        return dequant.outputs[0]


def _chosen(linears: list[Linear], quantize_lm_head: bool) -> list[Linear]:
    """The linear layers to quantize: all but the lm_head, unless asked."""
    return [linear for linear in linears if quantize_lm_head or not linear.is_lm_head]


def _choose(linears: list[Linear], quantize_lm_head: bool, report: QuantReport) -> list[Linear]:
    """`_chosen`, naming the unnamed MatMuls and recording the skipped lm_head in the report."""
    for index, linear in enumerate(linears):
        if not linear.node.name:
            linear.node.name = f"MatMul_fp8_{index}"
        if linear.is_lm_head and not quantize_lm_head:
            report.skipped[linear.node.name] = "lm_head (keeps its precision; quantize_lm_head=True)"
    return _chosen(linears, quantize_lm_head)


_FLOAT8_TYPES = frozenset(t for t in ir.DataType if t.name.startswith("FLOAT8"))


def _float8_value(graph: ir.Graph) -> str | None:
    """The name of a float8 initializer or node output, if the graph has one (it is quantized already)."""
    for value in graph.initializers.values():
        if value.dtype in _FLOAT8_TYPES:
            return value.name
    for node in graph:
        for value in node.outputs:
            if value.dtype in _FLOAT8_TYPES:
                return value.name
    return None


class QuantizeFP8(ir.passes.InPlacePass):
    """Insert FP8 Q/DQ on the inputs of every linear layer (all but the lm_head unless asked), in place.

    `act_scales` maps activation tensor names (the linear layers' A inputs) to per-tensor scales. The
    default opset is raised to `target_opset` (float8 needs 19); unused source weights are removed.
    `report` holds what the last call did.

    requires: no float8 tensor yet (a second pass would quantize dequantized weights again), at least one
    linear layer to quantize, and a scale for every input of one: else a PassInputError (a UserError).
    ensures: opset >= 19, every chosen MatMul reads DequantizeLinear(QuantizeLinear(x)) and the
    DequantizeLinear of a float8e4m3fn weight, no other float linear layer left but a kept lm_head, and no
    node with an attribute its schema lost in the opset raise. Weights are not read, so the
    post-conditions cost no memory (onnx's checker would materialize every FP8 weight).
    """

    def __init__(
        self,
        act_scales: Mapping[str, float] | ActivationScales,
        quantize_lm_head: bool = False,
        *,
        target_opset: int = TARGET_OPSET,
    ) -> None:
        super().__init__()
        if target_opset < MIN_FP8_OPSET:
            raise UserError(f"FP8 Q/DQ needs opset >= {MIN_FP8_OPSET}, got target opset {target_opset}")
        self.scales = act_scales.scales if isinstance(act_scales, ActivationScales) else dict(act_scales)
        self.quantize_lm_head = quantize_lm_head
        self.target_opset = target_opset
        self.report = QuantReport()

    def requires(self, model: ir.Model) -> None:
        if (name := _float8_value(model.graph)) is not None:
            raise PassInputError(
                f"the model is FP8-quantized already (float8 tensor {name!r}); quantize the unquantized model"
            )
        chosen = _chosen(find_linears(model.graph), self.quantize_lm_head)
        if not chosen:
            raise PassInputError(
                "the model has no linear layer (MatMul with a constant float weight) to quantize"
                + ("" if self.quantize_lm_head else " but the lm_head (quantize_lm_head=True quantizes it)")
            )
        missing = sorted({lin.activation.name for lin in chosen if lin.activation.name not in self.scales})
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise PassInputError(
                f"no activation scale for {len(missing)} linear input(s): {shown}; "
                "calibrate this model (the scales file belongs to another graph)"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        report = self.report = QuantReport()
        chosen = _choose(find_linears(model.graph), self.quantize_lm_head, report)
        report.opset = raise_opset(model, self.target_opset, MIN_FP8_OPSET, "FP8 Q/DQ")
        if report.opset[0] != report.opset[1]:  # onnx's converter rebuilt the graph: find them anew
            report.skipped.clear()
            chosen = _choose(find_linears(model.graph), self.quantize_lm_head, report)
        rewriter = _Rewriter(model)
        for linear in chosen:
            a = rewriter.activation(linear, self.scales[linear.activation.name], report)
            b = rewriter.weight(linear, report)
            linear.node.replace_input_with(0, a)
            linear.node.replace_input_with(1, b)
            report.quantized.append(linear.node.name)
        RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(report.quantized))

    def ensures(self, model: ir.Model) -> None:
        opset = model.opset_imports.get("", 0)
        if opset < MIN_FP8_OPSET:
            raise AssertionError(f"FP8 model has opset {opset}, below {MIN_FP8_OPSET}")
        left = [lin.node.name for lin in _chosen(find_linears(model.graph), self.quantize_lm_head)]
        if left:
            raise AssertionError(f"{len(left)} linear layer(s) left in float: {', '.join(left[:3])}")
        nodes = {node.name: node for node in model.graph}
        for name in self.report.quantized:
            if (problem := _not_quantized(nodes.get(name))) is not None:
                raise AssertionError(f"MatMul {name!r}: {problem}")
        if (problem := schema_violation(model, opset)) is not None:
            raise AssertionError(problem)


def _not_quantized(matmul: ir.Node | None) -> str | None:
    """Why `matmul` does not read DQ(Q(x)) and DQ(float8 weight); None when it does."""
    if matmul is None:
        return "gone from the graph"
    a, b = (value.producer() if value is not None else None for value in matmul.inputs[:2])
    if a is None or a.op_type != "DequantizeLinear" or _producer_op(a.inputs[0]) != "QuantizeLinear":
        return "its activation is not DequantizeLinear(QuantizeLinear(x))"
    if b is None or b.op_type != "DequantizeLinear" or b.inputs[0].dtype != ir.DataType.FLOAT8E4M3FN:
        return "its weight is not a DequantizeLinear of a float8e4m3fn tensor"
    return None


def _producer_op(value: ir.Value | None) -> str | None:
    producer = value.producer() if value is not None else None
    return producer.op_type if producer is not None else None


def quantize_fp8(
    model: ir.Model,
    act_scales: Mapping[str, float] | ActivationScales,
    quantize_lm_head: bool = False,
    *,
    target_opset: int = TARGET_OPSET,
) -> QuantReport:
    """Run `QuantizeFP8` on `model` (in place) and return its report (see QuantizeFP8)."""
    quantize = QuantizeFP8(act_scales, quantize_lm_head, target_opset=target_opset)
    quantize(model)
    return quantize.report
