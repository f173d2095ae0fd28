"""The moves a plan is built from, and the greedy walk that orders them (tools/analyze.py --frontier).

A move is one group a plan.json can hold:
- an FFN group [i, j] inside an attention-free run (every boundary: the run's final FFN left out or
  not, with --start-at-attention also from the attention block before the run), in one norm mode;
- a parallel group of `block_group` consecutive full blocks (paper section 6), in any norm mode.

A walk starts from the original and adds, one move at a time, the move with the most predicted
speedup gained per unit of quality lost, the loss estimated as the SUM of the moves' own measured costs
(each measured alone: screen.py). A move may swallow FFN groups it contains (growing [13, 16] into
[13, 19]); anything else overlapping is not allowed. One walk per norm mode (a plan has one norm
mode), and beside it one that takes the cheapest move each time while the summed cost stays below the
ratio walk's first plan (a first move with a large gain must not leave the low-KL end empty); with a KL
budget, one more per mode that takes only moves keeping the summed cost within it.
Every plan on a walk is then fused and measured whole (measure.py), because costs do not add up exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from passes.analysis.parallel_groups import full_block_windows
from passes.block_table import attention_free_runs
from passes.blocks import Block
from passes.plan import NORM_MODES, Plan

# A move whose summed cost does not grow (or shrinks) is taken first: gain / max(cost, this).
MIN_COST = 1e-9


@dataclass(frozen=True, order=True)
class Move:
    kind: str  # "ffn" or "parallel"
    group: tuple[int, int]
    norm: str | None = None  # the norm mode of an FFN group; None for a parallel group

    @property
    def plan(self) -> Plan:
        """The plan of this move alone."""
        if self.kind == "ffn":
            return Plan((self.group,), self.norm or "last")
        return Plan((), "last", (self.group,))

    def overlaps(self, other: Move) -> bool:
        return self.group[0] <= other.group[1] and other.group[0] <= self.group[1]

    def contains(self, other: Move) -> bool:
        return self.group[0] <= other.group[0] and other.group[1] <= self.group[1]


def ffn_moves(
    blocks: Sequence[Block], max_group: int | None = None, start_at_attention: bool = False
) -> list[Move]:
    """Every FFN group of 2 or more SwiGLU FFNs inside an attention-free run, first and last a SwiGLU, in
    both norm modes."""
    barriers = [b.fusion_barrier for b in blocks]
    moves = []
    for a, end in attention_free_runs(barriers):
        first = a - 1 if start_at_attention and a > 0 and blocks[a - 1].has_swiglu else a
        for i in range(first, end + 1):
            for j in range(i + 1, end + 1):
                members = blocks[i : j + 1]
                if max_group is not None and len(members) > max_group:
                    break
                # It starts and ends at a SwiGLU: an FFN-free block at either end (an identity layer) would
                # give a second name to the same fusion.
                ends = blocks[i].has_swiglu and blocks[j].has_swiglu
                if sum(b.has_swiglu for b in members) < 2 or not ends:
                    continue
                moves.extend(Move("ffn", (i, j), norm) for norm in NORM_MODES)
    return moves


def parallel_moves(blocks: Sequence[Block], block_group: int) -> list[Move]:
    """Every window of `block_group` consecutive full blocks (softmax attention and a SwiGLU FFN)."""
    full = [b.full for b in blocks]
    if len(full) < block_group:
        return []
    return [Move("parallel", w) for w in full_block_windows(full, block_group)]


def plan_of(moves: Sequence[Move], norm: str) -> Plan:
    """The plan.json object of a set of moves (FFN groups in `norm`; "last" when there are none)."""
    groups = tuple(sorted(m.group for m in moves if m.kind == "ffn"))
    parallel = tuple(sorted(m.group for m in moves if m.kind == "parallel"))
    return Plan(groups, norm if groups else "last", parallel)


@dataclass(frozen=True)
class Step:
    """One plan of a walk: its moves and what the walk knew when it took the last one."""

    moves: tuple[Move, ...]
    plan: Plan
    predicted_speedup: float
    summed_cost: float  # the sum of the moves' costs measured alone


def walk(
    moves: Sequence[Move],
    norm: str,
    cost: Callable[[Move], float],
    speedup: Callable[[Plan], float],
    max_steps: int | None = None,
    max_cost: float | None = None,
    cheapest: bool = False,
    until: float | None = None,
) -> list[Step]:
    """The greedy walk for one norm mode: FFN moves of `norm` and every parallel move; each step adds the
    move with the largest (speedup gained) / (summed cost added), swallowing the FFN groups it contains.
    With `max_cost`, only moves that keep the summed cost within it (a budget's walk: one large move taken
    early must not jump over the plans a small budget allows). `cheapest`: the move adding the least cost
    instead (the walk that fills the low-KL end below the ratio walk's first plan). `until`: stop at the
    first plan at least this fast (a speedup floor's walk: cheapest-first up to the floor)."""
    usable = [m for m in moves if m.kind == "parallel" or m.norm == norm]
    state: tuple[Move, ...] = ()
    current, spent = speedup(plan_of(state, norm)), 0.0
    steps: list[Step] = []
    while (max_steps is None or len(steps) < max_steps) and (until is None or current < until):
        best = None
        for move in usable:
            if move in state:
                continue
            inside = [m for m in state if m.overlaps(move)]
            if any(not (m.kind == "ffn" == move.kind and move.contains(m)) for m in inside):
                continue
            after = tuple(sorted([m for m in state if m not in inside] + [move]))
            gained = speedup(plan_of(after, norm)) - current
            if gained <= 0:
                continue
            added = cost(move) - sum(cost(m) for m in inside)
            if max_cost is not None and spent + added > max_cost:
                continue
            ratio = -added if cheapest else gained / max(added, MIN_COST)
            if best is None or (ratio, -added) > (best[0], -best[2]):
                best = (ratio, after, added, gained)
        if best is None:
            break
        _, state, added, gained = best
        current, spent = current + gained, spent + added
        steps.append(Step(state, plan_of(state, norm), current, spent))
    return steps


def dominated(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (speedup, kl): whether another point is at least as fast and at most as costly, and
    strictly better in one of the two."""
    out = []
    for s, k in points:
        out.append(any((s2 >= s and k2 <= k) and (s2 > s or k2 < k) for s2, k2 in points))
    return out
