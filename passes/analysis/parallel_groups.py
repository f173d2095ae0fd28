"""Which whole blocks to run side by side (paper section 6, docs/design.md §10): the greedy selection over the
dependency matrix.

Candidates are all windows of `block_group` consecutive blocks that are all full blocks (softmax attention
and a SwiGLU FFN) and overlap no FFN group of the plan. They are ranked by the largest pairwise dependency
inside the window, max D[k][l] over i <= k < l <= j, then by the sum of those pairwise dependencies (then by
position, so that the order is total), and taken greedily in that order, skipping any that overlaps one
already taken. Indices are positions in the block table, which are block numbers (as in propose.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from passes.errors import UserError

DEFAULT_BLOCK_GROUP = 4  # the paper's group size


@dataclass(frozen=True)
class ParallelCandidate:
    """One window of full blocks [first, last] and its pairwise dependencies."""

    group: tuple[int, int]
    max_dependency: float
    sum_dependency: float

    def row(self) -> dict:
        return {"group": list(self.group), "max": self.max_dependency, "sum": self.sum_dependency}

    def line(self) -> str:
        i, j = self.group
        return f"[{i}, {j}]: max dependency {self.max_dependency:.4f}, sum {self.sum_dependency:.4f}"


@dataclass(frozen=True)
class ParallelSelection:
    """Every candidate in rank order, and the non-overlapping ones the greedy walk took, in that order."""

    block_group: int
    candidates: tuple[ParallelCandidate, ...]
    chosen: tuple[ParallelCandidate, ...]

    def to_json(self) -> dict:
        return {
            "block_group": self.block_group,
            "candidates": [c.row() for c in self.candidates],
            "chosen": [c.row() for c in self.chosen],
        }


def full_block_windows(
    full: Sequence[bool], block_group: int, ffn_groups: Sequence[tuple[int, int]] = ()
) -> list[tuple[int, int]]:
    """Every window [i, i + block_group - 1] of full blocks that overlaps no FFN group."""
    if block_group < 2:
        raise UserError(f"--block-group {block_group}: a parallel group holds at least 2 blocks")
    windows = []
    for first in range(len(full) - block_group + 1):
        last = first + block_group - 1
        if all(full[first : last + 1]) and not any(i <= last and first <= j for i, j in ffn_groups):
            windows.append((first, last))
    return windows


def select_parallel_groups(
    full: Sequence[bool],
    dependency: np.ndarray,
    block_group: int = DEFAULT_BLOCK_GROUP,
    ffn_groups: Sequence[tuple[int, int]] = (),
) -> ParallelSelection:
    """The paper's greedy selection (module docstring). `full[k]`: block k has softmax attention and a
    SwiGLU FFN; `dependency`: the N x N matrix of passes/analysis/dependency.py (NaN where i >= j)."""
    n = len(full)
    if np.shape(dependency) != (n, n):
        raise UserError(f"{n} blocks but a {np.shape(dependency)} dependency matrix")
    windows = full_block_windows(full, block_group, ffn_groups)
    if not windows:
        taken = ", ".join(f"[{i}, {j}]" for i, j in ffn_groups)
        beside = f" outside the FFN groups {taken}" if taken else ""
        raise UserError(
            f"no {block_group} consecutive full blocks (softmax attention and a SwiGLU FFN){beside}: "
            "nothing to parallelize; try a smaller --block-group"
        )
    values = np.asarray(dependency, dtype=np.float64)
    candidates = []
    for first, last in windows:
        inside = values[first : last + 1, first : last + 1][np.triu_indices(last - first + 1, k=1)]
        if np.isnan(inside).any():
            raise UserError(f"the dependency matrix has no values for blocks {first}..{last}")
        candidates.append(ParallelCandidate((first, last), float(inside.max()), float(inside.sum())))
    candidates.sort(key=lambda c: (c.max_dependency, c.sum_dependency, c.group))
    chosen: list[ParallelCandidate] = []
    for candidate in candidates:
        first, last = candidate.group
        if not any(first <= c.group[1] and c.group[0] <= last for c in chosen):
            chosen.append(candidate)
    return ParallelSelection(block_group, tuple(candidates), tuple(chosen))
