"""Attention sub-blocks in every form the exporters emit, as one typed record (docs/tensor_parallel.md).

    record = match_attention(output, start)      # Attention, or raises NoMatch saying why

`output` is the value the attention branch adds to the residual stream (the o_proj output, or a bias
Add after it); `start` is the value the branch reads (the residual stream, or the normalized stream for
Skip*Normalization graphs). The branch body is every node upstream of `output` that depends on `start`.

Forms (docs/tensor_parallel.md, "Attention forms"):

- decomposed: q @ k^T -> [scale] -> [+ mask | Where(mask, ., -inf)] -> Softmax -> [IsNaN -> Where guard]
  -> probs @ v, with GQA by Expand/Reshape, repeat_interleave or a grouped q view; rotary as
  Mul/Neg/Concat (rotate_half) or the RotaryEmbedding op; q/k/v as three projections or one packed
  qkv projection split by Split/Slice on the last axis;
- fused: ONNX opset-23 `Attention`, ORT contrib `GroupQueryAttention` (packed or separate QKV) and
  `MultiHeadAttention`.

Projections are MatMul/Gemm with a constant weight (behind Transpose/Cast/Identity/DequantizeLinear) or
ORT's MatMulNBits. A KV cache is a graph input that the branch concatenates with its new keys/values
(decomposed) or passes to the fused op as past_key/past_value. The record knows nothing of sharding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from itertools import accumulate

import onnx_ir as ir

from passes.matching import NoMatch, attr, constant
from passes.patterns.linear import is_linear, linear_shape
from passes.shapes import World, align, graph_shapes, product

FUSED_OPS = ("Attention", "GroupQueryAttention", "MultiHeadAttention")
# Ops a projection output may pass through before the Reshape that splits it into heads.
_PASS_OPS = ("Add", "Mul", "Cast", "Identity", "QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class Projection:
    """A linear layer, or a column range [start, stop) of a packed qkv layer's outputs."""

    node: ir.Node  # MatMul, Gemm or MatMulNBits
    columns: tuple[int, int] | None = None

    @property
    def out_features(self) -> int:
        if self.columns is not None:
            return self.columns[1] - self.columns[0]
        return linear_shape(self.node)[1]


@dataclass(frozen=True)
class Cache:
    """A KV-cache graph input of the branch and the present output it becomes (when one is)."""

    past: ir.Value
    present: ir.Value | None
    kind: str  # "key" or "value" ("" from cache_concats, before the recognizer knows which)
    node: ir.Node  # the Concat(past, new) of a decomposed branch, or the fused op


@dataclass(frozen=True)
class Attention:
    form: str  # "decomposed", "Attention", "GroupQueryAttention" or "MultiHeadAttention"
    q: Projection
    k: Projection
    v: Projection
    o_proj: ir.Node
    heads: int
    kv_heads: int
    head_dim: int
    mask: str  # "additive", "where", "causal" (an op attribute), "op" (the op's own inputs) or "none"
    rotary: str  # "decomposed", "RotaryEmbedding", "op" (GroupQueryAttention do_rotary) or "none"
    caches: tuple[Cache, ...]
    core: ir.Node  # the Softmax of a decomposed branch, or the fused op
    nan_guard: bool  # Optimum's IsNaN -> Where after the Softmax
    nodes: frozenset[ir.Node]  # the branch body

    @property
    def packed(self) -> bool:
        return self.q.node is self.k.node

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


# ------------------------------------------------------------------------------------------ branch body


def branch_nodes(output: ir.Value, start: ir.Value) -> set[ir.Node]:
    """Nodes upstream of `output` that depend on `start` (the branch body), not crossing `start`."""
    seen: set[ir.Node] = set()
    stack = [output]
    while stack:
        value = stack.pop()
        if value is None or value is start:
            continue
        node = value.producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(node.inputs)
    graph = output.graph
    order = {node: i for i, node in enumerate(graph)} if graph is not None else {}
    depends: set[ir.Node] = set()
    for node in sorted(seen, key=lambda n: order.get(n, 0)):
        if any(v is start or (v is not None and v.producer() in depends) for v in node.inputs):
            depends.add(node)
    return depends


def end_projection(output: ir.Value | None, nodes: set[ir.Node] | None = None) -> ir.Node | None:
    """The linear layer behind a branch's `output` (through Cast/Identity and a constant bias Add: the
    o_proj, down_proj or a Linear branch's one projection); None when the branch ends otherwise.
    With `nodes`, the walk stays inside that branch body."""
    node = output.producer() if output is not None else None
    while node is not None and (nodes is None or node in nodes) and not is_linear(node):
        if node.op_type not in ("Cast", "Identity", "Add"):
            break
        data = [v for v in node.inputs[:2] if v is not None and constant(v) is None]
        if len(data) != 1:
            break
        node = data[0].producer()
    inside = node is not None and (nodes is None or node in nodes)
    return node if inside and is_linear(node) else None


def before_projection(nodes: set[ir.Node], projection: ir.Node) -> set[ir.Node]:
    """The branch body without its end projection and what follows it (a bias Add, a Cast)."""
    return nodes - {projection} - _downstream_of(projection, nodes)


def _row_projection(output: ir.Value, nodes: set[ir.Node]) -> ir.Node:
    """The o_proj: the linear layer behind `output` (through Cast/Identity and a constant bias Add)."""
    node = end_projection(output, nodes)
    if node is None:
        raise NoMatch("the branch does not end in a linear layer (o_proj)")
    return node


def _forward(start: ir.Value, nodes: set[ir.Node]) -> set[ir.Value]:
    seen: set[ir.Value] = set()
    stack = [start]
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for use in value.uses():
            if use.node in nodes:
                stack.extend(use.node.outputs)
    return seen


def _upstream(value: ir.Value | None, nodes: set[ir.Node], want) -> ir.Node | None:
    """The nearest producer upstream of `value` (inside the body, not through Shape) with want(node)."""
    queue = deque([value])
    seen: set[ir.Node] = set()
    while queue:
        v = queue.popleft()
        node = v.producer() if v is not None else None
        if node is None or node not in nodes or node in seen or node.op_type in ("Shape", "Size"):
            continue
        seen.add(node)
        if want(node):
            return node
        queue.extend(node.inputs)
    return None


def _downstream_matmul(value: ir.Value, nodes: set[ir.Node]) -> ir.Node | None:
    frontier = [value]
    for _ in range(8):
        following = []
        for v in frontier:
            for use in v.uses():
                if use.node not in nodes:
                    continue
                if use.node.op_type == "MatMul" and use.idx == 0:
                    return use.node
                following.extend(use.node.outputs)
        frontier = following
    return None


# ------------------------------------------------------------------------------------------ shapes


def _heads_from_reshape(value: ir.Value, nodes: set[ir.Node], world: World) -> tuple[int, int] | None:
    """(heads, head_dim) from the first Reshape that splits `value`'s last axis into [.., heads, hd]."""
    for _ in range(6):
        uses = [u.node for u in value.uses() if u.node in nodes]
        reshape = next((n for n in uses if n.op_type == "Reshape"), None)
        if reshape is not None:
            full_in, full_out = world.get(reshape.inputs[0]).shape, world.get(reshape.outputs[0]).shape
            groups = align(full_in, full_out) if full_in is not None and full_out is not None else None
            for gi, gj in groups or []:
                if gi == [len(full_in) - 1] and len(gj) >= 2:
                    heads = full_out[gj[0]]
                    rest = product(full_out[k] for k in gj[1:])
                    if heads is not None and heads.is_int and rest is not None and rest.is_int:
                        return int(heads), int(rest)
            return None
        nxt = next((n for n in uses if n.op_type in _PASS_OPS), None)
        if nxt is None:
            return None
        value = nxt.outputs[0]
    return None


def _last_dim(value: ir.Value | None, world: World) -> int | None:
    shape = world.get(value).shape
    if shape and shape[-1] is not None and shape[-1].is_int:
        return int(shape[-1])
    return None


# ------------------------------------------------------------------------------------------ the recognizer


def match_attention(output: ir.Value, start: ir.Value) -> Attention:
    """Recognize the attention branch that produces `output` from `start`; NoMatch says why not."""
    nodes = branch_nodes(output, start)
    o_proj = _row_projection(output, nodes)
    body = before_projection(nodes, o_proj)
    fused = [n for n in body if n.op_type in FUSED_OPS and n.domain in ("", "ai.onnx", "com.microsoft")]
    if len(fused) > 1:
        raise NoMatch(f"{len(fused)} fused attention ops in one branch")
    if fused:
        return _match_fused(fused[0], o_proj, body, nodes)
    return _match_decomposed(o_proj, body, nodes)


def _downstream_of(node: ir.Node, nodes: set[ir.Node]) -> set[ir.Node]:
    values = _forward(node.outputs[0], nodes)
    return {u.node for v in values for u in v.uses() if u.node in nodes}


def _first_linears(body: set[ir.Node]) -> list[ir.Node]:
    linears = [n for n in body if is_linear(n)]
    after: set[ir.Value] = set()
    for node in linears:
        after |= _forward(node.outputs[0], body)
    return [n for n in linears if n.inputs[0] not in after]


def _match_decomposed(o_proj: ir.Node, body: set[ir.Node], nodes: set[ir.Node]) -> Attention:
    softmaxes = [n for n in body if n.op_type == "Softmax"]
    if len(softmaxes) != 1:
        raise NoMatch(f"expected one Softmax or a fused attention op, found {len(softmaxes)} Softmax")
    softmax = softmaxes[0]
    scores = _upstream(softmax.inputs[0], body, lambda n: n.op_type == "MatMul" and not is_linear(n))
    context = _downstream_matmul(softmax.outputs[0], body)
    if scores is None or context is None:
        raise NoMatch("no MatMul(q, k) -> Softmax -> MatMul(probs, v) core found")
    firsts = _first_linears(body)
    q, k, v = _roles(firsts, body, scores.inputs[0], scores.inputs[1], context.inputs[1], scores.outputs[0])
    world = graph_shapes(o_proj.graph)
    found = _heads_from_reshape(_projection_output(q, body), body, world)
    if found is None:
        raise NoMatch("no Reshape splitting the q projection into [.., heads, head_dim] found")
    heads, head_dim = found
    caches = tuple(_decomposed_caches(body, scores, context))
    mask = _mask_form(scores, softmax, body)
    guard = any(u.node.op_type == "IsNaN" for u in softmax.outputs[0].uses())
    return _record(
        "decomposed", q, k, v, o_proj, heads, head_dim, mask, _rotary(body), caches, softmax, guard, nodes
    )


def _record(form, q, k, v, o_proj, heads, head_dim, mask, rotary, caches, core, guard, nodes) -> Attention:
    q_out, kv_out = q.out_features, k.out_features
    if head_dim <= 0 or q_out != heads * head_dim or kv_out % head_dim or v.out_features != kv_out:
        raise NoMatch(
            f"q has {q_out} outputs, k/v {kv_out}/{v.out_features}: not {heads} heads of {head_dim}"
        )
    kv_heads = kv_out // head_dim
    if kv_heads == 0 or heads % kv_heads:
        raise NoMatch(f"{heads} query heads cannot be grouped over {kv_heads} KV heads")
    if linear_shape(o_proj)[0] != q_out:
        raise NoMatch(f"o_proj has {linear_shape(o_proj)[0]} inputs, q {q_out} outputs")
    return Attention(
        form, q, k, v, o_proj, heads, kv_heads, head_dim, mask, rotary, caches, core, guard, frozenset(nodes)
    )


def _projection_output(p: Projection, body: set[ir.Node]) -> ir.Value:
    """The value holding this projection's columns (a packed layer's Split/Slice output)."""
    if p.columns is None:
        return p.node.outputs[0]
    for piece, columns in _pieces(p.node, body):
        if columns == p.columns:
            return piece
    raise NoMatch("packed projection piece not found")


def _roles(
    firsts: list[ir.Node],
    body: set[ir.Node],
    q_in: ir.Value,
    k_in: ir.Value,
    v_in: ir.Value,
    exclude: ir.Value,
) -> tuple[Projection, Projection, Projection]:
    """q, k, v: the first projections (or packed pieces) reaching q @ k^T's operands and probs @ v's v."""
    candidates: list[tuple[Projection, ir.Value]] = []
    for node in firsts:
        pieces = _pieces(node, body) if len(firsts) == 1 else []
        if pieces:
            candidates += [(Projection(node, cols), piece) for piece, cols in pieces]
        else:
            candidates.append((Projection(node), node.outputs[0]))
    reach = [(p, _forward(value, body)) for p, value in candidates]

    def role(target: ir.Value, avoid: ir.Value | None = None) -> Projection:
        hits = [p for p, r in reach if target in r and (avoid is None or avoid not in r)]
        if len(hits) != 1:
            raise NoMatch(f"expected one projection feeding {target.name!r}, found {len(hits)}")
        return hits[0]

    q, k, v = role(q_in), role(k_in), role(v_in, avoid=exclude)
    if len({q, k, v}) != 3:
        raise NoMatch("q, k and v are not three distinct projections")
    return q, k, v


def _pieces(node: ir.Node, body: set[ir.Node]) -> list[tuple[ir.Value, tuple[int, int]]]:
    """A packed projection's output pieces and their column ranges (Split or Slices on the last axis)."""
    total = linear_shape(node)[1]
    value = node.outputs[0]
    for _ in range(3):  # through a bias Add or Cast
        uses = [u.node for u in value.uses() if u.node in body]
        if len(uses) == 1 and uses[0].op_type in ("Add", "Cast", "Identity"):
            value = uses[0].outputs[0]
    uses = [u.node for u in value.uses() if u.node in body]
    split = [n for n in uses if n.op_type == "Split"]
    if len(split) == 1 and int(attr(split[0], "axis", 0)) in (-1, _rank(value) - 1):
        sizes = _split_sizes(split[0], total)
        if sizes is not None:
            bounds = [0, *accumulate(sizes)]
            return [(out, (bounds[i], bounds[i + 1])) for i, out in enumerate(split[0].outputs)]
    slices = [n for n in uses if n.op_type == "Slice"]
    out = []
    for node in slices:
        starts, ends, axes = (constant(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2, 3))
        if starts is None or ends is None or starts.size != 1:
            continue
        axis = int(axes.reshape(-1)[0]) if axes is not None else 0
        if axis not in (-1, _rank(value) - 1):
            continue
        lo, hi = int(starts.reshape(-1)[0]), min(int(ends.reshape(-1)[0]), total)
        out.append((node.outputs[0], (lo % total if lo < 0 else lo, hi % total if hi < 0 else hi)))
    return out if len(out) >= 3 else []


def _rank(value: ir.Value) -> int:
    return value.shape.rank() if value.shape is not None else 3


def _split_sizes(node: ir.Node, total: int) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = constant(node.inputs[1])
        return None if sizes is None else [int(s) for s in sizes.reshape(-1)]
    sizes = attr(node, "split", None)
    if sizes is not None:
        return [int(s) for s in sizes]
    n = len(node.outputs)
    return [total // n] * n if total % n == 0 else None


def _between(start: ir.Value, end: ir.Node, body: set[ir.Node]) -> list[ir.Node]:
    """Nodes on paths from `start` to `end` (the scores' way to the Softmax)."""
    reach = _forward(start, body)
    found, stack, seen = [], [end], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for v in node.inputs:
            if v is not None and v in reach and v.producer() is not None:
                found.append(v.producer())
                stack.append(v.producer())
    return found


def _mask_form(scores: ir.Node, softmax: ir.Node, body: set[ir.Node]) -> str:
    """ "where": the scores pass through a Where (masked_fill); "additive": an Add of a tensor that is not
    computed from the scores (the mask itself may be built with Where, as Optimum does); else "none"."""
    from_scores = _forward(scores.outputs[0], body)
    between = _between(scores.outputs[0], softmax, body)
    if any(n.op_type == "Where" and any(v in from_scores for v in n.inputs[1:]) for n in between):
        return "where"
    for node in between:
        if node.op_type == "Add" and any(
            v is not None and v not in from_scores and constant(v) is None for v in node.inputs
        ):
            return "additive"
    return "none"


def _rotary(body: set[ir.Node]) -> str:
    ops = {n.op_type for n in body}
    if "RotaryEmbedding" in ops:
        return "RotaryEmbedding"
    return "decomposed" if "Neg" in ops and "Concat" in ops else "none"


def cache_concats(body: set[ir.Node]) -> list[Cache]:
    """The KV-cache graph inputs of a decomposed branch body (`kind` not known yet): each used once, besides
    Shape (an exporter may read its batch), by a Concat of the body that also takes a tensor the body
    computes (the new keys or values)."""
    inputs = {v for n in body for v in n.inputs if v is not None and v.is_graph_input()}
    found = []
    for value in sorted(inputs, key=lambda v: v.name or ""):
        uses = [u for u in value.uses() if u.node.op_type != "Shape"]
        if len(uses) != 1 or uses[0].node not in body or uses[0].node.op_type != "Concat":
            continue
        concat = uses[0].node
        if not any(v is not None and v.producer() in body for v in concat.inputs):
            continue
        out = concat.outputs[0]
        found.append(Cache(value, out if out.is_graph_output() else None, "", concat))
    return found


def _decomposed_caches(body: set[ir.Node], scores: ir.Node, context: ir.Node):
    for cache in cache_concats(body):
        reach = _forward(cache.node.outputs[0], body)
        kind = "key" if scores.inputs[1] in reach else "value" if context.inputs[1] in reach else None
        if kind is None:
            raise NoMatch(f"cache input {cache.past.name!r} reaches neither q @ k^T nor probs @ v")
        yield replace(cache, kind=kind)


# ------------------------------------------------------------------------------------------ fused ops


def _match_fused(op: ir.Node, o_proj: ir.Node, body: set[ir.Node], nodes: set[ir.Node]) -> Attention:
    name = op.op_type
    ins = list(op.inputs) + [None] * 10

    def proj_of(value: ir.Value | None) -> ir.Node:
        found = _upstream(value, body, is_linear) if value is not None else None
        if found is None:
            raise NoMatch(f"{name}: no projection feeds input {value.name if value else None!r}")
        return found

    world = graph_shapes(o_proj.graph)
    packed = ins[1] is None or ins[2] is None
    if name == "GroupQueryAttention":
        heads, kv_heads = int(attr(op, "num_heads", 0)), int(attr(op, "kv_num_heads", 0))
    elif name == "MultiHeadAttention":
        heads = kv_heads = int(attr(op, "num_heads", 0))
    else:
        heads, kv_heads = int(attr(op, "q_num_heads", 0)), int(attr(op, "kv_num_heads", 0))
    if packed:
        if name != "GroupQueryAttention":
            raise NoMatch(f"{name} with packed QKV input is not supported")
        node = proj_of(ins[0])
        total = linear_shape(node)[1]
        head_dim = total // (heads + 2 * kv_heads) if heads else 0
        q_cols, kv_cols = heads * head_dim, kv_heads * head_dim
        q = Projection(node, (0, q_cols))
        k = Projection(node, (q_cols, q_cols + kv_cols))
        v = Projection(node, (q_cols + kv_cols, q_cols + 2 * kv_cols))
    else:
        q, k, v = (Projection(proj_of(ins[i])) for i in range(3))
        if heads == 0:  # opset-23 Attention on 4-D inputs: heads from the q view
            found = _heads_from_reshape(q.node.outputs[0], body, world)
            if found is None:
                raise NoMatch(f"{name}: no q_num_heads and no Reshape splitting q into heads")
            heads = found[0]
        head_dim = q.out_features // heads
        kv_heads = kv_heads or k.out_features // head_dim
    past = (3, 4) if name == "GroupQueryAttention" else (6, 7) if name == "MultiHeadAttention" else (4, 5)
    outputs = set(op.graph.outputs) if op.graph is not None else set()
    caches = []
    for kind, slot, out in (("key", past[0], 1), ("value", past[1], 2)):
        value = ins[slot]
        if value is not None and value.is_graph_input():
            present = op.outputs[out] if len(op.outputs) > out and op.outputs[out] in outputs else None
            caches.append(Cache(value, present, kind, op))
    if name == "Attention":
        mask = "additive" if ins[3] is not None else "causal" if attr(op, "is_causal", 0) else "none"
    else:
        mask = "op"
    rotary = "op" if attr(op, "do_rotary", 0) else _rotary(body)
    return _record(name, q, k, v, o_proj, heads, head_dim, mask, rotary, tuple(caches), op, False, nodes)
