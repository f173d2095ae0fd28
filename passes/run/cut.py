"""The graph cut: a decoder's ONNX graph as one subgraph per block, each from the residual stream entering
the block to the stream leaving it.

A block's subgraph reads the stream entering it and the side tensors it needs that are computed outside
it (rotary cos/sin, the attention mask, shapes). Side tensors must not depend on the residual stream
(this is checked), so they can be captured once from a full run and stay fixed when a block is skipped
(passes/run/block_runner.py runs the subgraphs). Block input is the residual stream entering the block
(before its attention part), block output the stream after its last part's residual add (its FFN's, or
for an FFN-free block its attention's). An identity block (a layer the metadata names but the graph has
no nodes for) has no subgraph: its output is its input.

A parallel group (passes/parallel.py, design §10) has no member to cut out: every member reads the group's
input stream and the group's one add writes the stream after it. With `groups`, cut_blocks cuts such a
group as ONE unit, from that input to that output (`BlockCut.group`); without it, it refuses the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx_ir as ir

from passes.blocks import Block
from passes.errors import UserError

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
}
# Ops whose output depends only on their input's shape: skipping a block does not change it.
SHAPE_ONLY_OPS = {"Shape", "Size"}
# Fused add + norm (ONNX Runtime contrib ops): output 0 is the normalized sum, output 3 the sum (the stream).
SKIP_NORMS = {
    "SkipSimplifiedLayerNormalization": "SimplifiedLayerNormalization",
    "SkipLayerNormalization": "LayerNormalization",
}


@dataclass
class BlockCut:
    """One block as a subgraph: stream in -> stream out, with side tensors captured from a full run."""

    index: int
    attention: bool
    width: int
    input_name: str
    output_name: str
    side_inputs: list[str]
    proto: onnx.ModelProto | None  # None: an identity block (output = input, nothing to run)
    # A whole parallel group cut as one unit: its (first, last) block numbers (Block.parallel). `index` is
    # then its first member's, `attention` whether any member has attention, `width` the members' sum.
    group: tuple[int, int] | None = None


class NameGraph:
    """Name-level view of an ONNX graph: producers, consumers, initializers."""

    def __init__(self, proto: onnx.ModelProto):
        graph = proto.graph
        self.nodes = list(graph.node)
        self.producer = {out: k for k, node in enumerate(self.nodes) for out in node.output if out}
        self.consumers: dict[str, list[int]] = {}
        for k, node in enumerate(self.nodes):
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(k)
        self.initializers = {t.name for t in graph.initializer}

    def forward_cone(self, start: str, values_only: bool = False) -> set[str]:
        """Names of all values computed from `start` (including it). With `values_only`, only through edges
        that carry values: not into Shape/Size nor CastLike's type input (skipping a block keeps shapes)."""
        seen, frontier = {start}, [start]
        while frontier:
            name = frontier.pop()
            for k in self.consumers.get(name, []):
                if values_only and not _reads_values(self.nodes[k], name):
                    continue
                for out in self.nodes[k].output:
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
        return seen

    def block_side_inputs(self, start: str, end: str) -> list[str]:
        """Values the block start -> end reads that it does not compute from `start`. Initializers, and
        values computed from them alone (an exporter's Transpose of a stored weight), belong to the block:
        fed from another run they would be that run's weights, not the block's own."""
        dependent = self.forward_cone(start)
        if end not in dependent:
            raise UserError(f"block output {end!r} is not computed from its input {start!r}")
        side, seen, frontier = [], {end}, [end]
        while frontier:
            node = self.nodes[self.producer[frontier.pop()]]
            for name in node.input:
                if not name or name in seen or name == start or name in self.initializers:
                    continue
                seen.add(name)
                if name in dependent or self.from_weights_only(name):
                    frontier.append(name)
                else:
                    side.append(name)
        return sorted(side)

    def from_weights_only(self, name: str) -> bool:
        """Whether value `name` is computed from initializers alone (reads no graph input)."""
        seen, frontier = {name}, [name]
        while frontier:
            value = frontier.pop()
            if value in self.initializers:
                continue
            if value not in self.producer:
                return False  # a graph input
            for source in self.nodes[self.producer[value]].input:
                if source and source not in seen:
                    seen.add(source)
                    frontier.append(source)
        return True


def _reads_values(node: onnx.NodeProto, name: str) -> bool:
    """Whether `node` reads the values of input `name` (not only its shape or type)."""
    if node.op_type in SHAPE_ONLY_OPS:
        return False
    return not (node.op_type == "CastLike" and name not in node.input[:1])


def value_types(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """The declared type of every value that has one (value_info, graph inputs and outputs), by name."""
    graph = proto.graph
    return {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}


def _proto_node(graph: NameGraph, node: ir.Node) -> onnx.NodeProto:
    """The proto node of the onnx_ir node `node` (matched by op type and input names)."""
    inputs = [v.name if v is not None else "" for v in node.inputs]
    for candidate in graph.nodes:
        if candidate.op_type == node.op_type and list(candidate.input)[: len(inputs)] == inputs:
            return candidate
    raise UserError(f"internal error: node {node.name!r} not found in the model proto")


def stream_names(proto: onnx.ModelProto, blocks: list[Block]) -> list[tuple[str, str]]:
    """(input, output) stream names of every block. A last block whose residual sum the final
    Skip*Normalization keeps internal (output 3 unnamed) gets that output named in `proto`."""
    names = [(b.block_input.name, b.output.name if b.output is not None else "") for b in blocks]
    if not names[-1][1]:
        graph = NameGraph(proto)
        last = blocks[-1].last_residual
        assert last is not None  # an identity block's output is its input, which has a name
        node = _proto_node(graph, last.node)
        if node.op_type not in SKIP_NORMS:
            raise UserError(f"internal error: the last block's residual {node.op_type} has no output")
        sum_name = f"{node.name or node.output[0]}/residual_sum"
        while len(node.output) < 4:
            node.output.append("")
        node.output[3] = sum_name
        names[-1] = (names[-1][0], sum_name)
    return names


def split_skip_norms(proto: onnx.ModelProto, starts: list[str]) -> None:
    """A block that starts at a Skip*Normalization's sum (output 3) also reads its normalized output 0,
    which the same node computes from the previous block's values. Give such a block its own norm:
    consumers of output 0 read a plain (Simplified)LayerNormalization of the sum instead (same weights)."""
    graph = NameGraph(proto)
    for start in starts:
        k = graph.producer.get(start)
        node = graph.nodes[k] if k is not None else None
        if node is None or node.op_type not in SKIP_NORMS or len(node.output) < 4 or start != node.output[3]:
            continue
        normalized = node.output[0]
        if not graph.consumers.get(normalized):
            continue
        block_norm = f"{normalized}/block_norm"
        attrs = [a for a in node.attribute if a.name == "epsilon"]
        beta = node.input[3:4] if node.op_type == "SkipLayerNormalization" else []  # Simplified: 3 is a bias
        inputs = [start, node.input[2], *[b for b in beta if b]]
        norm = onnx.helper.make_node(SKIP_NORMS[node.op_type], inputs, [block_norm], name=block_norm, axis=-1)
        norm.attribute.extend(attrs)
        for j in graph.consumers[normalized]:
            consumer = graph.nodes[j]
            for slot, name in enumerate(consumer.input):
                if name == normalized:
                    consumer.input[slot] = block_norm
        proto.graph.node.insert(k + 1, norm)
        graph = NameGraph(proto)


def cut_units(blocks: list[Block]) -> list[list[int]]:
    """The positions in `blocks` of each cut: one block, or a whole parallel group (consecutive blocks of
    the same Block.parallel)."""
    units: list[list[int]] = []
    for k, block in enumerate(blocks):
        if block.parallel is not None and units and blocks[units[-1][0]].parallel == block.parallel:
            units[-1].append(k)
        else:
            units.append([k])
    return units


def cut_blocks(blocks: list[Block], proto: onnx.ModelProto, groups: bool = False) -> list[BlockCut]:
    """One subgraph per block (onnx.utils.Extractor on the proto; weights stay where they are); with `groups`,
    one per parallel group as well (its members' shared input -> the group's output, see the module doc).

    Stream tensors whose type shape inference left unknown get the embedding output's type in `proto`;
    fused Skip*Normalization nodes at block boundaries are split in `proto` (see split_skip_norms).
    """
    per_block = stream_names(proto, blocks)
    units = cut_units(blocks) if groups else [[k] for k in range(len(blocks))]
    names = [(per_block[unit[0]][0], per_block[unit[-1]][1]) for unit in units]
    split_skip_norms(proto, [start for start, _ in names[1:]])
    graph = NameGraph(proto)
    stream = graph.forward_cone(names[0][0], values_only=True)
    sides = []
    for k, (start, end) in enumerate(names):
        if k + 1 < len(names) and names[k + 1][0] != end:
            which = blocks[units[k + 1][0]]
            why = " (a parallel group: its members share one input)" if which.parallel is not None else ""
            raise UserError(
                f"block {which.index} does not start where block {blocks[units[k][-1]].index} ends{why}; "
                "cannot analyze this graph"
            )
        first = blocks[units[k][0]]
        sides.append([] if first.is_identity else graph.block_side_inputs(start, end))
    _check_side_inputs([blocks[unit[0]] for unit in units], sides, stream, value_types(proto))
    fill_stream_types(proto, [start for start, _ in names] + [names[-1][1]])
    types = value_types(proto)
    extractor = onnx.utils.Extractor(proto)
    cuts = []
    for unit, side, (start, end) in zip(units, sides, names, strict=True):
        members = [blocks[k] for k in unit]
        block = members[0]
        unknown = [name for name in side if name not in types]
        if unknown:
            raise UserError(
                f"block {block.index}: the type of {unknown[0]!r} is unknown (shape inference failed)"
            )
        sub = None if block.is_identity else extractor.extract_model([start, *side], [end])
        if len(members) == 1:
            cuts.append(BlockCut(block.index, block.attention, block.width, start, end, side, sub))
        else:
            attention, width = any(b.attention for b in members), sum(b.width for b in members)
            cuts.append(BlockCut(block.index, attention, width, start, end, side, sub, block.parallel))
    return cuts


def _check_side_inputs(blocks: list[Block], sides: list[list[str]], stream: set[str], types: dict) -> None:
    """Side tensors stay fixed when a block is skipped: they must not be computed from the stream
    (integer shape tensors are allowed: skipping a block does not change shapes)."""
    for block, side in zip(blocks, sides, strict=True):
        for name in side:
            known = types.get(name)
            elem = known.type.tensor_type.elem_type if known is not None else onnx.TensorProto.FLOAT
            if name in stream and elem in FLOAT_TYPES:
                raise UserError(
                    f"block {block.index} reads {name!r}, computed from the residual stream outside the "
                    "block (a norm shared across blocks, e.g. SkipSimplifiedLayerNormalization?); "
                    "dependency analysis needs blocks that read only their input stream"
                )


def fill_stream_types(proto: onnx.ModelProto, names: list[str]) -> None:
    """Stream values (`names`, the first one the first block's input) without a type get the first's."""
    types = value_types(proto)
    first = types.get(names[0])
    elem = first.type.tensor_type.elem_type if first is not None else onnx.TensorProto.FLOAT
    for name in names:
        if name not in types:
            proto.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, None))
