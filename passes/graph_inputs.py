"""What a decoder graph's inputs and outputs mean, and feeds for any of them (numpy only).

The one place that knows the naming conventions of the exporters this project meets:

- token ids: `input_ids` ([batch, seq] or flat [seq]); a graph whose first input is an integer tensor
  of rank 1 or 2 is read the same way;
- `attention_mask` ([batch, past + seq], int), `position_ids` ([batch, seq], int);
- KV cache: Optimum / ONNX Runtime GenAI `past_key_values.N.key|value` -> `present.N.key|value`, and the
  project's own decode graphs `past_key_<L>|past_value_<L>` -> `present_key_<L>|present_value_<L>`,
  both [batch, kv_heads, past, head_dim], `kv_heads` read per input (Nemotron-NAS / Puzzle layers differ);
- a float input of rank 2 or 3 is the residual stream entering a pipeline-stage graph (issue 13);
- `logits` (else the first output).

Static dims (a batch exported as a fixed 1, say) are read from the model: `Signature.batch` is the fixed
batch or None, `Signature.fixed_seq` the fixed sequence length or None.

Usage:

    sig = Signature.of(proto)                 # onnx.ModelProto, onnx_ir.Model, path, or an ORT session
    feeds = sig.feeds(tokens)                 # every input fed: mask of ones, positions, empty cache
    feeds = sig.feeds(tokens, past_length=0)  # same; a non-zero past_length makes zero-filled caches
    sig.cache_inputs / sig.cache_outputs      # GraphInput / GraphOutput records with .layer and .kind
    sig.present_for(past_input_name)          # the output that carries that cache entry's next value
    sig.batch_size(wanted)                    # `wanted`, capped by a static batch dim

`FeedError` (a UserError) says which input cannot be fed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from passes.errors import UserError

Dim = int | str | None  # static size, symbolic name, or unknown


class Role(Enum):
    IDS = "input_ids"
    MASK = "attention_mask"
    POSITIONS = "position_ids"
    PAST = "past"  # KV cache input
    STREAM = "stream"  # hidden states entering a pipeline-stage graph
    LOGITS = "logits"
    PRESENT = "present"  # KV cache output
    OTHER = "other"


class FeedError(UserError):
    """A graph input this module cannot make a value for."""


_PAST = [re.compile(r"^past_key_values\.(?P<layer>\d+)\.(?P<kind>key|value)$"),
         re.compile(r"^past_(?P<kind>key|value)_(?P<layer>\d+)$"),
         re.compile(r"^past_key_values_(?P<layer>\d+)_(?P<kind>key|value)$")]
_PRESENT = [re.compile(r"^present\.(?P<layer>\d+)\.(?P<kind>key|value)$"),
            re.compile(r"^present_(?P<kind>key|value)_(?P<layer>\d+)$"),
            re.compile(r"^present_(?P<layer>\d+)_(?P<kind>key|value)$")]
_INTEGER = {np.dtype(t) for t in (np.int32, np.int64, np.uint32, np.uint64)}
_HALF = {np.dtype(np.float16)}  # bfloat16 inputs already read as float32 (_np_dtype)


@dataclass(frozen=True)
class GraphInput:
    name: str
    role: Role
    dtype: np.dtype  # numpy dtype of the declared element type (bfloat16 reads as float32)
    dims: tuple[Dim, ...]
    layer: int | None = None  # cache entries: the layer index in the name
    kind: str | None = None  # cache entries: "key" or "value"

    @property
    def rank(self) -> int:
        return len(self.dims)

    def static(self, axis: int) -> int | None:
        dim = self.dims[axis] if -self.rank <= axis < self.rank else None
        return dim if isinstance(dim, int) and dim > 0 else None


GraphOutput = GraphInput  # same record; roles LOGITS, PRESENT, OTHER


@dataclass(frozen=True)
class Signature:
    inputs: tuple[GraphInput, ...]
    outputs: tuple[GraphOutput, ...]

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(cls, model: Any) -> Signature:
        """From an onnx.ModelProto, an onnx_ir.Model, a path to a .onnx file, or an ORT InferenceSession."""
        if isinstance(model, str | Path):
            model = onnx.load(str(model), load_external_data=False)
        if isinstance(model, onnx.ModelProto):
            return cls._from_proto(model)
        if hasattr(model, "get_inputs"):  # onnxruntime.InferenceSession
            return cls._from_session(model)
        if hasattr(model, "graph") and hasattr(model.graph, "inputs"):  # onnx_ir.Model
            return cls._from_ir(model)
        raise TypeError(f"cannot read graph inputs from {type(model).__name__}")

    @classmethod
    def _from_proto(cls, proto: onnx.ModelProto) -> Signature:
        initializers = {t.name for t in proto.graph.initializer}

        def info(value: onnx.ValueInfoProto) -> tuple[str, np.dtype, tuple[Dim, ...]]:
            tensor = value.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                         for d in tensor.shape.dim)
            return value.name, _np_dtype(tensor.elem_type), dims

        ins = [info(v) for v in proto.graph.input if v.name not in initializers]
        head_dims = _fused_cache_head_dims(proto)
        ins = [(n, t, _with_head_dim(d, head_dims.get(n))) for n, t, d in ins]
        return cls.build(ins, [info(v) for v in proto.graph.output])

    @classmethod
    def _from_session(cls, session: Any) -> Signature:
        def info(arg: Any) -> tuple[str, np.dtype, tuple[Dim, ...]]:
            dims = tuple(d if isinstance(d, int) and d > 0 else (d if isinstance(d, str) else None)
                         for d in arg.shape)
            return arg.name, _ort_dtype(arg.type), dims

        return cls.build([info(a) for a in session.get_inputs()], [info(a) for a in session.get_outputs()])

    @classmethod
    def _from_ir(cls, model: Any) -> Signature:
        def info(value: Any) -> tuple[str, np.dtype, tuple[Dim, ...]]:
            dims = tuple(d if isinstance(d, int) else (str(d) if d is not None and str(d) else None)
                         for d in (value.shape or ()))
            elem = value.dtype.value if value.dtype is not None else onnx.TensorProto.FLOAT
            return value.name, _np_dtype(elem), dims

        ins = [info(v) for v in model.graph.inputs if not v.is_initializer()]
        return cls.build(ins, [info(v) for v in model.graph.outputs])

    @classmethod
    def build(cls, inputs: Sequence[tuple[str, np.dtype, tuple[Dim, ...]]],
              outputs: Sequence[tuple[str, np.dtype, tuple[Dim, ...]]]) -> Signature:
        """From (name, numpy dtype, dims) triples, e.g. a backend's declared inputs and outputs."""
        ins = tuple(_input(i, *triple) for i, triple in enumerate(inputs))
        outs = tuple(_output(i, *triple) for i, triple in enumerate(outputs))
        return cls(ins, outs)

    # ------------------------------------------------------------------ queries
    def role(self, role: Role) -> GraphInput | None:
        return next((i for i in self.inputs if i.role is role), None)

    @property
    def ids(self) -> GraphInput | None:
        return self.role(Role.IDS)

    @property
    def stream(self) -> GraphInput | None:
        return self.role(Role.STREAM)

    @property
    def flat(self) -> bool:
        """Token ids are a flat [seq] vector (no batch axis)."""
        return self.ids is not None and self.ids.rank == 1

    @property
    def cache_inputs(self) -> list[GraphInput]:
        return [i for i in self.inputs if i.role is Role.PAST]

    @property
    def cache_outputs(self) -> list[GraphOutput]:
        return [o for o in self.outputs if o.role is Role.PRESENT]

    @property
    def cache_layers(self) -> list[int]:
        return sorted({i.layer for i in self.cache_inputs if i.layer is not None})

    @property
    def logits(self) -> GraphOutput:
        return next((o for o in self.outputs if o.role is Role.LOGITS), self.outputs[0])

    def present_for(self, past_name: str) -> str | None:
        """The output that carries the next value of cache input `past_name`."""
        past = next((i for i in self.cache_inputs if i.name == past_name), None)
        if past is None:
            return None
        same = (o.name for o in self.cache_outputs if (o.layer, o.kind) == (past.layer, past.kind))
        return next(same, None)

    @property
    def batch(self) -> int | None:
        """The batch size fixed in the graph (e.g. 1), or None when it is dynamic."""
        if self.flat:
            return 1
        lead = self.ids or self.stream
        fixed = [i.static(0) for i in ([lead] if lead else []) + self.cache_inputs]
        return next((b for b in fixed if b is not None), None)

    @property
    def fixed_seq(self) -> int | None:
        """The sequence length fixed in the graph, or None when it is dynamic."""
        lead = self.ids or self.stream
        if lead is None:
            return None
        return lead.static(0 if self.flat else 1)

    def batch_size(self, wanted: int) -> int:
        """`wanted`, capped by a fixed batch dim."""
        fixed = self.batch
        return wanted if fixed is None else min(wanted, fixed)

    # ------------------------------------------------------------------ feeds
    def feeds(self, tokens: np.ndarray, past_length: int = 0, stream: np.ndarray | None = None,
              half_as_float32: bool = True) -> dict[str, np.ndarray]:
        """A value for every graph input: `tokens` ([batch, seq], or [seq]) as the ids, an all-ones mask
        over past + seq, positions past..past+seq-1, zero-filled caches of `past_length`, and `stream`
        for a pipeline-stage graph's float input. Half-precision inputs are fed as float32 unless
        `half_as_float32` is False (checks run fp16 graphs in fp32 activations, passes/validate.py)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        batched = tokens.reshape(-1, tokens.shape[-1])
        batch, seq = batched.shape
        feeds: dict[str, np.ndarray] = {}
        for graph_input in self.inputs:
            half = half_as_float32 and graph_input.dtype in _HALF
            dtype = np.dtype(np.float32) if half else graph_input.dtype
            feeds[graph_input.name] = self._feed(graph_input, batched, batch, seq, past_length, stream, dtype)
        return feeds

    def _feed(self, graph_input: GraphInput, batched: np.ndarray, batch: int, seq: int, past: int,
              stream: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
        role = graph_input.role
        if role is Role.IDS:
            return (batched.reshape(-1) if graph_input.rank == 1 else batched).astype(dtype)
        if role is Role.MASK:
            return np.ones((batch, past + seq), dtype)
        if role is Role.POSITIONS:
            positions = np.arange(past, past + seq, dtype=dtype)
            return positions if graph_input.rank == 1 else np.broadcast_to(positions, (batch, seq)).copy()
        if role is Role.PAST:
            heads, head_dim = graph_input.static(1), graph_input.static(3)
            if graph_input.rank != 4 or heads is None or head_dim is None:
                raise FeedError(f"cannot feed cache input {graph_input.name!r} of shape {graph_input.dims}: "
                                "KV heads and head_dim must be static")
            return np.zeros((batch, heads, past, head_dim), dtype)
        if role is Role.STREAM and stream is not None:
            return np.asarray(stream, dtype)
        raise FeedError(f"cannot feed graph input {graph_input.name!r} (shape {graph_input.dims}): "
                        "not token ids, attention_mask, position_ids or a KV cache")


def _with_head_dim(dims: tuple[Dim, ...], head_dim: int | None) -> tuple[Dim, ...]:
    if head_dim is None or len(dims) != 4 or isinstance(dims[3], int):
        return dims
    return (*dims[:3], head_dim)


def _fused_cache_head_dims(proto: onnx.ModelProto) -> dict[str, int]:
    """Head dims of the past inputs of ORT's GroupQueryAttention, which GenAI's builder declares symbolic
    ("kv_cache_dim"): from the q (or packed qkv) projection's output width and the op's head counts."""
    producers = {out: node for node in proto.graph.node for out in node.output}
    shapes = {t.name: list(t.dims) for t in proto.graph.initializer}
    found: dict[str, int] = {}
    for node in proto.graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 5:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        heads, kv_heads = attrs.get("num_heads", 0), attrs.get("kv_num_heads", 0)
        packed = len(node.input) < 2 or not node.input[1]
        width = _linear_width(producers.get(node.input[0]), shapes, producers)
        divisor = heads + 2 * kv_heads if packed else heads
        if width and divisor and width % divisor == 0:
            for name in node.input[3:5]:
                found[name] = width // divisor
    return found


def _linear_width(
    node: onnx.NodeProto | None, shapes: dict[str, list[int]], producers: dict[str, onnx.NodeProto]
) -> int | None:
    """Output features of a MatMul with a constant [in, out] weight (or an FP8 one behind its
    DequantizeLinear, passes/quant/fp8.py), or of a MatMulNBits."""
    if node is None:
        return None
    if node.op_type == "MatMulNBits":
        return next((a.i for a in node.attribute if a.name == "N"), None)
    if node.op_type != "MatMul":
        return None
    weight = node.input[1]
    dequantize = producers.get(weight)
    if dequantize is not None and dequantize.op_type == "DequantizeLinear":
        weight = dequantize.input[0]
    return shapes[weight][1] if len(shapes.get(weight, [])) == 2 else None


def _input(index: int, name: str, dtype: np.dtype, dims: tuple[Dim, ...]) -> GraphInput:
    dtype = np.dtype(dtype)
    for pattern in _PAST:
        if match := pattern.match(name):
            return GraphInput(name, Role.PAST, dtype, dims, int(match["layer"]), match["kind"])
    named = {"input_ids": Role.IDS, "attention_mask": Role.MASK, "position_ids": Role.POSITIONS}
    if name in named:
        role = named[name]
    elif index == 0 and dtype in _INTEGER and len(dims) in (1, 2):
        role = Role.IDS
    elif dtype.kind == "f" and len(dims) in (2, 3):
        role = Role.STREAM
    else:
        role = Role.OTHER
    return GraphInput(name, role, dtype, dims)


def _output(index: int, name: str, dtype: np.dtype, dims: tuple[Dim, ...]) -> GraphOutput:
    for pattern in _PRESENT:
        if match := pattern.match(name):
            return GraphInput(name, Role.PRESENT, np.dtype(dtype), dims, int(match["layer"]), match["kind"])
    role = Role.LOGITS if name == "logits" else Role.OTHER
    return GraphInput(name, role, np.dtype(dtype), dims)


def _np_dtype(elem_type: int) -> np.dtype:
    if elem_type == onnx.TensorProto.BFLOAT16:
        return np.dtype(np.float32)
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return np.dtype(np.float32)


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
              "tensor(bfloat16)": np.float32, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


def _ort_dtype(type_string: str) -> np.dtype:
    return np.dtype(_ORT_TYPES.get(type_string, np.float32))
