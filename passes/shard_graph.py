"""Tensor-parallel roles of a Llama-family graph, recognized by structure (passes.shard uses them).

The residual branches come from the model map's stream walk (passes.model_map.walk_stream: every branch
in stream order, with its kind and its body from passes.patterns.attention.branch_nodes); this module
only gives each branch its parallel roles. In a branch, the first linear layers (those reading the
normalized stream, not the output of another linear layer) are column-parallel, the last one is
row-parallel and gets the all-reduce. An attention branch's q/k/v (or packed qkv), heads, KV heads and
caches come from the attention recognizer (passes.patterns.attention). A "linear" branch (one projection,
e.g. a Nemotron-NAS replace_with_linear attention or FFN) is row-parallel alone: each rank multiplies its
share of the replicated input's features by its rows of the weight, and the all-reduce sums the shares.
Anything else is an FFN (SwiGLU, or any branch of equal-width column layers: FP8 Q/DQ, a fused wide FFN).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from passes.errors import UserError
from passes.graph import NoMatch
from passes.model_map import ResidualBranch, find_embedding, layer_name, walk_stream
from passes.patterns.attention import Attention, before_projection, end_projection, match_attention
from passes.shapes import World

WEIGHT_CHAIN_OPS = ("Transpose", "Cast", "Identity", "DequantizeLinear")
LINEAR_OPS = ("MatMul", "Gemm")
FUSED_ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "AttentionPlugin"}


@dataclass
class WeightRef:
    """The constant behind a linear layer's weight input, and the nodes between them."""

    node: ir.Node  # the MatMul/Gemm
    value: ir.Value  # its weight input
    source: ir.Value  # the initializer (or Constant output)
    chain: list[ir.Node]  # from the source to `value`, in data order
    transposed: bool = False  # Gemm transB=1: the weight input is [out, in]
    nbits: bool = False  # MatMulNBits: the source is [N, K / block_size, blob] with scales per block

    @property
    def tensor(self) -> ir.TensorProtocol:
        return constant_tensor(self.source)

    def matrix_shape(self) -> tuple[int, int]:
        """(in, out) of the weight as the layer multiplies by it."""
        if self.nbits:
            return _int_attr(self.node, "K", 0), _int_attr(self.node, "N", 0)
        dims = [int(d) for d in self.value.shape] if self.value.shape is not None else None
        if dims is None or len(dims) != 2:
            dims = list(_shape_through_chain(self))
        rows, cols = dims
        return (cols, rows) if self.transposed else (rows, cols)

    def source_axis(self, matmul_axis: int) -> int:
        """The axis of the source tensor that is the layer's input (0) or output (1) axis."""
        axis = 1 - matmul_axis if self.transposed else matmul_axis
        for node in reversed(self.chain):
            if node.op_type == "Transpose":
                perm = _perm(node)
                axis = perm[axis]
        return axis


def _perm(node: ir.Node) -> list[int]:
    attr = node.attributes.get("perm")
    return [int(p) for p in attr.value] if attr is not None else [1, 0]


def _shape_through_chain(ref: WeightRef) -> tuple[int, int]:
    dims = [int(d) for d in ref.tensor.shape]
    for node in ref.chain:
        if node.op_type == "Transpose":
            perm = _perm(node)
            dims = [dims[p] for p in perm]
    return dims[0], dims[1]


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:
        return value.const_value
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        attr = node.attributes["value"]
        if attr.type == ir.AttributeType.TENSOR:
            return attr.value
    return None


def weight_ref(node: ir.Node) -> WeightRef | None:
    """The constant 2-D weight of a MatMul/Gemm (or the block-quantized weight of a MatMulNBits), or None
    when its weight input is computed."""
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        tensor = constant_tensor(weight)
        if weight is None or tensor is None or len(tensor.shape) != 3:
            return None
        return WeightRef(node, weight, weight, [], nbits=True)
    if node.op_type not in LINEAR_OPS or len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    transposed = False
    if node.op_type == "Gemm":
        if _int_attr(node, "transA", 0):
            return None
        transposed = bool(_int_attr(node, "transB", 0))
    value = node.inputs[1]
    chain: list[ir.Node] = []
    current = value
    while constant_tensor(current) is None:
        producer = current.producer()
        if (
            producer is None
            or producer.op_type not in WEIGHT_CHAIN_OPS
            or producer.domain not in ("", "ai.onnx")
        ):
            return None
        chain.append(producer)
        current = producer.inputs[0]
    tensor = constant_tensor(current)
    if tensor is None or len(tensor.shape) != 2:
        return None
    return WeightRef(node, value, current, chain[::-1], transposed)


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


@dataclass
class CacheRef:
    """A KV-cache graph input concatenated with a branch's new keys or values (decode graphs)."""

    past: ir.Value  # the graph input
    concat: ir.Node  # Concat(past, new) inside the branch
    present: ir.Value | None  # the Concat's output when it is a graph output
    kind: str = ""  # "key" (reaches q @ k^T) or "value" (reaches probs @ v)


@dataclass
class Branch:
    """One residual branch: stream -> norm -> column layers -> ... -> row layer -> Add(stream, .)."""

    index: int
    kind: str  # "attention", "ffn" or "linear" (one row-parallel projection, no columns)
    stream: ir.Value
    residual: ir.Node
    row: WeightRef
    columns: list[WeightRef]
    nodes: set[ir.Node] = field(default_factory=set)
    # attention
    q: WeightRef | None = None
    k: WeightRef | None = None
    v: WeightRef | None = None
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    caches: list[CacheRef] = field(default_factory=list)  # decode graphs: past K/V inputs
    attention: Attention | None = None  # the recognizer's record
    offsets: tuple[int, ...] = ()  # a packed qkv weight: first column of q, k and v

    @property
    def packed(self) -> bool:
        return bool(self.offsets)

    # ffn
    width: int = 0

    def describe(self) -> str:
        layer = layer_name(self.row.node)
        where = f" ({layer})" if layer else ""
        return f"residual branch {self.index} [{self.kind}]{where}"


@dataclass
class TpStructure:
    embedding: ir.Node
    branches: list[Branch]
    lm_head: WeightRef | None

    @property
    def attention(self) -> list[Branch]:
        return [b for b in self.branches if b.kind == "attention"]

    @property
    def ffns(self) -> list[Branch]:
        return [b for b in self.branches if b.kind == "ffn"]

    def branch_of(self) -> dict[ir.Node, Branch]:
        return {node: b for b in self.branches for node in b.nodes}


def find_structure(model: ir.Model, world: World | None = None) -> TpStructure:
    """The parallel roles of every residual branch (from the model map's stream walk); UserError when the
    graph is not a decoder the pass can shard."""
    graph = model.graph
    _refuse_block_quantized(graph)
    order = {node: i for i, node in enumerate(graph)}
    embedding = find_embedding(graph)
    if embedding is None:
        raise UserError("no token embedding found: expected Gather(embedding weight, input_ids)")
    stream = walk_stream(model)
    if not stream.branches:
        raise UserError(
            "no residual branches found after the token embedding (expected Add(stream, MatMul(...)))"
        )
    branches = [_branch(b, order) for b in stream.branches]
    end = _stream_end(stream.branches[-1])
    head, after = _lm_head(graph, end)
    if len(after) > 1:
        names = ", ".join(repr(n.name) for n in after[:3])
        raise UserError(
            f"the residual stream walk stopped at {end.name!r} after {len(branches)} branches, but more "
            f"linear layers follow ({names}); a branch there does not end in a linear layer added to the "
            "stream"
        )
    return TpStructure(embedding.node, branches, head)


def _stream_end(last: ResidualBranch) -> ir.Value:
    """The stream after the last branch (a final Skip*Normalization: its normalized output)."""
    out = last.residual.output
    return out if out is not None and out.uses() else last.residual.node.outputs[0]


def _refuse_block_quantized(graph: ir.Graph) -> None:
    """MatMulNBits (ONNX Runtime GenAI int4) shards by whole quantization blocks (passes.shard_rewrite);
    explicit zero points (packed two blocks per byte) and g_idx are not handled."""
    for node in graph:
        if node.op_type != "MatMulNBits":
            continue
        extra = [
            name
            for slot, name in ((3, "zero points"), (4, "g_idx"))
            if len(node.inputs) > slot and node.inputs[slot] is not None
        ]
        if extra:
            raise UserError(
                f"MatMulNBits {node.name!r}: block-quantized weights with {extra[0]} cannot be "
                "tensor-parallel sharded yet; quantize without zero points, or shard the fp32 export"
            )


def _branch(source: ResidualBranch, order: dict[ir.Node, int]) -> Branch:
    index, stream, residual = source.index, source.start, source.residual.node
    row_node = end_projection(source.output, set(source.nodes))
    row = weight_ref(row_node) if row_node is not None else None
    if row is None:
        raise UserError(
            f"residual branch {index} does not end in a linear layer with a constant weight; cannot shard it"
        )
    nodes = before_projection(set(source.nodes), row_node)
    if not any(v is stream or (v is not None and v.producer() in nodes) for v in row_node.inputs[:1]):
        raise UserError(f"residual branch {index}: its last projection does not depend on the stream")
    inputs = {v for n in nodes for v in n.inputs if v is not None and v.is_graph_input()}
    caches = _cache_inputs(inputs, nodes, _graph_outputs(residual))
    fused_inputs = {v for n in nodes if n.op_type in FUSED_ATTENTION_OPS for v in n.inputs}
    other = sorted(v.name for v in inputs - {c.past for c in caches} - fused_inputs)
    if other:
        raise UserError(
            f"residual branch {index} reads the graph input {other[0]!r}, which is not a KV cache "
            "(a graph input used, besides Shape, only by a Concat with the branch's new keys or values); "
            "cannot shard it"
        )
    plugin = sorted({n.op_type for n in nodes} & {"AttentionPlugin"})
    if plugin:
        raise UserError(f"residual branch {index}: the TensorRT {plugin[0]} op cannot be sharded")
    linears = sorted((n for n in nodes if weight_ref(n) is not None), key=order.__getitem__)
    after = _after_linear(nodes, order)
    columns = [weight_ref(n) for n in linears if not any(_is_after(v, after) for v in n.inputs[:1])]
    inner = [n for n in linears if any(_is_after(v, after) for v in n.inputs[:1])]
    if inner:
        raise UserError(
            f"residual branch {index}: linear layer {inner[0].name!r} sits between the branch's "
            "first and last projections; only column -> row branches can be sharded"
        )
    biased = [
        r.node
        for r in [*columns, row]
        if r.node.op_type == "Gemm" and len(r.node.inputs) > 2 and r.node.inputs[2] is not None
    ]
    if biased:
        raise UserError(
            f"residual branch {index}: Gemm {biased[0].name!r} has a bias, which sharding does not "
            "handle yet (export the projection as MatMul [+ Add])"
        )
    if source.kind == "linear":
        return _linear_branch(index, stream, residual, row, nodes, caches)
    if not columns:
        raise UserError(f"residual branch {index}: no column projections found before {row_node.name!r}")
    branch = Branch(index, "ffn", stream, residual, row, columns, nodes)  # type: ignore[arg-type]
    branch.caches = caches
    if source.kind == "attention":
        branch.kind = "attention"
        _attention_roles(branch, source.output)
    else:
        if caches:
            raise UserError(
                f"{branch.describe()}: reads the cache input {caches[0].past.name!r} but has no "
                "attention (Softmax); cannot shard it"
            )
        widths = {c.matrix_shape()[1] for c in branch.columns}
        if len(widths) != 1:
            raise UserError(f"{branch.describe()}: its column projections differ in width {sorted(widths)}")
        branch.width = widths.pop()
        if branch.row.matrix_shape()[0] != branch.width:
            raise UserError(
                f"{branch.describe()}: last projection has {branch.row.matrix_shape()[0]} inputs, "
                f"the first ones {branch.width} outputs"
            )
    return branch


def _linear_branch(
    index: int, stream: ir.Value, residual: ir.Node, row: WeightRef, nodes: set[ir.Node], caches: list
) -> Branch:
    """A one-projection branch: row-parallel over its input features (`width`), no column layers."""
    branch = Branch(index, "linear", stream, residual, row, [], nodes, width=row.matrix_shape()[0])
    if caches:
        raise UserError(f"{branch.describe()}: reads the cache input {caches[0].past.name!r}; cannot shard")
    return branch


def _graph_outputs(node: ir.Node) -> set[ir.Value]:
    graph = node.graph
    return set(graph.outputs) if graph is not None else set()


def _cache_inputs(inputs: set[ir.Value], nodes: set[ir.Node], outputs: set[ir.Value]) -> list[CacheRef]:
    """The graph inputs among `inputs` that are KV caches: used once, by a Concat in the branch that also
    takes a tensor the branch computes (the new keys/values), and otherwise only by Shape nodes (the
    dynamo exporter may take the batch size from a past input). The Concat's axis is checked by the rank
    world (it must not be the sharded head axis)."""
    found = []
    for value in sorted(inputs, key=lambda v: v.name or ""):
        uses = [u for u in value.uses() if u.node.op_type != "Shape"]  # an exporter may read its batch
        if len(uses) != 1 or uses[0].node not in nodes or uses[0].node.op_type != "Concat":
            continue
        concat = uses[0].node
        computed = [v for v in concat.inputs if v is not None and v.producer() in nodes]
        if not computed:
            continue
        out = concat.outputs[0]
        found.append(CacheRef(value, concat, out if out in outputs else None))
    return found


def _after_linear(nodes: set[ir.Node], order: dict[ir.Node, int]) -> set[ir.Value]:
    """Values of the branch computed from the output of some linear layer of the branch."""
    after: set[ir.Value] = set()
    for node in sorted(nodes, key=order.__getitem__):
        if weight_ref(node) is not None or any(v in after for v in node.inputs if v is not None):
            after.update(node.outputs)
    return after


def _is_after(value: ir.Value | None, after: set[ir.Value]) -> bool:
    return value is not None and value in after


def _attention_roles(branch: Branch, output: ir.Value) -> None:
    """q/k/v, heads and cache roles from the attention recognizer (passes.patterns.attention)."""
    where = branch.describe()
    try:
        record = match_attention(output, branch.stream)
    except NoMatch as exc:
        raise UserError(f"{where}: {exc}") from None
    refs = {id(c.node): c for c in branch.columns}
    missing = [p for p in (record.q, record.k, record.v) if id(p.node) not in refs]
    if missing:
        name = missing[0].node.name
        raise UserError(f"{where}: projection {name!r} has no constant weight; cannot shard it")
    branch.attention = record
    branch.q, branch.k, branch.v = (refs[id(p.node)] for p in (record.q, record.k, record.v))
    branch.heads, branch.kv_heads, branch.head_dim = record.heads, record.kv_heads, record.head_dim
    if record.packed:
        branch.offsets = tuple(p.columns[0] for p in (record.q, record.k, record.v))  # type: ignore[index]
    kinds = {c.past: c.kind for c in record.caches}
    for cache in branch.caches:
        cache.kind = kinds.get(cache.past, "")
    known = {c.past for c in branch.caches}
    outputs = _graph_outputs(branch.residual)
    for c in record.caches:  # a fused op's past_key/past_value
        if c.past not in known:
            present = c.present if c.present in outputs else None
            branch.caches.append(CacheRef(c.past, c.node, present, c.kind))
    if len(branch.columns) != (1 if record.packed else 3):
        names = ", ".join(repr(c.node.name) for c in branch.columns)
        raise UserError(f"{where}: expected q, k, v projections as its first linear layers, found {names}")


def _lm_head(graph: ir.Graph, stream: ir.Value) -> tuple[WeightRef | None, list[ir.Node]]:
    """The linear layer after the final norm whose output reaches a graph output, and all first linear
    layers downstream of the stream's end (just the lm_head, unless the walk stopped early)."""
    outputs = set(graph.outputs)
    seen: set[ir.Value] = set()
    stack = [stream]
    found: list[ir.Node] = []
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for use in value.uses():
            if weight_ref(use.node) is not None and use.idx == 0:
                found.append(use.node)
            else:
                stack.extend(use.node.outputs)
    heads = [n for n in found if _reaches(n.outputs[0], outputs)]
    return (weight_ref(heads[0]) if len(heads) == 1 else None), list(dict.fromkeys(found))


def _reaches(value: ir.Value, outputs: set[ir.Value]) -> bool:
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in outputs:
            return True
        if v in seen:
            continue
        seen.add(v)
        for use in v.uses():
            stack.extend(use.node.outputs)
    return False
