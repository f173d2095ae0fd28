"""The two models healing works on: an original model and its fused model, checked against each other
(the plan in the fused model's metadata, both block tables, each group's starting weights, the batch and
sequence dims both accept). A plan's groups are its fused FFN groups and its full-block parallel groups
(Plan.parallel); each is healed on the FFN weights it holds (`weight_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from passes.blocks import Block
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY
from passes.model_map import find_blocks
from passes.plan import Plan
from passes.reference import parallel_sum
from passes.validate import plan_from_metadata
from runtime.heal.ffn import GroupWeights
from runtime.heal.input_limits import RunShape


@dataclass
class HealPair:
    """An original model and its fused model, checked against each other."""

    original: Path
    fused: Path
    plan: Plan
    original_blocks: list[Block]
    fused_blocks: list[Block]
    shape: RunShape  # windows per run and window length both graphs accept

    def fused_index(self, group: tuple[int, int]) -> int:
        """The index of the fused model's block that holds `group` (shifted by the groups before it)."""
        return group[0] - sum(j - i for i, j in self.plan.groups if j < group[0])

    def fused_block(self, group: tuple[int, int]) -> Block:
        return self.fused_blocks[self.fused_index(group)]

    @property
    def groups(self) -> list[tuple[int, int]]:
        """Every group to heal, FFN and parallel, along the stream."""
        return sorted([*self.plan.groups, *self.plan.parallel])

    def is_parallel(self, group: tuple[int, int]) -> bool:
        return group in self.plan.parallel

    def weight_blocks(self, group: tuple[int, int], blocks: list[Block] | None = None) -> list[Block]:
        """The blocks of the fused model (or of `blocks`, another graph of it) whose FFNs healing fits for
        `group`: the fused block of an FFN group, every member of a parallel group."""
        blocks = self.fused_blocks if blocks is None else blocks
        start = self.fused_index(group)
        return blocks[start : start + group[1] - group[0] + 1] if self.is_parallel(group) else [blocks[start]]

    def check_parallel_start(self, group: tuple[int, int], members: list[GroupWeights]) -> None:
        """A parallel group keeps its blocks' weights: each member's FFN must hold the original block's
        weights (float32, bit for bit). This catches an original that is not the one that was fused."""
        first, last = group
        for block, member in zip(self.original_blocks[first : last + 1], members, strict=True):
            if GroupWeights.read(block).fingerprint() != member.fingerprint():
                raise UserError(
                    f"{self.original} does not match the fused model {self.fused}: its parallel group "
                    f"[{first}, {last}] holds other FFN weights than the original's block {block.index}; "
                    "pass the model that was fused"
                )

    def check_start(self, group: list[Block], x: np.ndarray, got: np.ndarray, tolerance: float) -> None:
        """The starting weights must compute the parallel sum of the original blocks `group`
        (passes/reference.py): `got`, their output on `x`. This catches an original that is not the one
        that was fused."""
        reference = parallel_sum(x, group, self.plan.norm)
        got = got.astype(np.float64)
        error = float(np.linalg.norm(got - reference) / max(np.linalg.norm(reference - x), 1e-30))
        if not error <= tolerance:
            first, last = group[0].index, group[-1].index
            raise UserError(
                f"{self.original} does not match the fused model {self.fused}: its group [{first}, {last}] "
                f"is not the parallel sum of the original's blocks (relative error {error:.3g}); "
                "pass the model that was fused"
            )


def load_pair(original: str | Path, fused: str | Path) -> HealPair:
    """The plan from the fused model's metadata, checked against both block tables."""
    original, fused = Path(original), Path(fused)
    for path in (original, fused):
        if not path.is_file():
            raise UserError(f"model {path} does not exist")
    plan = plan_from_metadata(fused)
    if not plan.groups and not plan.parallel:
        raise UserError(f"{fused}: its plan has no FFN or parallel groups; there is nothing to heal")
    props = load_model(fused).metadata_props
    if HEAL_METADATA_KEY in props:
        raise UserError(f"{fused} is already healed ({HEAL_METADATA_KEY} metadata); heal the fused model")
    original_blocks = find_blocks(load_model(original))
    fused_blocks = find_blocks(load_model(fused))
    expected = len(original_blocks) - plan.removed_blocks
    mismatch = f"{original} does not match the fused model {fused}"
    last = max(j for _, j in [*plan.groups, *plan.parallel])
    if len(fused_blocks) != expected or last >= len(original_blocks):
        raise UserError(
            f"{mismatch}: {len(original_blocks)} blocks, the plan {plan.to_json()} needs "
            f"{len(fused_blocks)} + {plan.removed_blocks}; pass the model that was fused"
        )
    pair = HealPair(original, fused, plan, original_blocks, fused_blocks, RunShape.of([original, fused]))
    for first, last in plan.groups:
        width = sum(b.width for b in original_blocks[first : last + 1])
        if pair.fused_block((first, last)).width != width:
            raise UserError(f"{mismatch}: group [{first}, {last}] has width {width} in the original")
    for first, last in plan.parallel:
        members = pair.weight_blocks((first, last))
        start = pair.fused_index((first, last))  # the fused graph numbers its own blocks
        if any(b.parallel != (start, start + last - first) for b in members):
            raise UserError(f"{mismatch}: blocks {first}..{last} are no parallel group in the fused model")
    return pair
