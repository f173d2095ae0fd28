"""Plan proposal from the dependency matrix, and the norm-mode choice by measured error.

Rules (paper sections 3 and 5.3):
- only attention-free runs are fused (`attention`: per block, a fusion barrier: an attention part of any
  kind, or an FFN that is no SwiGLU); each run's final FFN is left out (it is the sensitive one), so a
  run [a, b] whose last SwiGLU FFN is block f offers blocks a..f-1. Blocks without a SwiGLU FFN (width
  0: identity layers) may lie inside a group; a group holds at least two SwiGLU FFNs;
- by default a group starts at an attention-free block. With `start_at_attention` a group may also
  start at the attention block just before a run (its attention stays in place, its FFN joins the
  group; docs/design.md §2). Off by default: the dependency row of that block measures skipping its attention
  too, which fusion keeps, so it says little about fusing its FFN; the paper does not do it either;
- inside a region, groups are contiguous and chosen to need the fewest sequential FFN steps such that
  every group's largest pairwise dependency max_{i<=k<l<=j} D[k][l] is at most `threshold`, it has at
  most `max_group` blocks and its fused intermediate width is at most `max_width`; ties go to the
  smaller sum of the groups' largest dependencies (an exact dynamic program over split points).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from passes.block_table import attention_free_runs
from passes.error_measures import cosine, l2_relative_error
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.pipeline import fuse_file
from passes.plan import NORM_MODES, Plan
from passes.run.block_runner import model_logits

DEFAULT_THRESHOLD = 0.15


@dataclass(frozen=True)
class GroupChoice:
    group: tuple[int, int]
    max_dependency: float
    width: int
    stopped: str  # why the group does not extend to the next block
    healed_error: float | None = None  # with a healed cost (analyze.py --heal): its held-out error
    ffns: int | None = None  # SwiGLU FFNs in the group (fewer than its blocks when identity layers lie in it)

    def line(self) -> str:
        i, j = self.group
        healed = "" if self.healed_error is None else f", healed error {self.healed_error:.3f}"
        return (
            f"group [{i}, {j}]: {self.ffns or j - i + 1} FFNs, "
            f"max dependency inside {self.max_dependency:.3f}{healed}, width {self.width}; "
            f"stops: {self.stopped}"
        )


@dataclass
class Proposal:
    groups: list[GroupChoice]
    notes: list[str]
    threshold: float
    max_group: int | None
    max_width: int | None

    def plan(self, norm: str = "last") -> Plan:
        return Plan(tuple(g.group for g in self.groups), norm)

    def lines(self) -> list[str]:
        return [*self.notes, *(g.line() for g in self.groups)] or ["no attention-free runs: nothing to fuse"]

    def to_json(self) -> dict:
        return {
            "threshold": self.threshold,
            "max_group": self.max_group,
            "max_width": self.max_width,
            "groups": [
                {
                    "group": list(g.group),
                    "max_dependency": g.max_dependency,
                    "width": g.width,
                    "stopped": g.stopped,
                    **({} if g.healed_error is None else {"healed_error": g.healed_error}),
                }
                for g in self.groups
            ],
            "notes": self.notes,
        }


def group_max_dependency(dependency: np.ndarray, first: int, last: int) -> float:
    """max D[k][l] over first <= k < l <= last (0 for a single block)."""
    if last <= first:
        return 0.0
    block = np.asarray(dependency, dtype=np.float64)[first : last + 1, first : last + 1]
    values = block[np.triu_indices(last - first + 1, k=1)]
    if np.isnan(values).any():
        raise UserError(f"the dependency matrix has no values for blocks {first}..{last}")
    return float(values.max())


def propose(
    attention: Sequence[bool],
    widths: Sequence[int],
    dependency: np.ndarray,
    threshold: float = DEFAULT_THRESHOLD,
    max_group: int | None = None,
    max_width: int | None = None,
    start_at_attention: bool = False,
    healed_cost: Callable[[int, int], float] | None = None,
) -> Proposal:
    """Groups for each attention-free run (final FFN left out); see the module docstring for the rules.
    With `healed_cost` (the error a group keeps after healing, e.g. runtime.heal.costs.HealedCosts), a
    group's cost is that instead of its largest pairwise dependency, and `threshold` bounds it."""
    n = len(attention)
    if len(widths) != n or np.shape(dependency) != (n, n):
        raise UserError(f"{n} blocks but {len(widths)} widths and a {np.shape(dependency)} dependency matrix")
    if max_group is not None and max_group < 2:
        raise UserError(f"--max-group {max_group}: a group fuses at least 2 blocks")
    if threshold < 0 or math.isnan(threshold):
        raise UserError(f"threshold {threshold} must be >= 0")
    limits = _Limits(dependency, widths, threshold, max_group, max_width, healed_cost)
    groups, notes = [], []
    for a, end in attention_free_runs(attention):
        ffns = [k for k in range(a, end + 1) if widths[k] > 0]
        b = ffns[-1] if ffns else end  # the run's final FFN
        # A group may start at the attention block before the run, unless that block's FFN is no SwiGLU.
        first = a - 1 if start_at_attention and a > 0 and widths[a - 1] > 0 else a
        last = b - 1
        what = f"attention-free run {a}-{end}"
        if last <= first:
            notes.append(f"{what}: too short to fuse once its final FFN (block {b}) is left out")
            continue
        start = f", starting at attention block {first}" if first < a else ""
        notes.append(
            f"{what}: block {b} is the run's final FFN, left out; fusable blocks {first}-{last}{start}"
        )
        chosen = _split(limits, first, last)
        groups.extend(_explain(limits, g, last, b) for g in chosen if limits.ffns(*g) >= 2)
        alone = [g[0] for g in chosen if limits.ffns(*g) < 2 and widths[g[0]] > 0]
        if alone:
            notes.append(f"{what}: block(s) {', '.join(map(str, alone))} stay unfused (no neighbor fits)")
    return Proposal(groups, notes, threshold, max_group, max_width)


@dataclass
class _Limits:
    dependency: np.ndarray
    widths: Sequence[int]
    threshold: float
    max_group: int | None
    max_width: int | None
    healed_cost: Callable[[int, int], float] | None = None

    def ffns(self, first: int, last: int) -> int:
        """SwiGLU FFNs in [first, last] (blocks of width 0 have none)."""
        return sum(1 for w in self.widths[first : last + 1] if w > 0)

    def cost(self, first: int, last: int) -> float:
        """The group's cost: its healed error, else its largest pairwise dependency."""
        if self.healed_cost is None or last <= first:
            return group_max_dependency(self.dependency, first, last)
        return float(self.healed_cost(first, last))

    def violation(self, first: int, last: int) -> str | None:
        """Why [first, last] cannot be a group, or None if it can."""
        size = last - first + 1
        if size == 1:
            return None
        if self.max_group is not None and size > self.max_group:
            return f"--max-group {self.max_group} reached"
        width = sum(self.widths[first : last + 1])
        if self.max_width is not None and width > self.max_width:
            return f"adding block {last} would make the width {width} > --max-width {self.max_width}"
        if self.healed_cost is not None:
            healed = self.cost(first, last)
            if healed > self.threshold:
                return (
                    f"adding block {last} would raise the healed error to {healed:.3f} "
                    f"> threshold {self.threshold:g}"
                )
            return None
        worst = group_max_dependency(self.dependency, first, last)
        if worst > self.threshold:
            k, m = _argmax_pair(self.dependency, first, last)
            return (
                f"adding block {last} would raise the max dependency to {worst:.3f} "
                f"(D[{k}][{m}]) > threshold {self.threshold:g}"
            )
        return None


def _argmax_pair(dependency: np.ndarray, first: int, last: int) -> tuple[int, int]:
    block = np.asarray(dependency, dtype=np.float64)[first : last + 1, first : last + 1]
    masked = np.where(np.triu(np.ones_like(block, dtype=bool), k=1), block, -np.inf)
    k, m = np.unravel_index(np.argmax(masked), masked.shape)
    return first + int(k), first + int(m)


def _split(limits: _Limits, first: int, last: int) -> list[tuple[int, int]]:
    """Contiguous groups covering first..last: fewest groups, then smallest sum of max dependencies."""
    length = last - first + 1
    best: list[tuple[int, float, int]] = [(0, 0.0, -1)] + [(10**9, math.inf, -1)] * length
    for end in range(1, length + 1):
        for begin in range(end - 1, -1, -1):
            g = (first + begin, first + end - 1)
            if limits.violation(*g) is not None:
                break  # every limit is monotone: a longer group violates it too
            steps, cost, _ = best[begin]
            candidate = (steps + 1, cost + limits.cost(*g), begin)
            if candidate[:2] < best[end][:2]:
                best[end] = candidate
    groups, end = [], length
    while end > 0:
        begin = best[end][2]
        groups.append((first + begin, first + end - 1))
        end = begin
    return groups[::-1]


def _explain(limits: _Limits, group: tuple[int, int], region_last: int, run_last: int) -> GroupChoice:
    first, last = group
    if last == region_last:
        stopped = f"block {run_last} is the run's final FFN (left out)"
    else:
        stopped = limits.violation(first, last + 1) or (
            f"block {last + 1} starts the next group (fewer groups overall / lower dependency that way)"
        )
    width = int(sum(limits.widths[first : last + 1]))
    healed = limits.cost(first, last) if limits.healed_cost is not None else None
    dependency = group_max_dependency(limits.dependency, first, last)
    return GroupChoice(group, dependency, width, stopped, healed, limits.ffns(first, last))


# ---------------------------------------------------------------------------------------------- norm mode


@dataclass
class NormChoice:
    errors: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> logits rel. error, cosine
    chosen: str = "last"

    def lines(self) -> list[str]:
        out = [
            f"norm {mode!r}: logits relative error {e['logits_rel_error']:.4g}, "
            f"cosine {e['logits_cosine']:.6f}"
            for mode, e in self.errors.items()
        ]
        return [*out, f"chosen norm mode: {self.chosen!r} (lower logits error)"]


def choose_norm(
    model_path: str | Path,
    groups: Sequence[tuple[int, int]],
    tokens: np.ndarray,
    workdir: str | Path,
    reference_logits: np.ndarray | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> NormChoice:
    """Fuse with each norm mode into temporary files in `workdir`, compare logits with the original on
    `tokens`, and pick the mode with the lower relative error. No groups: "last", nothing measured."""
    model_path = Path(model_path)
    choice = NormChoice()
    if not groups:
        return choice
    if reference_logits is None:
        reference_logits = model_logits(model_path, tokens)
    checked = tokens[: Signature.of(model_path).batch_size(len(tokens))]  # what one validation run takes
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".norm-choice.") as tmp:
        for mode in NORM_MODES:
            fused = Path(tmp) / f"fused-{mode}.onnx"
            log(f"fusing with norm={mode!r} to measure its error")
            fuse_file(model_path, Plan(tuple(groups), mode), fused, validate_output=True, tokens=checked)
            logits = model_logits(fused, tokens)
            choice.errors[mode] = {
                "logits_rel_error": l2_relative_error(logits, reference_logits),
                "logits_cosine": cosine(logits, reference_logits),
            }
    choice.chosen = min(choice.errors, key=lambda m: choice.errors[m]["logits_rel_error"])
    return choice
