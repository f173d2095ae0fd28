"""Human-readable block tables: every layer's attention and FFN parts, and the attention-free runs where FFN
fusion groups can go (docs/design.md §2).

No graph library behind it (Block only as a type), so an exporter prints the runs of a checkpoint before
onnx_ir loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from passes.blocks import Block

_ATTENTION_MARKS = {"attention": "A", "linear": "L", "other": "?", "none": "-"}
_FFN_MARKS = {"swiglu": "F", "linear": "L", "other": "?", "none": "-"}


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


def format_runs(runs: list[tuple[int, int]]) -> str:
    """'6-7, 11, 42-51' style text; 'none' when empty."""
    return ", ".join(f"{i}" if i == j else f"{i}-{j}" for i, j in runs) or "none"


def stream_map(blocks: list[Block]) -> str:
    """One character per block for its attention part: A attention, L one Linear (replace_with_linear),
    ? another branch (both fusion barriers), - none."""
    return "".join(_ATTENTION_MARKS[b.attention_kind] for b in blocks)


def ffn_map(blocks: list[Block]) -> str:
    """One character per block for its FFN part: F SwiGLU, L one Linear, ? another branch, - none."""
    return "".join(_FFN_MARKS[b.ffn_kind] for b in blocks)


def fusable_runs(blocks: list[Block]) -> list[tuple[int, int]]:
    """Maximal runs of blocks that a group may hold after its first (no attention part of any kind, no
    Linear or other FFN) with at least two SwiGLU FFNs, as block numbers."""
    runs = attention_free_runs([b.fusion_barrier for b in blocks])
    runs = [(blocks[i].index, blocks[j].index) for i, j in runs]
    by_index = {b.index: b for b in blocks}
    return [(i, j) for i, j in runs if sum(by_index[k].has_swiglu for k in range(i, j + 1)) >= 2]


def _runs_text(blocks: list[Block]) -> str:
    runs = [f"{i}-{j} ({j - i + 1} blocks)" for i, j in fusable_runs(blocks)]
    return ", ".join(runs) if runs else "none"


def format_block_table(blocks: list[Block]) -> str:
    lines = [f"{'block':>5}  {'attention':<10}  {'ffn':<12}  {'dtype':<8}  {'norm':<13}  layer"]
    for b in blocks:
        dtype = b.dtype.name.lower() if b.dtype is not None else "-"
        norm = b.norm.kind if b.norm is not None else "-"
        layer = b.layer_name or ("(identity: no nodes)" if b.is_identity else "")
        if b.parallel is not None:
            layer = f"{layer}  parallel [{b.parallel[0]}, {b.parallel[1]}]".lstrip()
        lines.append(
            f"{b.index:>5}  {b.attention_label():<10}  {b.ffn_label():<12}  {dtype:<8}  {norm:<13}  {layer}"
        )
    lines.append(f"stream: {stream_map(blocks)}")
    lines.append(f"ffns:   {ffn_map(blocks)}")
    lines.append(f"attention-free runs: {_runs_text(blocks)}")
    groups = sorted({b.parallel for b in blocks if b.parallel is not None})
    if groups:
        lines.append("parallel groups: " + ", ".join(f"[{i}, {j}]" for i, j in groups))
    return "\n".join(lines)
