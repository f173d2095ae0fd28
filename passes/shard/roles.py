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

A parallel group of blocks (passes/parallel.py, the model map's ParallelSum) is one `TpParallelGroup`: its
members' branches are sharded like any other, but the group needs two all-reduces, not two per member: one
of its members' stacked attention outputs and one of the sum of its FFN outputs (passes.shard.rewrite).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from passes.errors import UserError
from passes.matching import NoMatch
from passes.model_map import (
    LmHead,
    ParallelSum,
    ResidualBranch,
    Stream,
    find_embedding,
    find_lm_head,
    layer_name,
    walk_stream,
)
from passes.patterns.attention import (
    Attention,
    before_projection,
    cache_concats,
    end_projection,
    match_attention,
)
from passes.patterns.linear import WeightRef, weight_ref
from passes.shapes import World

FUSED_ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "AttentionPlugin"}


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
    group: int | None = None  # position in TpStructure.groups when the branch is a parallel group member's

    def describe(self) -> str:
        layer = layer_name(self.row.node)
        where = f" ({layer})" if layer else ""
        return f"residual branch {self.index} [{self.kind}]{where}"


@dataclass
class TpParallelGroup:
    """A parallel group of blocks: y = x + sum_k a_k + sum_k f_k. Under TP each a_k and f_k is a partial sum
    over ranks, so the group reduces its attention outputs a_k together (stacked) and the local sum of its
    f_k once: the all-reduce of a sum is the sum of the all-reduces."""

    number: int
    attention: list[Branch]  # the members' attention branches, in block order
    ffn_sum: ir.Value  # f_1 + ... + f_n, read by the group's residual add

    @property
    def hidden(self) -> int:
        """The stream width: each attention output's last dim (its o_proj weight's output dim)."""
        return self.attention[0].row.matrix_shape()[1]


@dataclass
class TpStructure:
    embedding: ir.Node
    branches: list[Branch]
    lm_head: WeightRef | None
    groups: list[TpParallelGroup] = field(default_factory=list)

    @property
    def allreduces(self) -> int:
        """All-reduces per forward pass: one per branch outside parallel groups, two per group."""
        return sum(b.group is None for b in self.branches) + 2 * len(self.groups)

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
    groups = [_group(k, group, branches) for k, group in enumerate(stream.parallel)]
    head = find_lm_head(model, stream)
    _refuse_linears_outside(graph, stream, head)
    return TpStructure(embedding.node, branches, weight_ref(head.node) if head is not None else None, groups)


def _group(number: int, source: ParallelSum, branches: list[Branch]) -> TpParallelGroup:
    """The members' branches of a parallel group, checked for the two all-reduces: every f_k is its down
    projection's output (a bias after it would be summed over ranks) read only by the group's sum."""
    attention = [branches[b.index] for b in source.attention]
    ffns = [branches[b.index] for b in source.ffns]
    group = TpParallelGroup(number, attention, source.ffn_sum)
    sums = _sum_nodes(source.ffn_sum)
    for branch, member in zip(ffns, source.ffns, strict=True):
        if branch.row.node.outputs[0] is not member.output:
            raise UserError(
                f"{branch.describe()}: a parallel group member's FFN adds something after its last "
                "projection (a bias?); its all-reduce cannot be shared with the group; shard the model "
                "before parallelizing blocks, or export without the FFN bias"
            )
        if any(use.node not in sums for use in member.output.uses()):
            raise UserError(f"{branch.describe()}: its output is read outside the parallel group's FFN sum")
    for branch in (*attention, *ffns):
        branch.group = number
    if len({b.row.matrix_shape()[1] for b in attention}) != 1:
        raise UserError(f"parallel group {number}: its attention outputs differ in width")
    return group


def _sum_nodes(value: ir.Value) -> set[ir.Node]:
    """The Add nodes of a sum of branch outputs (passes/parallel.py writes it as a chain of Adds)."""
    node = value.producer()
    if node is None or node.op_type != "Add":
        return set()
    return {node}.union(*(_sum_nodes(v) for v in node.inputs if v is not None))


def _refuse_linears_outside(graph: ir.Graph, stream: Stream, head: LmHead | None) -> None:
    """Every linear layer with a constant weight is in a residual branch or is the lm_head (found from the
    logits); one elsewhere means the stream walk stopped early, and sharding would leave it whole."""
    known = set().union(*(b.nodes for b in stream.branches), [head.node] if head is not None else [])
    unknown = [n for n in graph if n not in known and weight_ref(n) is not None]
    if unknown:
        names = ", ".join(repr(n.name) for n in unknown[:3])
        end = stream.branches[-1].residual.node
        raise UserError(
            f"the residual stream walk ended at {end.name!r} after {len(stream.branches)} branches, but "
            f"linear layer(s) {names} are in none of them and are not the lm_head: a branch there does not "
            "end in a linear layer added to the stream; cannot shard it"
        )


def _refuse_block_quantized(graph: ir.Graph) -> None:
    """MatMulNBits (ONNX Runtime GenAI int4) shards by whole quantization blocks (passes.shard.rewrite);
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
    caches = [CacheRef(c.past, c.node, c.present) for c in cache_concats(nodes)]
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
    for c in record.caches:  # a fused op's past_key/past_value
        if c.past not in known:
            branch.caches.append(CacheRef(c.past, c.node, c.present, c.kind))
    if len(branch.columns) != (1 if record.packed else 3):
        names = ", ".join(repr(c.node.name) for c in branch.columns)
        raise UserError(f"{where}: expected q, k, v projections as its first linear layers, found {names}")
