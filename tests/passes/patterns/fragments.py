"""Small ONNX graph fragments for the recognizer tests (tests/passes/patterns/test_*.py).

A fragment is built with onnx.helper, as an exporter writes a proto, and read as onnx-ir the way
passes/io/model_io.py reads a model, so a matcher sees what it sees in a loaded graph (no value_info on
computed tensors: only graph inputs and initializers carry shapes). `run` evaluates a fragment in ONNX
Runtime, so a test can check that a record's fields reproduce what the fragment computes.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

FLOAT, FLOAT16, INT64, INT32, BOOL = (
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.BOOL,
)


class Fragment:
    """Nodes, initializers and graph inputs; `build(outputs)` makes the onnx-ir model, `f[name]` a value."""

    def __init__(self, opset: int = 18, seed: int = 0) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0
        self.proto: onnx.ModelProto | None = None
        self.model: ir.Model | None = None
        self._values: dict[str, ir.Value] = {}

    def _name(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def input(self, name: str, shape: list[int | str] | None, elem: int = FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self._name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, *shape: int, base: str = "w", dtype=np.float32, offset: float = 0.0) -> str:
        scale = shape[0] ** -0.5 if len(shape) == 2 else 0.1
        return self.const((offset + scale * self.rng.standard_normal(shape)).astype(dtype), base)

    def scalar(self, value: float, dtype=np.float32) -> str:
        return self.const(np.array(value, dtype=dtype), "s")

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64), "i")

    def ops(self, op: str, *inputs: str | None, outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        names = [self._name(op.lower()) for _ in range(outputs)]
        ins = ["" if i is None else i for i in inputs]
        self.nodes.append(helper.make_node(op, ins, names, name=self._name("node"), domain=domain, **attrs))
        return names

    def op(self, op: str, *inputs: str | None, domain: str = "", **attrs) -> str:
        return self.ops(op, *inputs, domain=domain, **attrs)[0]

    def build(self, *outputs: str, elem: int = FLOAT) -> ir.Model:
        """The onnx-ir model whose graph outputs are `outputs` (float tensors of unknown shape)."""
        outs = [helper.make_tensor_value_info(o, elem, None) for o in outputs]
        graph = helper.make_graph(self.nodes, "fragment", self.inputs, outs, initializer=self.inits)
        opsets = [helper.make_opsetid("", self.opset), helper.make_opsetid("com.microsoft", 1)]
        self.proto = helper.make_model(graph, opset_imports=opsets)
        self.proto.ir_version = 11 if self.opset >= 23 else 10
        self.model = ir.serde.deserialize_model(self.proto)
        graph_ir = self.model.graph
        self._values = {v.name: v for v in graph_ir.inputs}
        self._values.update(graph_ir.initializers)
        for node in graph_ir:
            self._values.update({v.name: v for v in node.outputs if v.name})
        return self.model

    def __getitem__(self, name: str) -> ir.Value:
        return self._values[name]

    def node(self, output: str) -> ir.Node:
        """The node producing `output` in the built model."""
        return self[output].producer()

    def array(self, name: str) -> np.ndarray:
        """An initializer's value."""
        return self[name].const_value.numpy()

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """The first graph output, computed by ONNX Runtime (CPU, graph optimizations off: the fragment as
        written)."""
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(
            self.proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return session.run(None, feeds)[0]
