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

`QuantizeFP8` is the onnx-ir pass (it chains after passes.fuse.FuseFFNGroups in one PassManager);
`quantize_fp8` runs it on one model and returns its report.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from passes.errors import PassInputError, UserError
from passes.model_io import load_model
from passes.sessions import ORT_DISABLED_OPTIMIZERS, open_session  # noqa: F401  (re-exported)
from passes.stream_concat import read_columns, read_rows

FP8_MAX = 448.0
MIN_FP8_OPSET = 19
TARGET_OPSET = 21
SCALES_FORMAT = "ffn-fusion-fp8-scales/1"
_HIST_BINS = 4096
_PASSTHROUGH_WEIGHT_OPS = ("Transpose", "Cast", "Identity")


# --------------------------------------------------------------------------------------------- finding


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


# ----------------------------------------------------------------------------------------- calibration


@dataclass
class ActivationScales:
    """Per-tensor activation scales (tensor name -> scale) and how they were obtained."""

    scales: dict[str, float]
    amax: dict[str, float] = field(default_factory=dict)
    percentile: float | None = None
    tokens_sha256: str = ""
    num_tokens: int = 0

    def save(self, path: str | Path) -> None:
        record = {
            "format": SCALES_FORMAT,
            "fp8_max": FP8_MAX,
            "percentile": self.percentile,
            "calibration_tokens_sha256": self.tokens_sha256,
            "num_tokens": self.num_tokens,
            "scales": self.scales,
            "amax": self.amax,
        }
        Path(path).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ActivationScales:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read FP8 scales file {path}: {exc}") from None
        if not isinstance(record, dict) or record.get("format") != SCALES_FORMAT:
            raise UserError(f"{path} is not an FP8 scales file (expected format {SCALES_FORMAT!r})")
        scales = record.get("scales")
        if not isinstance(scales, dict) or not all(
            isinstance(v, int | float) and v > 0 and math.isfinite(v) for v in scales.values()
        ):
            raise UserError(f"{path}: 'scales' must map tensor names to positive numbers")
        return cls(
            scales={str(k): float(v) for k, v in scales.items()},
            amax={str(k): float(v) for k, v in record.get("amax", {}).items()},
            percentile=record.get("percentile"),
            tokens_sha256=str(record.get("calibration_tokens_sha256", "")),
            num_tokens=int(record.get("num_tokens", 0)),
        )


class _AbsStats:
    """Running max of |x| and, for percentiles, a histogram whose range doubles as the max grows."""

    def __init__(self, keep_histogram: bool) -> None:
        self.amax = 0.0
        self.keep_histogram = keep_histogram
        self.hist: np.ndarray | None = None
        self.hi = 0.0

    def update(self, x: np.ndarray) -> None:
        absx = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        absx = absx[np.isfinite(absx)]
        if absx.size == 0:
            return
        batch_max = float(absx.max())
        self.amax = max(self.amax, batch_max)
        if not self.keep_histogram:
            return
        if self.hist is None:
            self.hist = np.zeros(_HIST_BINS, dtype=np.int64)
            self.hi = batch_max if batch_max > 0 else 1e-12
        while batch_max > self.hi:
            merged = self.hist.reshape(-1, 2).sum(axis=1)
            self.hist = np.concatenate([merged, np.zeros_like(merged)])
            self.hi *= 2.0
        self.hist += np.histogram(absx, bins=_HIST_BINS, range=(0.0, self.hi))[0]

    def value(self, percentile: float | None) -> float:
        if percentile is None or self.hist is None:
            return self.amax
        cdf = np.cumsum(self.hist) / max(int(self.hist.sum()), 1)
        index = int(np.searchsorted(cdf, percentile / 100.0))
        return min(self.amax, (index + 1) * self.hi / _HIST_BINS)


def tokens_sha256(token_batches: Iterable[np.ndarray | Mapping[str, np.ndarray]]) -> str:
    """sha256 of the calibration batches (arrays, or dicts of feeds), in order; saved with the scales."""
    digest = hashlib.sha256()
    for batch in token_batches:
        feeds = batch if isinstance(batch, Mapping) else {"": batch}
        for key in sorted(feeds):
            array = np.ascontiguousarray(feeds[key], dtype=np.int64)
            digest.update(f"{key}{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def scale_from_amax(amax: float) -> float:
    return amax / FP8_MAX if amax > 0 and math.isfinite(amax) else 1.0


def _calibration_session(model_path: Path, names: list[str]):
    model = load_model(model_path)
    by_name = {v.name: v for v in _all_values(model.graph)}
    outputs = {v.name for v in model.graph.outputs}
    for name in names:
        if name not in outputs:
            model.graph.outputs.append(by_name[name])
    return open_session(ir.to_proto(model), folder=model_path.parent)


def _all_values(graph: ir.Graph) -> Iterable[ir.Value]:
    yield from graph.inputs
    for node in graph:
        yield from node.outputs


def _feeds(session, batch) -> dict[str, np.ndarray]:
    if isinstance(batch, Mapping):
        return {k: np.asarray(v) for k, v in batch.items()}
    inputs = session.get_inputs()
    if len(inputs) != 1:
        names = ", ".join(i.name for i in inputs)
        raise UserError(f"the model has several inputs ({names}); pass calibration batches as dicts of feeds")
    return {inputs[0].name: np.asarray(batch, dtype=np.int64)}


def calibrate(
    model_path: str | Path,
    token_batches: Iterable[np.ndarray | Mapping[str, np.ndarray]],
    percentile: float | None = None,
    *,
    progress: bool = True,
) -> ActivationScales:
    """Run calibration batches through ONNX Runtime and return per-tensor activation scales.

    The inputs of every linear layer (the lm_head's included, so one file serves both settings of
    `quantize_lm_head`) become extra outputs of a temporary copy of the model; the weights stay where
    they are (external data is read from the model's folder). `percentile` (e.g. 99.99) clips the
    amax to that percentile of |x| over all calibration tokens and channels.
    """
    from tqdm import tqdm

    if percentile is not None and not 0 < percentile <= 100:
        raise UserError(f"percentile must be in (0, 100], got {percentile}")
    model_path = Path(model_path)
    if not model_path.is_file():
        raise UserError(f"model not found: {model_path}")
    names = list(dict.fromkeys(lin.activation.name for lin in find_linears(load_model(model_path).graph)))
    if not names:
        raise UserError(f"{model_path} has no linear layers (MatMul with a constant weight) to calibrate")
    session = _calibration_session(model_path, names)
    stats = {name: _AbsStats(percentile is not None) for name in names}
    num_tokens = 0
    batches = list(token_batches)
    if not batches:
        raise UserError("no calibration tokens given")
    for batch in tqdm(batches, desc="calibrate", unit="batch", file=sys.stderr, disable=not progress):
        feeds = _feeds(session, batch)
        num_tokens += int(next(iter(feeds.values())).size)
        for name, value in zip(names, session.run(names, feeds), strict=True):
            stats[name].update(value)
    amax = {name: s.value(percentile) for name, s in stats.items()}
    return ActivationScales(
        scales={name: scale_from_amax(a) for name, a in amax.items()},
        amax=amax,
        percentile=percentile,
        tokens_sha256=tokens_sha256(batches),
        num_tokens=num_tokens,
    )


# -------------------------------------------------------------------------------------------- rewriting


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


def _bands(tensor: ir.TensorProtocol, transpose: bool, stored: bool = False) -> Iterator[np.ndarray]:
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


def _channel_scales(tensor: ir.TensorProtocol, transpose: bool, dtype: ir.DataType) -> np.ndarray:
    """amax / 448 per output channel (over the input dimension), in the weight's dtype, as float32."""
    if transpose:  # output channels are the stored rows
        amax = np.concatenate([np.abs(band).max(axis=1) for band in _bands(tensor, True, stored=True)])
    else:
        amax = functools.reduce(np.maximum, (np.abs(band).max(axis=0) for band in _bands(tensor, False)))
    scale = np.where((amax > 0) & np.isfinite(amax), amax / FP8_MAX, 1.0)
    return scale.astype(dtype.numpy()).astype(np.float32)


def _to_fp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(weight / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


class _FP8Weight(ir.LazyTensor):
    """The [in, out] float8e4m3fn weight, quantized band by band from its source while it is written."""

    def __init__(self, tensor: ir.TensorProtocol, transpose: bool, scale: np.ndarray, name: str) -> None:
        rows, cols = (int(d) for d in tensor.shape)
        shape = ir.Shape([cols, rows] if transpose else [rows, cols])
        super().__init__(self._materialize, dtype=ir.DataType.FLOAT8E4M3FN, shape=shape, name=name)
        self.source, self.transpose, self.scale = tensor, transpose, scale

    def bands(self) -> Iterator[np.ndarray]:
        for band in _bands(self.source, self.transpose):
            yield np.ascontiguousarray(_to_fp8(band, self.scale))

    def tofile(self, file) -> None:
        for band in self.bands():
            file.write(memoryview(band.view(np.uint8).reshape(-1)))

    def _materialize(self) -> ir.TensorProtocol:
        array = np.concatenate(list(self.bands()))
        return ir.Tensor(array, dtype=ir.DataType.FLOAT8E4M3FN, name=self.name)


class _Namer:
    def __init__(self, graph: ir.Graph) -> None:
        self.used = {v.name for v in _all_values(graph)} | set(graph.initializers)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


# ONNX Runtime registers some contrib ops (SimplifiedLayerNormalization, ...) in the default domain. onnx's
# version converter has no schema for them and refuses the whole graph, but leaves other domains alone:
# they wait in this domain while the opset is raised.
_ASIDE_DOMAIN = "ffn_fusion.no_onnx_schema"
_CONVERTER_FAILURES = ("Failed to convert", "Skipping version conversion")


def _raise_opset(model: ir.Model, target: int) -> tuple[int, int]:
    """Raise the default opset to `target`, converting every node that changed on the way (ReduceMean's
    axes attribute becomes an input at 18, ...): onnxscript's converter from opset 18, onnx's own below
    it. Weights are not read (the converters see the graph without its large initializers)."""
    before = model.opset_imports.get("", 1)
    if before >= target:
        return before, before
    from onnxscript.version_converter import ConvertVersionPass

    _move_domain(model, "", _ASIDE_DOMAIN, lambda node: not onnx.defs.has(node.op_type, ""))
    with _captured_warnings("onnxscript.version_converter") as warnings:
        try:
            ConvertVersionPass(target, fallback=True)(model)
        except Exception as exc:  # the converters raise assorted errors for ops they cannot convert
            warnings.append(f"{type(exc).__name__}: {str(exc).strip()}")
            warnings[-1] = f"{_CONVERTER_FAILURES[0]}: {warnings[-1]}"
    _move_domain(model, _ASIDE_DOMAIN, "", lambda node: True)
    failures = [w.splitlines()[0] for w in warnings if w.startswith(_CONVERTER_FAILURES)]
    after = model.opset_imports.get("", before)
    problem = failures[0] if failures else _schema_violation(model, after)
    if after < MIN_FP8_OPSET or problem:
        raise UserError(
            f"cannot raise the model's opset from {before} to {target} for FP8 Q/DQ"
            + (f" ({problem})" if problem else "")
            + f"; re-export it with opset >= {target}"
        )
    return before, after


def _move_domain(model: ir.Model, source: str, target: str, chosen) -> None:
    moved = False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == source and chosen(node):
            node.domain, moved = target, True
    if source == _ASIDE_DOMAIN:
        model.opset_imports.pop(source, None)
    elif moved:
        model.opset_imports[target] = 1


@contextlib.contextmanager
def _captured_warnings(logger_name: str) -> Iterator[list[str]]:
    """Collect a logger's warnings instead of printing them (the converter logs its failures)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _schema_violation(model: ir.Model, opset: int) -> str | None:
    """A node the conversion left invalid at `opset` (an attribute its schema no longer has), if any."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != "" or not onnx.defs.has(node.op_type, ""):
            continue
        schema = onnx.defs.get_schema(node.op_type, opset, "")
        unknown = sorted(set(node.attributes) - set(schema.attributes))
        if unknown:
            return f"{node.op_type} node {node.name!r} keeps attribute {unknown[0]!r}, gone at opset {opset}"
    return None


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
        scale = _channel_scales(source.tensor, source.transpose, dtype)
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
        report.opset = _raise_opset(model, self.target_opset)
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
        if (problem := _schema_violation(model, opset)) is not None:
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
