"""The block table: walk the residual stream and turn each sub-block into a typed record (DESIGN 2).

Every FFN sub-block, together with the attention sub-block directly before it (if any), is one block,
numbered in stream order. The walk follows the residual adds from the embedding to the final norm;
a branch that is an RMSNorm -> SwiGLU FFN is an FFN sub-block, a branch with a Softmax (or an
attention op) is an attention sub-block.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import onnx_ir as ir

from passes.errors import UserError
from passes.graph import NoMatch, is_initializer, strip_cast
from passes.patterns.rmsnorm import Norm, match_rmsnorm
from passes.patterns.swiglu import SwiGLU, match_swiglu

ATTENTION_OPS = {"Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention"}


@dataclass(frozen=True)
class ResidualAdd:
    """The node that adds a branch to the stream: Add, or SkipSimplifiedLayerNormalization (output 3)."""

    node: ir.Node
    stream_slot: int
    branch_slot: int

    @property
    def stream_in(self) -> ir.Value:
        return self.node.inputs[self.stream_slot]

    @property
    def branch(self) -> ir.Value:
        return self.node.inputs[self.branch_slot]

    @property
    def output(self) -> ir.Value | None:
        if self.node.op_type == "Add":
            return self.node.outputs[0]
        sums = self.node.outputs[3] if len(self.node.outputs) > 3 else None
        return sums if sums is not None and sums.name else None


@dataclass(frozen=True)
class Block:
    index: int
    attention: bool
    block_input: ir.Value  # the stream entering the block (before its attention, if any)
    norm: Norm
    ffn: SwiGLU
    residual: ResidualAdd  # adds the FFN output to the stream
    layer_name: str | None

    @property
    def ffn_input(self) -> ir.Value:
        """The stream entering the FFN sub-block (after the attention sub-block)."""
        return self.residual.stream_in

    @property
    def width(self) -> int:
        return self.ffn.width

    @property
    def dtype(self) -> ir.DataType:
        return self.ffn.gate.dtype

    def row(self) -> dict:
        """The block-table row as plain data (for --json and analysis)."""
        return {
            "index": self.index,
            "attention": self.attention,
            "ffn_width": self.width,
            "dtype": self.dtype.name.lower(),
            "norm": self.norm.kind,
            "layer": self.layer_name,
        }


def find_blocks(model: ir.Model) -> list[Block]:
    """All blocks of a Llama-family decoder in stream order; UserError if there are none."""
    stream = _embedding_output(model.graph)
    blocks: list[Block] = []
    attention_pending = False
    block_input = stream
    unrecognized: list[str] = []
    while (residual := _residual_add(stream)) is not None:
        try:
            ffn = match_swiglu(residual.branch)
            norm = match_rmsnorm(ffn.input)
            if norm.input is not stream:
                raise NoMatch("the FFN's RMSNorm does not read the residual stream")
        except NoMatch as exc:
            if _is_attention(residual.branch, stream):
                if attention_pending:
                    raise UserError(
                        f"two attention sub-blocks in a row after block {len(blocks) - 1}: "
                        "blocks without an FFN are not supported"
                    ) from None
                attention_pending = True
            else:
                unrecognized.append(f"{_describe_branch(residual.branch, stream)} ({exc})")
        else:
            name = _layer_name(ffn.output.producer())
            blocks.append(Block(len(blocks), attention_pending, block_input, norm, ffn, residual, name))
            attention_pending = False
        stream = residual.output
        if stream is None:
            break
        if not attention_pending:
            block_input = stream
    if not blocks:
        found = "; ".join(sorted(set(unrecognized))) or "no residual stream of Add nodes after the embedding"
        raise UserError(f"no RMSNorm -> SwiGLU FFN blocks found: {found}")
    return blocks


def _embedding_output(graph: ir.Graph) -> ir.Value:
    """The output of the token-embedding Gather (weight initializer, indices from a graph input)."""
    inputs = set(graph.inputs)
    for node in graph:
        if node.op_type != "Gather" or not is_initializer(node.inputs[0]):
            continue
        if len(node.inputs[0].shape) == 2 and strip_cast(node.inputs[1]) in inputs:
            return node.outputs[0]
    raise UserError("no token embedding found: expected Gather(embedding weight, input_ids)")


def _residual_add(stream: ir.Value) -> ResidualAdd | None:
    """The residual add that consumes `stream`, if the stream goes on."""
    candidates = []
    for use in stream.uses():
        node, slot = use.node, use.idx
        if node.op_type in ("Add", "SkipSimplifiedLayerNormalization") and slot in (0, 1):
            candidates.append(ResidualAdd(node, slot, 1 - slot))
    # The residual add's branch ends in a projection; other adds of the stream do not.
    ending_in_linear = [c for c in candidates if _branch_op(c) in ("MatMul", "Gemm")]
    chosen = ending_in_linear or candidates
    return chosen[0] if len(chosen) == 1 else None


def _branch_op(residual: ResidualAdd) -> str | None:
    node = residual.branch.producer() if residual.branch is not None else None
    return None if node is None else node.op_type


def _cone_ops(value: ir.Value, stop: ir.Value, limit: int = 400) -> set[str]:
    """Op types in the backward cone of `value`, not crossing `stop`."""
    seen, ops, frontier = set(), set(), [value]
    while frontier and len(seen) < limit:
        current = frontier.pop()
        node = current.producer() if current is not None else None
        if current is stop or node is None or id(node) in seen:
            continue
        seen.add(id(node))
        ops.add(node.op_type)
        frontier.extend(v for v in node.inputs if v is not None)
    return ops


def _is_attention(branch: ir.Value, stream: ir.Value) -> bool:
    return bool(_cone_ops(branch, stream) & ATTENTION_OPS)


def _describe_branch(branch: ir.Value, stream: ir.Value) -> str:
    """A short name for a branch that is neither attention nor RMSNorm -> SwiGLU, e.g. LayerNorm -> GELU."""
    ops = _cone_ops(branch, stream)
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


_LAYER = re.compile(r"((?:model\.)?(?:layers|h|blocks)\.\d+)")


def _layer_name(node: ir.Node | None) -> str | None:
    """The source layer from the dynamo exporter's name scopes (display only; names are not reliable)."""
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
    return None


def vocab_size(blocks: list[Block]) -> int:
    """Rows of the token-embedding table (the Gather that produces block 0's input)."""
    return int(blocks[0].block_input.producer().inputs[0].shape[0])


def attention_free_runs(attention: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [i, j] (inclusive) of consecutive blocks without attention, from per-block flags."""
    runs: list[tuple[int, int]] = []
    for index, has_attention in enumerate(attention):
        if has_attention:
            continue
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs
