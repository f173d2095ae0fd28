"""The block table's records (docs/design.md §2, docs/passes.md "Blocks"): one `Block` per source layer,
numbered as the source model numbers its layers.

A block is an attention part and an FFN part, each of a kind:

- attention part: "attention" (softmax attention: GQA with its own KV heads, MHA, a fused attention op),
  "linear" (one projection, Nemotron-NAS replace_with_linear), "other" (a branch no recognizer knows), or
  "none" (absent: attention no_op);
- FFN part: "swiglu" (RMSNorm -> SwiGLU, the only fusable kind), "linear", "other" or "none" (ffn no_op).

A layer with neither part is the identity: it leaves nothing in a graph, and is a block (with no nodes)
only where the graph's metadata names it (passes.model_map reads the exporter's layer map).

The stream walk that finds blocks is passes/model_map.py (`build_model_map`), the one walker of the
project; its `find_blocks` returns these records.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from passes.patterns.rmsnorm import Norm
from passes.patterns.swiglu import SwiGLU

ATTENTION_KINDS = ("attention", "linear", "other", "none")
FFN_KINDS = ("swiglu", "linear", "other", "none")


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
    """One layer: `block_input` -> attention part -> FFN part -> the stream leaving it."""

    index: int  # the source layer index (docs/design.md §2)
    block_input: ir.Value  # the stream entering the block (before its attention part, if any)
    attention_kind: str  # one of ATTENTION_KINDS
    ffn_kind: str  # one of FFN_KINDS
    norm: Norm | None  # "swiglu" FFN part only
    ffn: SwiGLU | None  # "swiglu" FFN part only
    residual: ResidualAdd | None  # adds the FFN part's output to the stream (any FFN kind); None if absent
    attention_residual: ResidualAdd | None  # adds the attention part's output; None if absent
    layer_name: str | None
    # The residual branches of a "linear"/"other" part, described (e.g. "residual branch 4 [linear]
    # (model.layers.2), a one-Linear branch (replace_with_linear)"): what a refused plan names.
    attention_what: str | None = None
    ffn_what: str | None = None
    kv_heads: int | None = None  # softmax attention: its KV heads, where the recognizer reads them
    heads: int | None = None  # softmax attention: its query heads, likewise
    # The parallel group (first, last) the block is a member of (passes/parallel.py wrote it): every member
    # reads the group's input, and `residual` is the group's add (x + the sum of all members' branches).
    parallel: tuple[int, int] | None = None

    @property
    def attention(self) -> bool:
        """Softmax attention in the attention part."""
        return self.attention_kind == "attention"

    @property
    def barrier(self) -> str | None:
        """A "linear"/"other" attention part, described: fusion cannot cross it, like attention."""
        return self.attention_what if self.attention_kind in ("linear", "other") else None

    @property
    def fusion_barrier(self) -> bool:
        """An attention part of any kind, or an FFN part that is no SwiGLU: no plan group may contain this
        block after its first (and one with a Linear/other FFN not even first)."""
        return self.attention_kind != "none" or self.ffn_kind in ("linear", "other")

    @property
    def full(self) -> bool:
        """Softmax attention and a SwiGLU FFN: what a parallel group's member needs (passes.plan)."""
        return self.attention and self.ffn is not None

    @property
    def has_swiglu(self) -> bool:
        return self.ffn is not None

    @property
    def is_identity(self) -> bool:
        """Neither part: a layer the graph has no nodes for (named by the exporter's metadata)."""
        return self.attention_kind == "none" and self.ffn_kind == "none"

    @property
    def last_residual(self) -> ResidualAdd | None:
        """The residual add that ends the block (its FFN part's, else its attention part's)."""
        return self.residual or self.attention_residual

    @property
    def output(self) -> ir.Value | None:
        """The stream leaving the block (None: the final Skip*Normalization keeps the sum internal)."""
        last = self.last_residual
        return self.block_input if last is None else last.output

    @property
    def ffn_input(self) -> ir.Value:
        """The stream entering the FFN part (after the attention part); the block output when there is
        no FFN part."""
        if self.parallel is not None and self.attention_residual is not None:
            return self.attention_residual.output or self.block_input  # h = x + a, this member's own
        if self.residual is not None:
            return self.residual.stream_in
        output = self.output
        return output if output is not None else self.block_input

    @property
    def width(self) -> int:
        """The SwiGLU FFN's intermediate width; 0 without one."""
        return self.ffn.width if self.ffn is not None else 0

    @property
    def dtype(self) -> ir.DataType | None:
        return self.ffn.gate.dtype if self.ffn is not None else None

    def attention_label(self) -> str:
        """'gqa kv=2', 'linear', 'other' or 'none'."""
        if self.attention_kind == "attention":
            return f"gqa kv={self.kv_heads}" if self.kv_heads else "attention"
        return self.attention_kind

    def ffn_label(self) -> str:
        """'swiglu 256', 'linear', 'other' or 'none'."""
        return f"swiglu {self.width}" if self.ffn is not None else self.ffn_kind

    def row(self) -> dict:
        """The block-table row as plain data (for --json and analysis)."""
        return {
            "index": self.index,
            "attention": self.attention,
            "attention_kind": self.attention_kind,
            "kv_heads": self.kv_heads,
            "ffn": self.ffn_kind,
            "ffn_width": self.width,
            "dtype": self.dtype.name.lower() if self.dtype is not None else None,
            "norm": self.norm.kind if self.norm is not None else None,
            "layer": self.layer_name,
            "parallel": list(self.parallel) if self.parallel else None,
        }
