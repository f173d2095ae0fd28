"""Human-readable block tables: attention-free runs visible at a glance."""

from __future__ import annotations

from passes.blocks import Block
from passes.runs import attention_free_runs


def stream_map(blocks: list[Block]) -> str:
    """One character per block: A has attention, L a Linear-replaced (or other non-SwiGLU) branch before
    its FFN (a fusion barrier like attention), - neither."""
    return "".join(_mark(b) for b in blocks)


def _mark(block: Block) -> str:
    return "A" if block.attention else "L" if block.barrier is not None else "-"


def _fusable_runs(blocks: list[Block]) -> str:
    runs = attention_free_runs([b.fusion_barrier for b in blocks])
    runs = [f"{i}-{j} ({j - i + 1} blocks)" for i, j in runs if j > i]
    return ", ".join(runs) if runs else "none"


def format_block_table(blocks: list[Block]) -> str:
    lines = [f"{'block':>5}  {'attn':<4}  {'ffn_width':>9}  {'dtype':<8}  {'norm':<13}  layer"]
    for b in blocks:
        lines.append(
            f"{b.index:>5}  {_mark(b):<4}  {b.width:>9}  {b.dtype.name.lower():<8}  "
            f"{b.norm.kind:<13}  {b.layer_name or ''}"
        )
    lines.append(f"stream: {stream_map(blocks)}")
    lines.append(f"attention-free runs: {_fusable_runs(blocks)}")
    return "\n".join(lines)
