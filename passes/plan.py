"""The fusion plan (design §2): parsed and validated against the block table before anything is written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from passes.errors import UserError

if TYPE_CHECKING:  # passes.metadata imports this module without onnx_ir
    from passes.blocks import Block

NORM_MODES = ("last", "fold")
PLAN_KEYS = {"groups", "norm", "parallel_blocks"}


@dataclass(frozen=True)
class Plan:
    groups: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    norm: str = "last"
    # Full-block parallel groups (design §10, passes/parallel.py): blocks i..j all read the same stream.
    parallel: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        data = {"groups": [list(g) for g in self.groups], "norm": self.norm}
        if self.parallel:  # plans without parallel groups keep their old form
            data["parallel_blocks"] = [list(g) for g in self.parallel]
        return json.dumps(data, sort_keys=True)

    @property
    def removed_blocks(self) -> int:
        """Blocks a fused model has fewer of: a group [i, j] becomes one block, identity layers inside it
        included (all-reduces are counted from the graph: passes.shard.count_allreduces)."""
        return sum(j - i for i, j in self.groups)


def parse_plan(data: object, source: str = "plan") -> Plan:
    """A Plan from decoded JSON; checks its form (not yet the model)."""
    if not isinstance(data, dict):
        raise UserError(f'{source}: expected a JSON object like {{"groups": [[42, 50]], "norm": "last"}}')
    unknown = sorted(set(data) - PLAN_KEYS)
    if unknown:
        raise UserError(
            f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
            "allowed: groups, norm, parallel_blocks"
        )
    norm = data.get("norm", "last")
    if norm not in NORM_MODES:
        raise UserError(f'{source}: unknown norm mode {norm!r}; use "last" (the paper\'s) or "fold"')
    groups = data.get("groups", [])
    if not isinstance(groups, list):
        raise UserError(f"{source}: groups must be a list of [first, last] block indices")
    parallel = data.get("parallel_blocks", [])
    if not isinstance(parallel, list):
        raise UserError(f"{source}: parallel_blocks must be a list of [first, last] block indices")
    return Plan(
        tuple(_parse_group(g, source) for g in groups),
        norm,
        tuple(_parse_group(g, source, "parallel group") for g in parallel),
    )


def _parse_group(group: object, source: str, what: str = "group") -> tuple[int, int]:
    if not (isinstance(group, list) and len(group) == 2 and all(type(i) is int for i in group)):
        raise UserError(f"{source}: {what} {json.dumps(group)} must be [first, last], two integers")
    first, last = group
    if first == last:
        raise UserError(
            f"{source}: {what} [{first}, {last}] has a single block; a group spans at least two"
        )
    if first > last:
        raise UserError(f"{source}: {what} [{first}, {last}] is reversed; write [{last}, {first}]")
    return first, last


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"plan {path} is not valid JSON ({exc})") from None
    return parse_plan(data, source=f"plan {path}")


def validate_plan(plan: Plan, blocks: list[Block]) -> None:
    """Check the plan against the model: in range, no overlap; inside a group (after its first block) no
    attention part of any kind, and no block whose FFN is not a SwiGLU (a Linear FFN) anywhere in it;
    at least two SwiGLU FFNs, one dtype and one epsilon. FFN-free, attention-free blocks (identity layers)
    may lie inside a group; an attention-only first block keeps its attention before the fused FFN."""
    by_index = {b.index: b for b in blocks}
    previous: tuple[int, int] | None = None
    for first, last in sorted(plan.groups):
        if first >= last:  # parse_plan refuses these too; a Plan built in code reaches here unchecked
            raise UserError(f"group [{first}, {last}] must be [first, last] with first < last (2+ blocks)")
        if first not in by_index or last not in by_index:
            raise UserError(
                f"group [{first}, {last}] is out of range: the model has blocks 0..{len(blocks) - 1}"
            )
        if previous is not None and first <= previous[1]:
            raise UserError(f"groups [{previous[0]}, {previous[1]}] and [{first}, {last}] overlap")
        previous = (first, last)
        group = [by_index[k] for k in range(first, last + 1)]
        for block in group:
            _check_parallel_member(block, f"group [{first}, {last}]")
            _check_member(block, first, last, block.index == first)
        members = [b for b in group if b.ffn is not None]
        if len(members) < 2:
            what = f"block {members[0].index}" if members else "none"
            raise UserError(
                f"group [{first}, {last}] has fewer than two SwiGLU FFNs to fuse (only {what}); "
                "widen it or drop it"
            )
        unweighted = [b.index for b in members if b.norm is not None and b.norm.weight is None]
        if unweighted:
            raise UserError(
                f"block {unweighted[0]} has an RMSNorm without weight (already fused?); cannot fuse it"
            )
        dtypes = {b.dtype for b in members}
        if len(dtypes) > 1:
            raise UserError(f"group [{first}, {last}] mixes weight dtypes {sorted(d.name for d in dtypes)}")
        epsilons = {b.norm.eps for b in members if b.norm is not None}
        if len(epsilons) > 1:
            raise UserError(f"group [{first}, {last}] mixes RMSNorm epsilons {sorted(epsilons)}")
    validate_parallel(plan, blocks)


def validate_parallel(plan: Plan, blocks: list[Block]) -> None:
    """Check the parallel groups against the model: in range, 2+ blocks, overlapping neither each other nor
    an FFN group, and every block a full one (softmax attention and a SwiGLU FFN)."""
    by_index = {b.index: b for b in blocks}
    taken = [(first, last, "FFN group") for first, last in plan.groups]
    for first, last in sorted(plan.parallel):
        name = f"parallel group [{first}, {last}]"
        if first >= last:
            raise UserError(f"{name} must be [first, last] with first < last (2+ blocks)")
        if first not in by_index or last not in by_index:
            raise UserError(f"{name} is out of range: the model has blocks 0..{len(blocks) - 1}")
        for other_first, other_last, kind in taken:
            if first <= other_last and other_first <= last:
                raise UserError(
                    f"{name} overlaps {kind} [{other_first}, {other_last}]; a block belongs to one group"
                )
        taken.append((first, last, "parallel group"))
        for block in (by_index[k] for k in range(first, last + 1)):
            _check_parallel_member(block, name)
            lacks = _not_full(block)
            if lacks:
                layer = f" (layer {block.layer_name})" if block.layer_name else ""
                raise UserError(
                    f"{name}: block {block.index}{layer} {lacks}; every block of a parallel group needs "
                    "softmax attention and a SwiGLU FFN (leave it out of the group)"
                )


def _check_parallel_member(block: Block, name: str) -> None:
    """A block of a graph's parallel group (already rewritten) cannot join another group."""
    if block.parallel is not None:
        first, last = block.parallel
        raise UserError(
            f"{name}: block {block.index} is in the graph's parallel group [{first}, {last}] already; "
            "write the plan for the original model"
        )


def _not_full(block: Block) -> str | None:
    """What a block lacks to be in a parallel group (None: Block.full)."""
    if block.attention_kind == "none":
        return "has no attention part"
    if block.attention_kind != "attention":
        what = block.attention_what or block.attention_kind
        return f"has no softmax attention: its attention part is {what}"
    if block.ffn_kind == "none":
        return "has no FFN part"
    if block.ffn is None:
        return f"has no SwiGLU FFN: its FFN is {block.ffn_what or block.ffn_kind}"
    return None


def _check_member(block: Block, first: int, last: int, is_first: bool) -> None:
    """A UserError naming the block, its layer and its kind when it cannot be in group [first, last]."""
    layer = f"layer {block.layer_name}; " if block.layer_name else ""
    if block.ffn_kind in ("linear", "other"):
        raise UserError(
            f"group [{first}, {last}] spans a branch fusion cannot cross: block {block.index}'s FFN is "
            f"{block.ffn_what} (only SwiGLU FFNs fuse)"
        )
    if is_first:
        return
    if block.attention:
        raise UserError(
            f"group [{first}, {last}] spans attention: block {block.index} has attention "
            f"({layer}only the first block of a group may have it)"
        )
    if block.barrier is not None:
        raise UserError(
            f"group [{first}, {last}] spans a branch fusion cannot cross: block {block.index} follows "
            f"{block.barrier} (only the first block of a group may have an attention part)"
        )
