"""The model map: one typed picture of a decoder graph, built once, that every pass and tool reads.

    model_map = build_model_map(model)        # onnx_ir.Model; UserError when no blocks are found
    model_map.embedding                       # Embedding | None (None: a pipeline-stage graph)
    model_map.stream_start                    # the value the residual stream starts from
    model_map.branches                        # [ResidualBranch]: every residual branch, in stream order
    model_map.blocks                          # [Block] in stream order (passes/blocks.py records)
    model_map.attention_of(i)                 # AttentionBranch | None for block i; .record is the typed
                                              # passes.patterns.attention.Attention (heads, KV heads, ...)
    model_map.parallel                        # [ParallelSum]: the parallel groups passes/parallel.py wrote
    model_map.final_norm, model_map.lm_head   # Norm | None, LmHead | None
    model_map.signature                       # passes.graph_inputs.Signature (what each input means)
    model_map.vocab_size

The walk (docs/design.md §2): the stream starts at the token embedding (Gather of a table, directly, through
Transpose, Cast or Identity, or ORT's GatherBlockQuantized), or, in a pipeline-stage graph with no
embedding, at the float graph input that carries it. From there it follows the residual adds: an Add, or
a Skip(Simplified)LayerNormalization whose output 3 is the new stream, reached directly or through
Cast/Identity copies of the stream (Optimum casts the stream before every norm).

`model_map.branches` lists EVERY residual branch in stream order as a `ResidualBranch` of one kind:

- "ffn": RMSNorm -> SwiGLU, fusable (its `norm` and `ffn` records);
- "attention": a branch with an attention core (Softmax or a fused attention op);
- "linear": one projection (after any norm), e.g. a Nemotron-NAS replace_with_linear attention or FFN;
- "other": anything else (a GELU FFN, a form the SwiGLU recognizer does not know), opaque; `why` says what.

`model_map.blocks` are derived from that list, one per source layer (passes/blocks.py: an attention part
and an FFN part, each "none" when absent): by the exporter's layer map in the metadata (`ffn_fusion.hf`
layer_kinds; numbers are the checkpoint's layer indices, identity layers included) when it fits the
branches, else as seen (an attention branch starts a block, a SwiGLU branch ends one, a one-Linear branch
fills the attention slot of an empty block, else the FFN slot). A plan group may not contain an attention
part after its first block, nor a Linear or other FFN (passes/plan.py).

A parallel group (paper section 6, passes/parallel.py) reads as a `ParallelSum`: several residual adds of one
stream x ending in a projection (each member's attention, x + a_k), and one add of x and the sum of every
member's branches, whose output is the stream after the group. Its members' branches are listed in block
order (attention k, then FFN k, which reads h_k = x + a_k); each carries the group's position
(`ResidualBranch.group`), and an FFN branch's `residual` is the group's add (it has none of its own).
Blocks of a parallel group record it (`Block.parallel`).

This is the only stream walker: passes and tools call `build_model_map` (or `find_blocks`, which
returns its blocks, or `walk_stream` where a graph need not have SwiGLU blocks: the sharder).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
from dataclasses import dataclass

import onnx_ir as ir

from passes.blocks import Block, ResidualAdd
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.matching import NoMatch, attr, is_initializer
from passes.metadata import HF_METADATA_KEY, recorded_plan
from passes.patterns.attention import Attention, branch_nodes, end_projection, is_linear, match_attention
from passes.patterns.rmsnorm import Norm, match_rmsnorm
from passes.patterns.swiglu import SwiGLU, match_swiglu

ATTENTION_OPS = {"Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention", "AttentionPlugin"}
COPY_OPS = ("Cast", "Identity")
# ORT's fused residual add + norm: input 0 the stream, input 1 the branch; output 0 normalized, 3 the sum
SKIP_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
RESIDUAL_OPS = ("Add", *SKIP_NORMS)
BRANCH_KINDS = ("ffn", "attention", "linear", "other")
_FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
# Between the final norm and lm_head: the exporters' "last tokens only" slicing and reshapes.
_HEAD_PASS_OPS = ("Cast", "Identity", "Gather", "Slice", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


@dataclass(frozen=True)
class Embedding:
    """The token embedding: `output` = table[ids]."""

    node: ir.Node  # Gather or GatherBlockQuantized
    table: ir.Value  # the stored initializer (GenAI's tied table is lm_head's [hidden, vocab] weight)
    transposed: bool  # read through Transpose: the stored table is [hidden, vocab]
    ids: ir.Value  # the graph input with the token ids
    output: ir.Value
    vocab: int | None


@dataclass(frozen=True)
class ResidualBranch:
    """One residual branch: `residual` adds `output` (computed from `start`) to the stream `stream`."""

    index: int  # in stream order, over all branches
    kind: str  # one of BRANCH_KINDS
    stream: ir.Value  # the stream value before the branch (not a Cast copy of it)
    start: ir.Value  # what the branch reads: `stream`, or a Skip*Normalization's normalized output
    residual: ResidualAdd
    norm: Norm | None = None  # "ffn" only
    ffn: SwiGLU | None = None  # "ffn" only
    why: str = ""  # "linear"/"other": what the branch is, and why it is no SwiGLU FFN
    group: int | None = None  # position in Stream.parallel when the branch is a parallel group member's
    value: ir.Value | None = None  # what the branch computes where `residual` adds a sum of branches

    @property
    def output(self) -> ir.Value:
        return self.value if self.value is not None else self.residual.branch

    @functools.cached_property
    def nodes(self) -> frozenset[ir.Node]:
        """The branch body: every node upstream of `output` that depends on `start`."""
        return frozenset(branch_nodes(self.output, self.start))

    @property
    def projection(self) -> ir.Node | None:
        """The linear layer the branch ends in (o_proj, down_proj, the one Linear), if any."""
        return end_projection(self.output)

    def describe(self) -> str:
        layer = layer_name(self.projection or self.output.producer())
        return f"residual branch {self.index} [{self.kind}]" + (f" ({layer})" if layer else "")


@dataclass(frozen=True)
class ParallelSum:
    """A parallel group as passes/parallel.py writes it: y = x + (sum_k a_k) + (sum_k f_k), every member's
    attention reading x, its FFN reading h_k = x + a_k."""

    input: ir.Value  # x, the stream entering the group
    residual: ResidualAdd  # x + the branch sum; its output is the stream after the group
    attention: tuple[ResidualBranch, ...]  # the members' attention branches, in block order
    ffns: tuple[ResidualBranch, ...]  # the members' FFN branches, in block order
    attention_sum: ir.Value  # a_1 + ... + a_n
    ffn_sum: ir.Value  # f_1 + ... + f_n

    @property
    def size(self) -> int:
        return len(self.attention)


@dataclass(frozen=True)
class AttentionBranch:
    """The attention sub-block of block `index`: the branch that `residual` adds to the stream."""

    index: int
    residual: ResidualAdd
    start: ir.Value  # what the branch reads: the stream, or the normalized stream of a Skip*Norm chain

    @property
    def output(self) -> ir.Value:
        return self.residual.branch

    @functools.cached_property
    def record(self) -> Attention:
        """The typed attention record (q/k/v or packed qkv, o_proj, heads, KV heads, head dim, caches,
        mask form); computed on first use. Raises NoMatch when the recognizer does not know the form."""
        return match_attention(self.residual.branch, self.start)


@dataclass(frozen=True)
class LmHead:
    node: ir.Node  # MatMul, Gemm or MatMulNBits producing the logits
    input: ir.Value  # the normalized stream it reads (after any last-token slicing)
    weight: ir.Value | None  # the stored weight initializer
    tied: bool  # the same initializer as the token embedding's table


@dataclass(frozen=True)
class ModelMap:
    graph: ir.Graph
    signature: Signature
    embedding: Embedding | None
    stream_start: ir.Value
    branches: tuple[ResidualBranch, ...]
    blocks: tuple[Block, ...]
    attention: tuple[AttentionBranch, ...]
    final_norm: Norm | None
    lm_head: LmHead | None
    parallel: tuple[ParallelSum, ...] = ()

    def attention_of(self, index: int) -> AttentionBranch | None:
        return next((a for a in self.attention if a.index == index), None)

    @property
    def is_pipeline_stage(self) -> bool:
        return self.embedding is None

    @property
    def vocab_size(self) -> int | None:
        if self.embedding is not None and self.embedding.vocab:
            return self.embedding.vocab
        return _logits_vocab(self.signature)


@dataclass(frozen=True)
class Stream:
    """The residual stream of a graph: where it starts and every branch added to it, in order."""

    embedding: Embedding | None
    start: ir.Value
    branches: tuple[ResidualBranch, ...]
    parallel: tuple[ParallelSum, ...] = ()

    @property
    def last(self) -> ResidualAdd | None:
        return self.branches[-1].residual if self.branches else None


def build_model_map(model: ir.Model) -> ModelMap:
    """Walk `model`'s residual stream once; UserError if it has no RMSNorm -> SwiGLU blocks."""
    graph = model.graph
    signature = Signature.of(model)
    stream = walk_stream(model, signature)
    blocks, attention = _blocks(stream.branches, stream.start, layer_map(model))
    final_norm, lm_head = _head(graph, signature, stream.last, stream.embedding)
    return ModelMap(
        graph, signature, stream.embedding, stream.start, stream.branches, tuple(blocks), tuple(attention),
        final_norm, lm_head, stream.parallel,
    )


def walk_stream(model: ir.Model, signature: Signature | None = None) -> Stream:
    """Every residual branch of `model` in stream order, each of a kind (no SwiGLU blocks needed)."""
    graph = model.graph
    embedding = find_embedding(graph)
    if embedding is not None:
        start = embedding.output
    else:
        start = _stream_input(graph, signature if signature is not None else Signature.of(model))
    branches: list[ResidualBranch] = []
    groups: list[ParallelSum] = []
    stream: ir.Value | None = start
    while stream is not None:
        candidates = _residual_candidates(stream)
        # A residual add's branch ends in a projection (maybe plus a bias); other adds of the stream do not.
        ending = [c for c in candidates if end_projection(c.branch) is not None]
        group = _parallel_sum(stream, candidates, ending, len(branches), len(groups))
        if group is not None:
            groups.append(group)
            branches.extend(b for pair in zip(group.attention, group.ffns, strict=True) for b in pair)
            stream = group.residual.output
            continue
        residual = _residual_add(stream, candidates, ending)
        if residual is None:
            break
        branches.append(_classify(len(branches), stream, residual))
        stream = residual.output
    return Stream(embedding, start, tuple(branches), tuple(groups))


def find_lm_head(model: ir.Model, stream: Stream) -> LmHead | None:
    """The lm_head of `stream`'s model, found backwards from the logits (no SwiGLU blocks needed)."""
    return _head(model.graph, Signature.of(model), stream.last, stream.embedding)[1]


# ------------------------------------------------------------------------------------------ the walk


def _classify(index: int, stream: ir.Value, residual: ResidualAdd) -> ResidualBranch:
    start = _branch_start(stream)
    try:
        ffn, norm = _match_ffn(residual, stream)
    except NoMatch as exc:
        if _is_attention(residual.branch, start):
            return ResidualBranch(index, "attention", stream, start, residual)
        kind = "linear" if _is_one_linear(residual.branch, start) else "other"
        why = "one Linear" if kind == "linear" else f"{_describe_branch(residual.branch, start)} ({exc})"
        return ResidualBranch(index, kind, stream, start, residual, why=why)
    return ResidualBranch(index, "ffn", stream, start, residual, norm, ffn)


def _is_one_linear(branch: ir.Value, start: ir.Value) -> bool:
    """The branch ends in a linear layer and has no other (a replace_with_linear attention or FFN)."""
    nodes = branch_nodes(branch, start)
    end = end_projection(branch, nodes)
    return end is not None and [n for n in nodes if is_linear(n)] == [end]


def _blocks(
    branches: tuple[ResidualBranch, ...], start: ir.Value, layers: list[tuple[str, str, str]] | None
) -> tuple[list[Block], list[AttentionBranch]]:
    """One block per layer: by the exporter's layer map when it fits the branches, else as seen."""
    parts = _parts_by_layer_map(branches, layers) if layers is not None else None
    names: list[str | None] = [name for _, _, name in layers] if parts is not None and layers else []
    if parts is None:
        parts = _parts_as_seen(branches)
    if not any(ffn is not None and ffn.kind == "ffn" for _, ffn in parts):
        found = "; ".join(sorted({b.why for b in branches if b.why}))
        found = found or "no residual stream of Add nodes after the embedding"
        raise UserError(f"no RMSNorm -> SwiGLU FFN blocks found: {found}")
    blocks: list[Block] = []
    stream = start
    for index, (attn, ffn) in enumerate(parts):
        block = _block(index, attn, ffn, stream, names[index] if names else None)
        blocks.append(block)
        stream = block.output if block.output is not None else stream
    blocks = _mark_parallel(blocks, parts)
    attention = [
        AttentionBranch(i, attn.residual, attn.start)
        for i, (attn, _) in enumerate(parts)
        if attn is not None and attn.kind == "attention"
    ]
    return blocks, attention


Parts = tuple["ResidualBranch | None", "ResidualBranch | None"]  # a layer's attention and FFN branches


def _mark_parallel(blocks: list[Block], parts: list[Parts]) -> list[Block]:
    """Record each parallel group's (first, last) block numbers in its members."""
    members: dict[int, list[int]] = {}
    for block, (attn, _) in zip(blocks, parts, strict=True):
        if attn is not None and attn.group is not None:
            members.setdefault(attn.group, []).append(block.index)
    span = {i: (group[0], group[-1]) for group in members.values() for i in group}
    return [dataclasses.replace(b, parallel=span[b.index]) if b.index in span else b for b in blocks]


def _parts_as_seen(branches: tuple[ResidualBranch, ...]) -> list[Parts]:
    """Layers from the branches alone: an attention branch starts a layer, a SwiGLU branch ends one, and a
    one-Linear (or unknown) branch fills the attention slot of an empty layer, else the FFN slot. A
    Linear after an attention-only layer reads as that layer's FFN (only the layer map can tell)."""
    parts: list[Parts] = []
    attn: ResidualBranch | None = None
    for branch in branches:
        if branch.kind == "attention" or (branch.kind != "ffn" and attn is None):
            if attn is not None:
                parts.append((attn, None))
            attn = branch
            continue
        parts.append((attn, branch))
        attn = None
    if attn is not None:
        parts.append((attn, None))
    return parts


# Layer-map kinds (exporters/hf/config.py layer_kinds) -> the branch kinds that can carry them (a
# quantized or otherwise rewritten SwiGLU or Linear may read as "other").
_ACCEPTS = {"gqa": ("attention",), "swiglu": ("ffn", "other"), "linear": ("linear", "other")}


def _parts_by_layer_map(
    branches: tuple[ResidualBranch, ...], layers: list[tuple[str, str, str]]
) -> list[Parts] | None:
    """Layers as the exporter's layer map names them (identity layers included), or None when the map
    does not fit the branches (a graph rewritten since: numbered as seen)."""
    parts: list[Parts] = []
    queue = list(branches)
    for *kinds, _ in layers:
        layer: list[ResidualBranch | None] = []
        for kind in kinds:
            if kind == "none":
                layer.append(None)
            elif queue and queue[0].kind in _ACCEPTS.get(kind, ()):
                layer.append(queue.pop(0))
            else:
                return None
        parts.append((layer[0], layer[1]))
    return None if queue else parts


def _block(
    index: int, attn: ResidualBranch | None, ffn: ResidualBranch | None, stream: ir.Value, name: str | None
) -> Block:
    """Block `index` from its attention and FFN branches (either may be absent; both: the identity at
    `stream`); `name` the layer's name from the metadata, if any."""
    first = attn or ffn
    block_input = first.stream if first is not None else stream
    swiglu = ffn is not None and ffn.kind == "ffn"
    ffn_kind = "none" if ffn is None else "swiglu" if swiglu else ffn.kind
    attention_kind = "none" if attn is None else attn.kind
    projection = (ffn or attn).projection if first is not None else None
    name = layer_name(ffn.ffn.output.producer() if swiglu else projection) or name
    return Block(
        index,
        block_input,
        attention_kind,
        ffn_kind,
        ffn.norm if swiglu else None,
        ffn.ffn if swiglu else None,
        ffn.residual if ffn is not None else None,
        attn.residual if attn is not None else None,
        name,
        _what(attn) if attention_kind in ("linear", "other") else None,
        _what(ffn) if ffn_kind in ("linear", "other") else None,
        *(_heads(attn) if attention_kind == "attention" else (None, None)),
    )


def _what(branch: ResidualBranch | None) -> str | None:
    if branch is None:
        return None
    what = "a one-Linear branch (replace_with_linear)" if branch.kind == "linear" else branch.why
    return f"{branch.describe()}, {what or 'not a SwiGLU FFN'}"


def _heads(branch: ResidualBranch | None) -> tuple[int | None, int | None]:
    """The attention branch's (KV heads, query heads), where the attention recognizer reads them (the block
    table, the latency model's dimensions)."""
    if branch is None:
        return None, None
    try:
        attention = match_attention(branch.residual.branch, branch.start)
    except (NoMatch, UserError):
        return None, None
    return attention.kv_heads, attention.heads


def layer_map(model: ir.Model) -> list[tuple[str, str, str]] | None:
    """Per source layer (attention kind, FFN kind, name) from the exporter's metadata (kinds "gqa",
    "linear", "none"; "swiglu", "linear", "none"), adjusted for a fused graph's plan (a group [i, j]
    leaves layer i with one SwiGLU FFN and removes layers i+1..j); None without the metadata."""
    try:
        meta = json.loads(model.metadata_props[HF_METADATA_KEY])
        kinds, names = meta["layer_kinds"], meta["layer_names"]
        layers = [(*(re.sub(r"\(.*\)", "", p) for p in kind.split("+")), name)
                  for kind, name in zip(kinds, names, strict=True)]
        plan = recorded_plan(model.metadata_props)
        for first, last in sorted(plan.groups if plan else (), reverse=True):
            if not 0 <= first < last < len(layers):
                return None
            layers[first : last + 1] = [(layers[first][0], "swiglu", layers[first][2])]
    except (KeyError, TypeError, ValueError, AttributeError, UserError):
        return None
    return layers if all(len(layer) == 3 for layer in layers) else None


def _match_ffn(residual: ResidualAdd, stream: ir.Value) -> tuple[SwiGLU, Norm]:
    return _match_ffn_output(residual.branch, stream)


def _match_ffn_output(output: ir.Value, stream: ir.Value) -> tuple[SwiGLU, Norm]:
    ffn = match_swiglu(output)
    norm = match_rmsnorm(ffn.input)
    if _root(norm.input) is not _root(stream):
        raise NoMatch("the FFN's RMSNorm does not read the residual stream")
    return ffn, norm


def aliases(stream: ir.Value) -> list[ir.Value]:
    """`stream` and its Cast/Identity copies (Optimum's norm casts, no-ops in fp32 models)."""
    found, frontier = [stream], [stream]
    while frontier:
        value = frontier.pop()
        for use in value.uses():
            node = use.node
            if node.op_type in COPY_OPS and node.outputs[0] not in found and _is_float_copy(node):
                found.append(node.outputs[0])
                frontier.append(node.outputs[0])
    return found


def _is_float_copy(node: ir.Node) -> bool:
    if node.op_type == "Identity":
        return True
    return attr(node, "to", None) in _FLOAT_TYPES


def _root(value: ir.Value) -> ir.Value:
    """Look through Cast/Identity copies back to the stream value."""
    while (node := value.producer()) is not None and node.op_type in COPY_OPS:
        value = node.inputs[0]
    return value


def _residual_candidates(stream: ir.Value) -> list[ResidualAdd]:
    """Every residual-add node that reads `stream` (or a copy of it) in its first two inputs."""
    candidates = []
    for value in aliases(stream):
        for use in value.uses():
            node, slot = use.node, use.idx
            if node.op_type in RESIDUAL_OPS and slot in (0, 1):
                candidates.append(ResidualAdd(node, slot, 1 - slot))
    return candidates


def _residual_add(
    stream: ir.Value, candidates: list[ResidualAdd], ending: list[ResidualAdd]
) -> ResidualAdd | None:
    """The residual add that consumes `stream` (or a copy of it), if the stream goes on: of the residual
    adds reading it (`candidates`), the one whose branch ends in a projection (`ending`)."""
    if len(ending) > 1:
        names = ", ".join(repr(c.node.name) for c in ending)
        raise UserError(f"the residual stream {stream.name!r} feeds several residual adds ({names})")
    chosen = ending or candidates
    return chosen[0] if len(chosen) == 1 else None


def _parallel_sum(
    stream: ir.Value, candidates: list[ResidualAdd], attention: list[ResidualAdd], index: int, number: int
) -> ParallelSum | None:
    """The parallel group that starts at `stream`, if one does (module docstring): of the residual adds
    reading it (`candidates`), those whose branch ends in a projection (`attention`) are its members'; `index`
    is the position of its first branch among all branches, `number` its own among the groups."""
    if len(attention) < 2:
        return None
    for total in (c for c in candidates if c not in attention):
        node = total.branch.producer()
        if node is None or node.op_type != "Add":
            continue
        attention_sum, ffn_sum = node.inputs[0], node.inputs[1]
        by_output = {c.branch: c for c in attention}
        adds = [by_output.get(v) for v in _addends(attention_sum)]
        if len(adds) != len(attention) or None in adds or len(set(map(id, adds))) != len(adds):
            continue
        members = _parallel_members(stream, [a for a in adds if a is not None], _addends(ffn_sum), total,
                                    index, number)
        if members is not None:
            attn, ffns = members
            return ParallelSum(stream, total, attn, ffns, attention_sum, ffn_sum)
    return None


def _parallel_members(
    x: ir.Value, adds: list[ResidualAdd], outputs: list[ir.Value], total: ResidualAdd, index: int, number: int
) -> tuple[tuple[ResidualBranch, ...], tuple[ResidualBranch, ...]] | None:
    """Each member's attention branch (added to x by `adds`) and its FFN branch (one of `outputs`, reading
    that member's h = x + a); None when the FFN outputs do not pair one to one with the members."""
    if len(outputs) != len(adds):
        return None
    attention, ffns, left = [], [], list(outputs)
    for k, add in enumerate(adds):
        h = add.output
        if h is None:
            return None
        h_start = _branch_start(h)
        # The FFN reading this member's h: a SwiGLU, or (FP8 Q/DQ, another rewrite) any branch of h.
        reads_h = [output for output in left if branch_nodes(output, h_start)]
        if len(reads_h) != 1:
            return None
        output = reads_h[0]
        left.remove(output)
        position = index + 2 * k
        member = {"group": number, "value": output}
        try:
            ffn, norm = _match_ffn_output(output, h)
            branch = ResidualBranch(position + 1, "ffn", h, h_start, total, norm, ffn, **member)
        except NoMatch as exc:
            why = f"{_describe_branch(output, h_start)} ({exc})"
            branch = ResidualBranch(position + 1, "other", h, h_start, total, why=why, **member)
        start = _branch_start(x)  # blocks after the first read x through a norm of their own
        start = start if branch_nodes(add.branch, start) else x
        attention.append(ResidualBranch(position, "attention", x, start, add, group=number))
        ffns.append(branch)
    return tuple(attention), tuple(ffns)


def _addends(value: ir.Value) -> list[ir.Value]:
    """The terms of a sum of branch outputs, left first: through Add nodes of two computed values (a
    projection's bias Add is a term, not a sum)."""
    node = value.producer()
    if node is None or node.op_type != "Add" or end_projection(value) is not None:
        return [value]
    if any(v is None or is_initializer(v) for v in node.inputs):
        return [value]
    return [*_addends(node.inputs[0]), *_addends(node.inputs[1])]


def _branch_start(stream: ir.Value) -> ir.Value:
    """What a branch reads: the stream, or in a Skip*Normalization chain the normalized output (0) of the
    node whose output 3 is the stream."""
    node = stream.producer()
    is_sum = node is not None and node.op_type in SKIP_NORMS and len(node.outputs) > 3
    if is_sum and node.outputs[3] is stream:
        return node.outputs[0]
    return stream


def _is_attention(branch: ir.Value, start: ir.Value) -> bool:
    return any(n.op_type in ATTENTION_OPS for n in branch_nodes(branch, start))


def _describe_branch(branch: ir.Value, start: ir.Value) -> str:
    """A short name for a branch that is neither attention nor RMSNorm -> SwiGLU, e.g. LayerNorm -> GELU."""
    ops = {n.op_type for n in branch_nodes(branch, start)}
    norm = "LayerNorm" if "LayerNormalization" in ops or {"Sub", "ReduceMean"} <= ops else "RMSNorm"
    if ops & {"Gelu", "Erf", "Tanh", "FastGelu", "BiasGelu"}:
        act = "GELU"
    elif "Relu" in ops:
        act = "ReLU"
    elif "Sigmoid" in ops:
        act = "SwiGLU-like"
    else:
        act = "unknown"
    return f"{norm} -> {act} FFN"


# ------------------------------------------------------------------------------------------ the ends


def find_embedding(graph: ir.Graph) -> Embedding | None:
    """The token-embedding lookup: Gather(table, ids) with the table an initializer, read directly or
    through Transpose/Cast/Identity, or GatherBlockQuantized (int4); ids a graph input (maybe cast)."""
    inputs = set(graph.inputs)
    for node in graph:
        if node.op_type not in ("Gather", "GatherBlockQuantized") or len(node.inputs) < 2:
            continue
        if _root(node.inputs[1]) not in inputs or attr(node, "axis", 0) != 0:
            continue
        table, transposed = _table(node.inputs[0])
        if table is None:
            continue
        vocab = _vocab(node, table, transposed)
        return Embedding(node, table, transposed, _root(node.inputs[1]), node.outputs[0], vocab)
    return None


def _table(value: ir.Value) -> tuple[ir.Value | None, bool]:
    """The stored table behind a Gather's data input, and whether it is read through a Transpose."""
    transposed = False
    while not is_initializer(value):
        node = value.producer()
        if node is None or node.op_type not in ("Transpose", "Cast", "Identity", "Reshape"):
            return None, False
        transposed ^= node.op_type == "Transpose"
        value = node.inputs[0]
    shape = value.const_value.shape
    return (value, transposed) if len(shape) in (2, 3) else (None, False)


def _vocab(node: ir.Node, table: ir.Value, transposed: bool) -> int | None:
    if node.op_type == "GatherBlockQuantized":
        return int(table.const_value.shape[0])
    shape = table.const_value.shape
    return int(shape[1] if transposed else shape[0]) if len(shape) == 2 else None


def _stream_input(graph: ir.Graph, signature: Signature) -> ir.Value:
    """A pipeline-stage graph's float input that carries the stream."""
    stream = signature.stream
    if stream is None:
        raise UserError("no token embedding found: expected Gather(embedding weight, input_ids), "
                        "or a float graph input carrying the residual stream (a pipeline stage)")
    return next(v for v in graph.inputs if v.name == stream.name)


def _head(graph: ir.Graph, signature: Signature, last: ResidualAdd | None,
          embedding: Embedding | None) -> tuple[Norm | None, LmHead | None]:
    logits = next((v for v in graph.outputs if v.name == signature.logits.name), None)
    node = logits.producer() if logits is not None else None
    while node is not None and node.op_type in _HEAD_PASS_OPS:
        node = node.inputs[0].producer()
    if node is None or node.op_type not in ("MatMul", "Gemm", "MatMulNBits"):
        return _final_norm_at(last), None
    source, _ = _table(node.inputs[1]) if node.inputs[1] is not None else (None, False)
    tied = embedding is not None and source is not None and source is embedding.table
    head = LmHead(node, node.inputs[0], source, tied)
    value = node.inputs[0]
    while (producer := value.producer()) is not None and producer.op_type in _HEAD_PASS_OPS:
        value = producer.inputs[0]
    try:
        return match_rmsnorm(value), head
    except NoMatch:
        return _final_norm_at(last), head


def _final_norm_at(last: ResidualAdd | None) -> Norm | None:
    """A Skip*Normalization that ends the stream (no output 3) is the final norm."""
    if last is None or last.node.op_type not in SKIP_NORMS:
        return None
    try:
        return match_rmsnorm(last.node.outputs[0])
    except NoMatch:
        return None


def _logits_vocab(signature: Signature) -> int | None:
    return signature.logits.static(-1) if signature.outputs else None


# ------------------------------------------------------------------------------------------ display


_LAYER = re.compile(r"((?:model[./])?(?:layers|h|blocks)\.\d+)")


def layer_name(node: ir.Node | None) -> str | None:
    """The source layer, from the dynamo exporter's name scopes or else the node name (Optimum, GenAI:
    /model/layers.N/...); display only, names are not reliable."""
    if node is None:
        return None
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            for scope in reversed(ast.literal_eval(scopes)):
                if match := _LAYER.search(scope):
                    return match.group(1)
        except (ValueError, SyntaxError):
            pass
    if node.name and (match := _LAYER.search(node.name)):
        return match.group(1).replace("model/", "model.")
    return None


def vocab_of(stream_start: ir.Value) -> int | None:
    """Rows of the token-embedding table behind `stream_start` (a block's input), else the logits' last
    dim (pipeline stages); None when neither is known."""
    node = _root(stream_start).producer()
    if node is not None and node.op_type in ("Gather", "GatherBlockQuantized"):
        table, transposed = _table(node.inputs[0])
        if table is not None:
            return _vocab(node, table, transposed)
    graph = stream_start.graph
    if graph is None or not graph.outputs:
        return None
    logits = next((v for v in graph.outputs if v.name == "logits"), graph.outputs[0])
    last = logits.shape[-1] if logits.shape is not None and logits.shape.rank() else None
    return int(last) if isinstance(last, int) else None


def find_blocks(model: ir.Model) -> list[Block]:
    """All blocks of a Llama-family decoder in stream order; UserError if there are none."""
    return list(build_model_map(model).blocks)


def vocab_size(blocks: list[Block]) -> int:
    """Rows of the token-embedding table that feeds block 0 (through Transpose/Cast, or int4), else the
    logits' last dim (a pipeline stage); UserError when neither is known."""
    vocab = vocab_of(blocks[0].block_input)
    if vocab is None:
        raise UserError("the vocabulary size is unknown: no token embedding and no static logits dim")
    return vocab
