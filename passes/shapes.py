"""A small symbolic shape interpreter over onnx-ir graphs (the sharding pass and the attention recognizer).

Every tensor gets a shape whose dims are `Dim` monomials (an integer times named symbols such as
"batch" and "seq"), and small integer tensors (shape vectors) also get their values, so that the shape
arguments of Reshape/Expand can be followed from `Shape(input_ids)` through Concat/Slice/Gather.
Each op's rule is one small function in `RULES`, keyed by (domain, op type); an op without a rule gets
unknown outputs (or the exporter's annotation, in `World`), and so does, in `World`, a node whose input
shapes its rule cannot reconcile (`World.run` never raises on a graph: the recognizers read it).

`World` runs it over a graph as the single-device model computes it; passes.shard.dims runs it again as
one tensor-parallel rank sees it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np
import onnx_ir as ir

# The onnx_ir graph.meta entry (in memory, never saved: not one of passes/metadata.py's keys) that keeps a
# graph's inferred shapes; importing passes.metadata here would close a circle through passes.plan.
SHAPES_CACHE = "ffn_fusion.shapes"
INT_MAX = 2**62  # Slice ends above this mean "to the end"
_MAX_VALUE_ELEMENTS = 64  # only small integer tensors carry values


@dataclass(frozen=True)
class Dim:
    """coef * product of symbols; a plain integer when `syms` is empty."""

    coef: int
    syms: tuple[str, ...] = ()

    @staticmethod
    def of(x: int | str) -> Dim:
        return Dim(1, (x,)) if isinstance(x, str) else Dim(int(x))

    @property
    def is_int(self) -> bool:
        return not self.syms

    def __int__(self) -> int:
        if self.syms:
            raise ValueError(f"{self} is symbolic")
        return self.coef

    def __mul__(self, other: Dim) -> Dim:
        return Dim(self.coef * other.coef, tuple(sorted(self.syms + other.syms)))

    def divides(self, other: Dim) -> bool:
        if self.coef == 0 or other.coef % self.coef:
            return False
        return not (Counter(self.syms) - Counter(other.syms))

    def __floordiv__(self, other: Dim) -> Dim:
        if not other.divides(self):
            raise ValueError(f"{other} does not divide {self}")
        rest = Counter(self.syms) - Counter(other.syms)
        return Dim(self.coef // other.coef, tuple(sorted(rest.elements())))

    def __str__(self) -> str:
        if not self.syms:
            return str(self.coef)
        body = "*".join(self.syms)
        return body if self.coef == 1 else f"{self.coef}*{body}"


ONE = Dim(1)
MaybeDim = Dim | None
Dims = tuple[MaybeDim, ...]


@dataclass(frozen=True)
class Info:
    """What the interpreter knows of a tensor: its shape, and its elements when it is a small int vector."""

    shape: Dims | None
    value: Dims | None = None


UNKNOWN = Info(None)


def product(dims: Iterable[MaybeDim]) -> MaybeDim:
    out = ONE
    for d in dims:
        if d is None:
            return None
        out = out * d
    return out


def dims_from_ir(shape: ir.Shape | None) -> Dims | None:
    if shape is None:
        return None
    out: list[MaybeDim] = []
    for d in shape:
        if isinstance(d, int):
            out.append(Dim(d))
        elif isinstance(d, ir.SymbolicDim) and d.value is not None and _plain_symbol(d.value):
            out.append(Dim.of(d.value))
        else:
            out.append(None)
    return tuple(out)


def _plain_symbol(name: str) -> bool:
    return name.replace("_", "").isalnum()


def dims_to_ir(dims: Dims | None) -> ir.Shape | None:
    if dims is None:
        return None
    out: list[int | ir.SymbolicDim] = []
    for d in dims:
        if d is not None and d.is_int:
            out.append(d.coef)
        elif d is not None and d.coef == 1 and len(d.syms) == 1:
            out.append(ir.SymbolicDim(d.syms[0]))
        else:
            out.append(ir.SymbolicDim(None))
    return ir.Shape(out)


def info_from_tensor(tensor: ir.TensorProtocol) -> Info:
    shape = tuple(Dim(int(d)) for d in tensor.shape)
    value = None
    small = math.prod(tensor.shape) <= _MAX_VALUE_ELEMENTS
    if small and tensor.dtype in (ir.DataType.INT64, ir.DataType.INT32):
        value = tuple(Dim(int(x)) for x in np.asarray(tensor.numpy()).reshape(-1))
    return Info(shape, value)


def broadcast(a: Dims | None, b: Dims | None) -> Dims | None:
    """Numpy broadcasting of two shapes; raises ValueError on a conflict of two integers.

    A symbolic dim may be 1 at run time, so against an integer other than 1 it broadcasts to that integer,
    and two different symbolic dims (a mask's 'total' and the scores' 'seq', equal in a prefill graph)
    broadcast to an unknown dim, as ONNX's own shape inference has it."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a = (ONE,) * (n - len(a)) + tuple(a)
    b = (ONE,) * (n - len(b)) + tuple(b)
    out: list[MaybeDim] = []
    for x, y in zip(a, b, strict=True):
        if x == y:
            out.append(x)
        elif x == ONE:
            out.append(y)
        elif y == ONE:
            out.append(x)
        elif x is None or y is None:
            out.append(x if y is None else y)
        elif x.is_int and y.is_int:
            raise ValueError(f"cannot broadcast {fmt_dims(a)} with {fmt_dims(b)}")
        else:
            out.append(x if x.is_int else y if y.is_int else None)
    return tuple(out)


def fmt_dims(dims: Dims | None) -> str:
    return "?" if dims is None else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def align(full_in: Dims, full_out: Dims) -> list[tuple[list[int], list[int]]] | None:
    """The finest grouping of input axes and output axes with equal products (how a Reshape maps them)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(full_in) and j < len(full_out):
        gi, gj = [i], [j]
        pa, pb = full_in[i], full_out[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa is None or pb is None:
                return None
            if pa.divides(pb) and i < len(full_in):
                pa = pa * full_in[i] if full_in[i] is not None else None
                gi.append(i)
                i += 1
            elif pb.divides(pa) and j < len(full_out):
                pb = pb * full_out[j] if full_out[j] is not None else None
                gj.append(j)
                j += 1
            else:
                return None
        groups.append((gi, gj))
    rest_in, rest_out = list(range(i, len(full_in))), list(range(j, len(full_out)))
    if any(full_in[k] != ONE for k in rest_in) or any(full_out[k] != ONE for k in rest_out):
        return None
    if groups:
        groups[-1][0].extend(rest_in)
        groups[-1][1].extend(rest_out)
    return groups


def reshape_dims(x: Dims | None, target: Dims | None, allowzero: bool) -> Dims | None:
    if target is None:
        return None
    out: list[MaybeDim] = []
    for i, t in enumerate(target):
        if t is not None and t == Dim(0) and not allowzero:
            out.append(x[i] if x is not None and i < len(x) else None)
        else:
            out.append(t)
    if Dim(-1) in out:
        k = out.index(Dim(-1))
        known = product(d for n, d in enumerate(out) if n != k)
        total = product(x) if x is not None else None
        out[k] = total // known if total is not None and known is not None and known.divides(total) else None
    return tuple(out)


def axes_from(node: ir.Node, infos: Sequence[Info], input_index: int) -> list[int] | None:
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        value = infos[input_index].value
        if value is None or any(v is None or not v.is_int for v in value):
            return None
        return [int(v) for v in value]
    attr = node.attributes.get("axes")
    return None if attr is None else [int(a) for a in attr.value]


def node_attr(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def int_values(info: Info) -> list[int] | None:
    if info.value is None or any(v is None or not v.is_int for v in info.value):
        return None
    return [int(v) for v in info.value]


def _slice_len(dim: MaybeDim, start: int, end: int, step: int) -> MaybeDim:
    if dim is not None and dim.is_int:
        return Dim(len(range(*slice(start, end, step).indices(int(dim)))))
    if start == 0 and end >= INT_MAX and step == 1:
        return dim
    return None


# ------------------------------------------------------------------------------------------ op families

ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "And",
    "Or",
    "Xor",
    "Max",
    "Min",
    "Sum",
    "Mod",
    "BitwiseAnd",
    "BitwiseOr",
}
SAME_SHAPE = {
    "Neg",
    "Sqrt",
    "Reciprocal",
    "Sigmoid",
    "Tanh",
    "Relu",
    "Erf",
    "Exp",
    "Log",
    "Abs",
    "Not",
    "IsNaN",
    "IsInf",
    "Softmax",
    "LogSoftmax",
    "Gelu",
    "Silu",
    "Swish",
    "Clip",
    "Floor",
    "Ceil",
    "Round",
    "Sin",
    "Cos",
    "QuantizeLinear",
    "DequantizeLinear",
    "Trilu",
    "CumSum",
    "Dropout",
    "Elu",
    "LeakyRelu",
    "HardSigmoid",
    "Softplus",
    "LayerNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
}
KEEPS_VALUE = {"Cast", "CastLike", "Identity"}  # same shape, and a shape vector keeps its elements
REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare"}
ATTENTION_OPS = ("Attention", "GroupQueryAttention", "MultiHeadAttention")


# ------------------------------------------------------------------------------------------ shape vectors


def _filled(node: ir.Node, shape: Dims | None) -> Dims | None:
    """The elements of a small integer ConstantOfShape (TorchScript builds expand shapes with it)."""
    if shape is None or len(shape) != 1 or shape[0] is None or not shape[0].is_int:
        return None
    attr = node.attributes.get("value")
    tensor = attr.value if attr is not None else None
    if tensor is None or tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None if tensor is not None else (Dim(0),) * int(shape[0])
    n = int(shape[0])
    return (Dim(int(np.asarray(tensor.numpy()).reshape(-1)[0])),) * n if n <= _MAX_VALUE_ELEMENTS else None


def _where_value(cond: Dims | None, a: Dims | None, b: Dims | None) -> Dims | None:
    if cond is None or a is None or b is None:
        return None
    n = max(len(cond), len(a), len(b))
    cond, a, b = (v * n if len(v) == 1 else v for v in (cond, a, b))
    if not len(cond) == len(a) == len(b) or any(c is None or not c.is_int for c in cond):
        return None
    return tuple(x if int(c) else y for c, x, y in zip(cond, a, b, strict=True))


def _equal(x: Dim, y: Dim) -> MaybeDim:
    if x.is_int and y.is_int:
        return Dim(int(x.coef == y.coef))
    if (x.is_int and x.coef <= 0) or (y.is_int and y.coef <= 0):
        return Dim(0)  # a symbolic dim is positive
    return Dim(1) if x == y else None


def _elementwise_value(op: str, a: Dims | None, b: Dims | None) -> Dims | None:
    if a is None or b is None or op not in ("Add", "Sub", "Mul", "Div", "Mod", "Equal"):
        return None
    if len(a) != len(b):
        if len(a) == 1:
            a = a * len(b)
        elif len(b) == 1:
            b = b * len(a)
        else:
            return None
    out: list[MaybeDim] = []
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            out.append(None)
        elif op == "Mul":
            out.append(x * y)
        elif op == "Div":
            out.append(x // y if y.coef != 0 and y.divides(x) else None)
        elif op == "Equal":
            out.append(_equal(x, y))
        elif op == "Mod":  # TorchScript computes Slice bounds of shape vectors with Mod
            out.append(Dim(x.coef % y.coef) if x.is_int and y.is_int and y.coef else None)
        elif x.is_int and y.is_int:
            out.append(Dim(x.coef + y.coef if op == "Add" else x.coef - y.coef))
        else:
            out.append(None)
    return tuple(out)


# ------------------------------------------------------------------------------------------ rules
# A rule maps a node, its first input's info (UNKNOWN when it has none) and all its input infos to its
# output infos, or to None when it cannot follow the node.

Rule = Callable[[ir.Node, Info, Sequence[Info]], list[Info] | None]


def _shape(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    if x.shape is None:
        return [UNKNOWN]
    n = len(x.shape)
    start, end = node_attr(node, "start", 0), node_attr(node, "end", n)
    picked = x.shape[slice(start, end)]
    return [Info((Dim(len(picked)),), tuple(picked))]


def _size(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    return [Info((), (product(x.shape) if x.shape is not None else None,))]


def _constant(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info] | None:
    attr = node.attributes.get("value")
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        return [info_from_tensor(attr.value)]
    return None


def _same_shape(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    """The first output has the input's shape; further outputs (Dropout's mask) stay unknown."""
    return [Info(x.shape), *[UNKNOWN] * (len(node.outputs) - 1)]


def _keeps_value(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    return [Info(x.shape, x.value), *[UNKNOWN] * (len(node.outputs) - 1)]


def _elementwise(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    shape = reduce(broadcast, [i.shape for i in ins])
    value = _elementwise_value(node.op_type, ins[0].value, ins[1].value) if len(ins) == 2 else None
    return [Info(shape, value)]


def _where(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    """Followed for TorchScript's expand: Where(Equal(shape, -1), 1, shape)."""
    shape = reduce(broadcast, [i.shape for i in ins])
    value = _where_value(ins[0].value, ins[1].value, ins[2].value) if len(ins) == 3 else None
    return [Info(shape, value)]


def _squeeze(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    axes = axes_from(node, ins, 1)
    if x.shape is None:
        return [Info(None, x.value)]
    n = len(x.shape)
    if axes is None:
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            return [Info(None, x.value)]
        shape = tuple(d for d in x.shape if d != ONE)
    else:
        axes = [a % n for a in axes]
        shape = tuple(d for k, d in enumerate(x.shape) if k not in axes)
    return [Info(shape, x.value)]


def _unsqueeze(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    axes = axes_from(node, ins, 1)
    if x.shape is None or axes is None:
        return [Info(None, x.value)]
    n = len(x.shape) + len(axes)
    dims = list(x.shape)
    for a in sorted(a % n for a in axes):
        dims.insert(a, ONE)
    return [Info(tuple(dims), x.value)]


def _concat(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    shapes = [i.shape for i in ins]
    if any(s is None for s in shapes):
        return [Info(None)]
    axis = node_attr(node, "axis", 0) % len(shapes[0])
    dims = list(shapes[0])
    sizes = [s[axis] for s in shapes]
    dims[axis] = Dim(sum(int(d) for d in sizes)) if all(d is not None and d.is_int for d in sizes) else None
    value = None
    if all(i.value is not None for i in ins) and len(shapes[0]) <= 1:
        value = tuple(v for i in ins for v in i.value)  # type: ignore[union-attr]
    return [Info(tuple(dims), value)]


def _gather(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    idx = ins[1]
    axis = node_attr(node, "axis", 0)
    shape = None
    if x.shape is not None and idx.shape is not None:
        axis %= len(x.shape)
        shape = tuple(x.shape[:axis]) + tuple(idx.shape) + tuple(x.shape[axis + 1 :])
    value = None
    indices = int_values(idx)
    if x.value is not None and indices is not None and x.shape is not None and len(x.shape) == 1:
        n = len(x.value)
        value = tuple(x.value[i % n] for i in indices)
    return [Info(shape, value)]


def _slice(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    starts, ends = int_values(ins[1]), int_values(ins[2])
    axes = int_values(ins[3]) if len(ins) > 3 and ins[3].shape is not None else None
    steps = int_values(ins[4]) if len(ins) > 4 and ins[4].shape is not None else None
    if x.shape is None or starts is None or ends is None:
        return [UNKNOWN]
    n = len(x.shape)
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    dims = list(x.shape)
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        dims[a % n] = _slice_len(dims[a % n], s, e, st)
    value = None
    if x.value is not None and n == 1 and len(starts) == 1:
        value = tuple(x.value[slice(starts[0], None if ends[0] >= INT_MAX else ends[0], steps[0])])
    return [Info(tuple(dims), value)]


def _transpose(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    if x.shape is None:
        return [UNKNOWN]
    perm = node_attr(node, "perm", None) or list(range(len(x.shape)))[::-1]
    return [Info(tuple(x.shape[p] for p in perm))]


def _reshape(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    shape = reshape_dims(x.shape, ins[1].value, bool(node_attr(node, "allowzero", 0)))
    return [Info(shape, x.value)]  # a reshaped shape vector keeps its elements (TorchScript)


def _expand(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    target = ins[1].value
    if target is None or x.shape is None:
        return [UNKNOWN]
    return [Info(broadcast(x.shape, target))]


def _matmul(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    a, b = ins[0].shape, ins[1].shape
    if a is None or b is None:
        return [UNKNOWN]
    if node.op_type == "Gemm":
        m = a[1] if node_attr(node, "transA", 0) else a[0]
        n = b[0] if node_attr(node, "transB", 0) else b[1]
        return [Info((m, n))]
    if len(a) == 1 or len(b) == 1:
        return [UNKNOWN]
    batch = broadcast(a[:-2], b[:-2])
    return [Info(None if batch is None else tuple(batch) + (a[-2], b[-1]))]


def _reduce(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    axes = axes_from(node, ins, 1)
    if x.shape is None or axes is None:
        return [UNKNOWN]
    keep = bool(node_attr(node, "keepdims", 1))
    axes = [a % len(x.shape) for a in axes] or list(range(len(x.shape)))
    return [Info(tuple(ONE if k in axes else d for k, d in enumerate(x.shape) if keep or k not in axes))]


def _constant_of_shape(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    return [Info(x.value, _filled(node, x.value))]


def _range(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    return [Info((None,))]  # one axis of a length the interpreter does not follow


def _split(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    count = len(node.outputs)
    if x.shape is None:
        return [UNKNOWN] * count
    axis = node_attr(node, "axis", 0) % len(x.shape)
    sizes = int_values(ins[1]) if len(ins) > 1 and node.inputs[1] is not None else None
    if sizes is None:
        dim = x.shape[axis]
        if dim is None or not dim.is_int or int(dim) % count:
            return [UNKNOWN] * count
        sizes = [int(dim) // count] * count
    return [Info(x.shape[:axis] + (Dim(s),) + x.shape[axis + 1 :]) for s in sizes]


def _tile(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    """Followed for TorchScript's repeat_interleave."""
    repeats = ins[1].value if len(ins) > 1 else None
    if x.shape is None or repeats is None or len(repeats) != len(x.shape):
        return [UNKNOWN]
    dims = zip(x.shape, repeats, strict=True)
    return [Info(tuple(None if d is None or r is None else d * r for d, r in dims))]


def _matmul_nbits(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    """y = x @ W[K, N]."""
    n = int(node_attr(node, "N", 0))
    return [Info(x.shape[:-1] + (Dim(n),) if x.shape is not None and n > 0 else None)]


def _attention(node: ir.Node, x: Info, ins: Sequence[Info]) -> list[Info]:
    return attention_op(node, ins)


ONNX, MICROSOFT = "", "com.microsoft"
ANY_DOMAIN = "*"

# The rules, keyed by (domain, op type); "ai.onnx" is looked up as "".
RULES: dict[tuple[str, str], Rule] = {
    (ONNX, "Shape"): _shape,
    (ONNX, "Size"): _size,
    (ONNX, "Constant"): _constant,
    **{(ONNX, op): _same_shape for op in SAME_SHAPE},
    **{(ONNX, op): _keeps_value for op in KEEPS_VALUE},
    **{(ONNX, op): _elementwise for op in ELEMENTWISE},
    (ONNX, "Where"): _where,
    (ONNX, "Squeeze"): _squeeze,
    (ONNX, "Unsqueeze"): _unsqueeze,
    (ONNX, "Concat"): _concat,
    (ONNX, "Gather"): _gather,
    (ONNX, "Slice"): _slice,
    (ONNX, "Transpose"): _transpose,
    (ONNX, "Reshape"): _reshape,
    (ONNX, "Expand"): _expand,
    (ONNX, "MatMul"): _matmul,
    (ONNX, "Gemm"): _matmul,
    **{(ONNX, op): _reduce for op in REDUCE},
    (ONNX, "ConstantOfShape"): _constant_of_shape,
    (ONNX, "Range"): _range,
    (ONNX, "Split"): _split,
    (ONNX, "Tile"): _tile,
    (MICROSOFT, "MatMulNBits"): _matmul_nbits,
    **{(domain, op): _attention for op in ATTENTION_OPS for domain in (ONNX, MICROSOFT)},
    (ANY_DOMAIN, "RotaryEmbedding"): _same_shape,  # the opset-23 op, ONNX Runtime's and other rewriters'
}


def infer_node(node: ir.Node, ins: Sequence[Info]) -> list[Info] | None:
    """Output infos of `node` from its input infos, or None for an op the interpreter does not know."""
    domain = ONNX if node.domain == "ai.onnx" else node.domain
    rule = RULES.get((domain, node.op_type)) or RULES.get((ANY_DOMAIN, node.op_type))
    return None if rule is None else rule(node, ins[0] if ins else UNKNOWN, ins)


def attention_op(node: ir.Node, ins: Sequence[Info], heads: int = 0, kv_heads: int = 0) -> list[Info]:
    """Output shapes of a fused attention op (opset-23 Attention, ORT GroupQueryAttention or
    MultiHeadAttention) with `heads`/`kv_heads` query/KV heads (default: its attributes)."""
    op = node.op_type
    heads = heads or int(node_attr(node, "q_num_heads" if op == "Attention" else "num_heads", 0))
    kv_heads = kv_heads or int(node_attr(node, "kv_num_heads", 0)) or heads
    unknown = [UNKNOWN] * len(node.outputs)
    q = ins[0].shape if ins else None
    if q is None or heads <= 0:
        return unknown
    v = ins[2].shape if len(ins) > 2 and node.inputs[2] is not None else None
    if len(q) == 4:  # [b, heads, s, hd]
        y: Dims = (q[0], Dim(heads), q[2], v[3] if v is not None and len(v) == 4 else q[3])
        hd = q[3]
    elif len(q) == 3 and q[2] is not None and q[2].is_int:
        packed = v is None and op == "GroupQueryAttention"
        hd_int = int(q[2]) // (heads + 2 * kv_heads) if packed else int(q[2]) // heads
        hd_v = (
            int(v[2]) // kv_heads
            if v is not None and v[2] is not None and v[2].is_int and op != "MultiHeadAttention"
            else hd_int
        )
        y, hd = (q[0], q[1], Dim(heads * hd_v)), Dim(hd_int)
    else:
        return unknown
    present = Info((q[0], Dim(kv_heads), None, hd))
    return [Info(y), *[present] * (len(node.outputs) - 1)][: len(node.outputs)]


def contraction_dims(node: ir.Node, a: Dims | None, b: Dims | None) -> tuple[MaybeDim, MaybeDim]:
    if a is None or b is None:
        return None, None
    if node.op_type == "Gemm":
        return (a[0] if node_attr(node, "transA", 0) else a[1]), (
            b[1] if node_attr(node, "transB", 0) else b[0]
        )
    return a[-1], (b[0] if len(b) == 1 else b[-2])


class World:
    """Shapes and small values of every tensor of a graph, as the single-device model computes them."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.infos: dict[ir.Value, Info] = {}
        for value in graph.inputs:
            self.infos[value] = Info(dims_from_ir(value.shape))
        for value in graph.initializers.values():
            if value.const_value is not None:
                self.infos[value] = info_from_tensor(value.const_value)

    def get(self, value: ir.Value | None) -> Info:
        if value is None:
            return UNKNOWN
        info = self.infos.get(value)
        return info if info is not None else Info(dims_from_ir(value.shape))

    def run(self) -> World:
        for node in self.graph:
            ins = [self.get(v) for v in node.inputs]
            try:
                outs = infer_node(node, ins)
            except (ValueError, IndexError, ArithmeticError):
                # Input shapes its rule cannot reconcile (a graph that would fail at run time, or one the
                # interpreter misreads): unknown outputs, as for an op without a rule. Readers of the world
                # (the recognizers) then refuse what they cannot see, instead of crashing on the graph.
                outs = None
            for k, out in enumerate(node.outputs):
                computed = outs[k] if outs is not None and k < len(outs) else UNKNOWN
                self.infos[out] = _prefer(computed, dims_from_ir(out.shape))
        return self




def graph_shapes(graph: ir.Graph) -> World:
    """The symbolic shapes of `graph`, computed once per graph and node count (kept in the graph's own
    metadata, so they go when the graph goes)."""
    cached = graph.meta.get(SHAPES_CACHE)
    if cached is None or cached[0] != len(graph):
        cached = (len(graph), World(graph).run())
        graph.meta[SHAPES_CACHE] = cached
    return cached[1]


def _prefer(computed: Info, annotated: Dims | None) -> Info:
    """The computed shape where it is known, else the exporter's annotation (dim by dim)."""
    shape = computed.shape
    if shape is None:
        shape = annotated
    elif annotated is not None and len(annotated) == len(shape):
        shape = tuple(c if c is not None else a for c, a in zip(shape, annotated, strict=True))
    return Info(shape, computed.value)
