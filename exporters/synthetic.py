"""Synthetic decoder graphs built directly in ONNX, in every pattern variant the recognizers accept.

Used for pattern tests and for the fusion scale benchmark. The residual stream is
embedding -> [attention] -> RMSNorm -> SwiGLU -> Add ... -> final norm -> lm_head, in the norm/FFN
form chosen by name (docs/design.md §3). Weights are random; with `external=True` each initializer is written
to one external data file as it is generated, so a multi-GB model never sits in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from passes.io.file_copy import WRITE_BYTES

NORMS = (
    "pow_reciprocal",
    "mul_div",
    "pow_rsqrt",
    "cast_fp32",
    "rmsnorm_op",
    "simplified_ln",
    "skip_simplified_ln",
)
FFNS = ("matmul", "matmul_swapped", "transpose", "gemm", "gate_up_split", "gate_up_slice")
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


@dataclass
class SyntheticSpec:
    hidden: int = 32
    vocab: int = 64
    blocks: list[tuple[bool, int]] = field(default_factory=lambda: [(True, 48), (False, 64), (False, 40)])
    norm: str = "pow_reciprocal"
    ffn: str = "matmul"
    dtype: str = "float32"
    opset: int = 18
    eps: float = 1e-5
    seed: int = 0


class _Builder:
    def __init__(self, spec: SyntheticSpec, data_path: Path | None):
        self.spec, self.nodes, self.inits = spec, [], []
        self.rng = np.random.default_rng(spec.seed)
        self.data_path, self.offset, self.count = data_path, 0, 0
        self.elem = DTYPES[spec.dtype]
        if data_path is not None:
            data_path.write_bytes(b"")

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        outputs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(
            helper.make_node(op, inputs, outputs, name=self.name("node"), domain=domain, **attrs)
        )
        return outputs

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, shape: tuple[int, ...], scale: float, base: str, offset: float = 0.0) -> str:
        array = (offset + scale * self.rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        name = self.name(base)
        tensor = _typed_tensor(array, self.elem, name)
        if self.data_path is not None and tensor.ByteSize() > 1024:
            raw = tensor.raw_data
            with self.data_path.open("ab") as f:
                view = memoryview(raw)
                for start in range(0, len(view), WRITE_BYTES):  # small writes: see file_copy.WRITE_BYTES
                    f.write(view[start : start + WRITE_BYTES])
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (
                ("location", self.data_path.name),
                ("offset", self.offset),
                ("length", len(raw)),
            ):
                tensor.external_data.add(key=key, value=str(value))
            self.offset += len(raw)
        self.inits.append(tensor)
        return name

    def scalar(self, value: float) -> str:
        return self.const(np.array(value, dtype=np.float32))

    def cast(self, x: str, to: int) -> str:
        return self.node("Cast", [x], to=to)[0]

    def rmsnorm(self, x: str) -> str:
        spec, w = self.spec, self.weight((self.spec.hidden,), 0.1, "norm_weight", offset=1.0)
        if spec.norm == "rmsnorm_op":
            return self.node("RMSNormalization", [x, w], axis=-1, epsilon=spec.eps)[0]
        if spec.norm == "simplified_ln":
            return self.node("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=spec.eps)[0]
        fp32 = spec.norm == "cast_fp32" or spec.dtype != "float32"
        h = self.cast(x, TensorProto.FLOAT) if fp32 else x
        square = (
            self.node("Mul", [h, h])[0]
            if spec.norm == "mul_div"
            else self.node("Pow", [h, self.scalar(2.0)])[0]
        )
        if spec.opset >= 18:
            mean = self.node("ReduceMean", [square, self.const(np.array([-1], np.int64))], keepdims=1)[0]
        else:
            mean = self.node("ReduceMean", [square], axes=[-1], keepdims=1)[0]
        var = self.node("Add", [mean, self.scalar(spec.eps)])[0]
        if spec.norm == "pow_rsqrt":
            inv = self.node("Pow", [var, self.scalar(-0.5)])[0]
        elif spec.norm == "mul_div":
            inv = self.node("Div", [self.scalar(1.0), self.node("Sqrt", [var])[0]])[0]
        else:
            inv = self.node("Reciprocal", [self.node("Sqrt", [var])[0]])[0]
        normed = self.node("Mul", [h, inv])[0]
        normed = self.cast(normed, self.elem) if fp32 else normed
        return self.node("Mul", [w, normed])[0]

    def linear(self, x: str, n_in: int, n_out: int, base: str, scale: float) -> str:
        kind = self.spec.ffn
        if kind in ("transpose", "gemm"):
            w = self.weight((n_out, n_in), scale, base)
            if kind == "gemm":
                return self.node("Gemm", [x, w], transB=1)[0]
            return self.node("MatMul", [x, self.node("Transpose", [w], perm=[1, 0])[0]])[0]
        return self.node("MatMul", [x, self.weight((n_in, n_out), scale, base)])[0]

    def swiglu(self, z: str, width: int, n_blocks: int) -> str:
        hidden, kind = self.spec.hidden, self.spec.ffn
        scale_in, scale_down = hidden**-0.5, (width * 2 * n_blocks) ** -0.5
        if kind.startswith("gate_up"):
            fused = self.linear(z, hidden, 2 * width, "gate_up", scale_in)
            if kind == "gate_up_split":
                gate, up = self.node(
                    "Split", [fused, self.const(np.array([width, width], np.int64))], 2, axis=-1
                )
            else:
                axes = self.const(np.array([-1], np.int64))
                bounds = [np.array([b], np.int64) for b in (0, width, 2**62)]
                gate = self.node("Slice", [fused, self.const(bounds[0]), self.const(bounds[1]), axes])[0]
                up = self.node("Slice", [fused, self.const(bounds[1]), self.const(bounds[2]), axes])[0]
        else:
            gate = self.linear(z, hidden, width, "gate", scale_in)
            up = self.linear(z, hidden, width, "up", scale_in)
        sig = self.node("Sigmoid", [gate])[0]
        silu = self.node("Mul", [sig, gate] if kind == "matmul_swapped" else [gate, sig])[0]
        product = self.node("Mul", [up, silu] if kind == "matmul_swapped" else [silu, up])[0]
        return self.linear(product, width, hidden, "down", scale_down)

    def attention(self, x: str) -> str:
        """Single-head causal-free self-attention: enough structure (Softmax) to be recognized and run."""
        h = self.spec.hidden
        z = self.rmsnorm(x)
        q, k, v = (self.linear(z, h, h, name, h**-0.5) for name in ("q", "k", "v"))
        perm = [1, 0] if self.spec.ffn == "gemm" else [0, 2, 1]
        scores = self.node("MatMul", [q, self.node("Transpose", [k], perm=perm)[0]])[0]
        scores = self.node("Mul", [scores, self.cast(self.scalar(h**-0.5), self.elem)])[0]
        probs = self.node("Softmax", [scores], axis=-1)[0]
        return self.linear(
            self.node("MatMul", [probs, v])[0], h, h, "o", (2 * h * len(self.spec.blocks)) ** -0.5
        )


def build_synthetic(spec: SyntheticSpec, path: str | Path, external: bool = False) -> Path:
    """Write the synthetic model to `path` (external data in `<name>.data` when asked)."""
    path = Path(path)
    b = _Builder(spec, path.with_name(path.name + ".data") if external else None)
    flat = spec.ffn == "gemm"  # Gemm takes 2-D inputs: the whole stream is [tokens, hidden]
    ids_dims = ["seq"] if flat else ["batch", "seq"]
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ids_dims)
    stream = b.node("Gather", [b.weight((spec.vocab, spec.hidden), 1.0, "embed"), "input_ids"])[0]
    skip = spec.norm == "skip_simplified_ln"
    if skip:
        z = b.node(
            "SimplifiedLayerNormalization",
            [stream, b.weight((spec.hidden,), 0.1, "nw", 1.0)],
            epsilon=spec.eps,
        )[0]
    for attention, width in spec.blocks:
        if attention and skip:
            raise ValueError("skip_simplified_ln synthetic models have no attention")
        if attention:
            stream = b.node("Add", [stream, b.attention(stream)])[0]
        if skip:
            out = b.swiglu(z, width, len(spec.blocks))
            w = b.weight((spec.hidden,), 0.1, "nw", 1.0)
            z, _, _, stream = b.node(
                "SkipSimplifiedLayerNormalization",
                [out, stream, w],
                4,
                domain="com.microsoft",
                epsilon=spec.eps,
            )
        else:
            stream = b.node("Add", [stream, b.swiglu(b.rmsnorm(stream), width, len(spec.blocks))])[0]
    final = z if skip else b.rmsnorm(stream)
    logits = b.node("MatMul", [final, b.weight((spec.hidden, spec.vocab), spec.hidden**-0.5, "lm_head")])[0]
    if spec.dtype != "float32":
        logits = b.cast(logits, TensorProto.FLOAT)
    b.nodes[-1].output[0] = "logits"
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*ids_dims, spec.vocab])
    graph = helper.make_graph(b.nodes, "synthetic_decoder", [ids], [out], initializer=b.inits)
    opsets = [helper.make_opsetid("", spec.opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="ffn-fusion synthetic")
    model.ir_version = 11 if spec.opset >= 23 else 10
    onnx.save(model, str(path))
    return path


def _typed_tensor(array: np.ndarray, elem: int, name: str) -> TensorProto:
    if elem == TensorProto.FLOAT:
        return numpy_helper.from_array(array, name)
    if elem == TensorProto.FLOAT16:
        return numpy_helper.from_array(array.astype(np.float16), name)
    bits = (array.view(np.uint32) + 0x8000) >> 16  # round to nearest bfloat16
    tensor = helper.make_tensor(
        name, TensorProto.BFLOAT16, array.shape, bits.astype(np.uint16).tobytes(), raw=True
    )
    return tensor
