"""The block table's records (docs/design.md §2): every RMSNorm -> SwiGLU FFN sub-block, together with the
residual branches since the previous one (its attention sub-block, if any, and any fusion barrier), is one
block, numbered in stream order.

The stream walk that finds them is passes/model_map.py (`build_model_map`), the one walker of the
project; its `find_blocks` returns these records.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from passes.patterns.rmsnorm import Norm
from passes.patterns.swiglu import SwiGLU


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
    # A residual branch before the FFN that is neither attention nor a SwiGLU FFN (a replace_with_linear
    # attention or FFN, a GELU FFN): fusion cannot cross it, like attention. What it is, or None.
    barrier: str | None = None

    @property
    def fusion_barrier(self) -> bool:
        """Attention or another barrier branch before the FFN: a plan group may start at this block, but
        not contain it after its first block."""
        return self.attention or self.barrier is not None

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

