"""The KV-cache decode graph of a Hugging Face Llama-family or Nemotron-NAS checkpoint, built with onnx-ir.

    model = build_decode(config, decode_spec(config, torch_model=False))    # weights without values

The graph interface of exporters/decode.py (its module docstring), without torch and in well under a
second at any depth:

    inputs   input_ids int64 [batch, seq], attention_mask int64 [batch, total],
             past_key_<L>, past_value_<L> float32 [batch, kv_heads_L, past_len, head_dim]   GQA layers L
    outputs  logits float32 [batch, seq, vocab], present_key_<L>, present_value_<L> [.., total, ..]

in layer order, key before value, with the metadata `ffn_fusion.decode` (exporters.decode.describe).
Every layer is exporters.hf.prefill_graph's (`ModelGraph`: the same norms, linear layers, SwiGLU,
rotary and GQA nodes, the same initializer names); what differs is given here:

- positions come from the mask as Hugging Face generation makes them, cumsum(attention_mask) - 1 (0 on
  padding), for the new tokens only: rotary tables [batch, 1, seq, head_dim], each row its own; dynamic
  NTK grows its base from the largest position in the call;
- a layer's new keys (rotated) and values are appended to its past (Concat on the sequence axis): those
  are its present outputs, and what its queries attend to;
- the additive mask [batch, 1, 1, seq, total] lets a query see cache slots that are not padding, not in
  its future and, with a sliding window, fewer than `window` slots back; others get float32's lowest
  finite value, so that a padding query that sees nothing gets a uniform softmax, not NaN.

The graph is float32 (so are the caches), as exporters/decode.py's.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from exporters.decode_spec import DecodeSpec, describe
from exporters.hf.config import HfConfig
from exporters.hf.prefill_graph import BATCH, FLOAT, INT64, INT64_MAX, OPSET, SEQ, ModelGraph
from passes.metadata import DECODE_METADATA_KEY

PAST, TOTAL = "past_len", "total"
BOOL = ir.DataType.BOOL


class _Decode(ModelGraph):
    """The decode graph: the forward pass of ModelGraph over a cache (see the module docstring)."""

    KEYS = TOTAL

    def __init__(self, config: HfConfig) -> None:
        super().__init__(config, FLOAT)
        self.mask = ir.Value(name="attention_mask", type=ir.TensorType(INT64), shape=ir.Shape([BATCH, TOTAL]))
        dim = self.head_dim
        self.past: dict[int, tuple[ir.Value, ir.Value]] = {
            index: tuple(
                ir.Value(
                    name=f"past_{kind}_{index}",
                    type=ir.TensorType(FLOAT),
                    shape=ir.Shape([BATCH, layer.kv_heads, PAST, dim]),
                )
                for kind in ("key", "value")
            )
            for index, layer in enumerate(config.layers)
            if layer.attention == "gqa"
        }

    def _inputs(self) -> list[ir.Value]:
        b = self.b
        with b.scope("model"):
            self.total = b.op("Shape", [self.mask], INT64, [1], start=1, end=2)
            self.past_len = b.op("Sub", [self.total, self.seq], INT64, [1])
        return [self.mask, *(value for pair in self.past.values() for value in pair)]

    def _positions(self) -> tuple[ir.Value, list[int | str]]:
        """cumsum(mask) - 1, 0 on padding, of the new tokens (the last seq slots): float32 [batch, seq]."""
        b = self.b
        with b.scope("model"):
            count = b.op("CumSum", [self.mask, b.const("axis_1", 1, INT64)], INT64, [BATCH, TOTAL])
            positions = b.op("Sub", [count, b.const("one_int", 1, INT64)], INT64, [BATCH, TOTAL])
            positions = b.op("Clip", [positions, b.const("zero_int", 0, INT64)], INT64, [BATCH, TOTAL])
            bounds = [self.past_len, b.ints(INT64_MAX), b.ints(1), b.ints(1)]
            positions = b.op("Slice", [positions, *bounds], INT64, [BATCH, SEQ])
            return b.op("Cast", [positions], FLOAT, [BATCH, SEQ], to=FLOAT), [BATCH, SEQ]

    def _position_count(self, positions: ir.Value) -> ir.Value:
        b = self.b
        largest = b.op("ReduceMax", [positions], FLOAT, [], keepdims=0)
        largest = b.op("Unsqueeze", [largest, b.ints(0)], FLOAT, [1])
        return b.op("Add", [largest, b.const("one", 1.0, FLOAT)], FLOAT, [1])

    def _mask(self, window: int | None) -> ir.Value:
        """Additive [batch, 1, 1, seq, total]: 0 where a query may see a slot, float32's lowest elsewhere."""
        if window not in self._masks:
            b = self.b
            with b.scope("model"):
                if not self._masks:  # slot numbers, shared by every window
                    zero, one = b.const("zero_int", 0, INT64), b.const("one_int", 1, INT64)
                    total = b.op("Squeeze", [self.total], INT64, [])
                    start = b.op("Squeeze", [self.past_len], INT64, [])
                    key = b.op("Range", [zero, total, one], INT64, [TOTAL])
                    query = b.op("Range", [start, total, one], INT64, [SEQ])
                    self._key = b.op("Unsqueeze", [key, b.ints(0)], INT64, [1, TOTAL])
                    self._query = b.op("Unsqueeze", [query, b.ints(1)], INT64, [SEQ, 1])
                    valid = b.op("Greater", [self.mask, zero], BOOL, [BATCH, TOTAL])
                    self._valid = b.op("Unsqueeze", [valid, b.ints(1)], BOOL, [BATCH, 1, TOTAL])
                allowed = b.op("LessOrEqual", [self._key, self._query], BOOL, [SEQ, TOTAL])
                if window is not None:
                    size = b.const(f"window_{window}", window, INT64)
                    oldest = b.op("Sub", [self._query, size], INT64, [SEQ, 1])
                    recent = b.op("Greater", [self._key, oldest], BOOL, [SEQ, TOTAL])
                    allowed = b.op("And", [allowed, recent], BOOL, [SEQ, TOTAL])
                allowed = b.op("And", [allowed, self._valid], BOOL, [BATCH, SEQ, TOTAL])
                lowest = b.const("float32_lowest", np.finfo(np.float32).min, FLOAT)
                zero = b.const("zero", 0.0, FLOAT)
                bias = b.op("Where", [allowed, zero, lowest], FLOAT, [BATCH, SEQ, TOTAL])
                self._masks[window] = b.op(
                    "Unsqueeze", [bias, b.ints(1, 2)], FLOAT, [BATCH, 1, 1, SEQ, TOTAL]
                )
        return self._masks[window]

    def _keys(self, index: int, k: ir.Value, v: ir.Value, kv: int) -> tuple[ir.Value, ir.Value]:
        """past ++ new along the sequence: the present outputs, and what the layer's queries attend to."""
        presents = []
        for kind, past, new in zip(("key", "value"), self.past[index], (k, v), strict=True):
            present = self.b.op("Concat", [past, new], FLOAT, [BATCH, kv, TOTAL, self.head_dim], axis=2)
            present.name = f"present_{kind}_{index}"
            presents.append(present)
        self.outputs.extend(presents)
        return presents[0], presents[1]


def build_decode(config: HfConfig, spec: DecodeSpec, opset: int | None = None) -> ir.Model:
    """The float32 decode graph of `config`, weights without values; `spec` (exporters.hf.config.decode_spec
    of the same config) gives its metadata."""
    graph = _Decode(config).build()
    graph.opset_imports[""] = opset or OPSET
    model = ir.Model(graph, ir_version=10, producer_name="ffn-fusion exporters.hf.decode_graph")
    model.metadata_props[DECODE_METADATA_KEY] = json.dumps(describe(spec))
    return model
