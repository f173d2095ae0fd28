"""The greedy parallel-block selection (passes/analysis/parallel_groups.py) on hand-made dependency matrices:
rank by max then sum, overlaps skipped, non-full blocks and FFN groups excluded, one-line refusals; and the
heatmap's dashed outline for the chosen groups."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.image import imread

from passes.analysis.heatmap import plot_dependency
from passes.analysis.parallel_groups import full_block_windows, select_parallel_groups
from passes.errors import UserError


def matrix(n: int, fill: float, values: dict[tuple[int, int], float]) -> np.ndarray:
    """An n x n dependency matrix: `fill` above the diagonal except `values`, NaN on and below it."""
    d = np.triu(np.full((n, n), fill), k=1)
    for (i, j), v in values.items():
        d[i, j] = v
    d[np.tril_indices(n)] = np.nan
    return d


def groups(candidates) -> list[tuple[int, int]]:
    return [c.group for c in candidates]


def test_equal_max_is_broken_by_the_smaller_sum() -> None:
    d = matrix(6, 0.5, {(0, 1): 0.2, (0, 2): 0.2, (1, 2): 0.2, (3, 4): 0.2, (3, 5): 0.05, (4, 5): 0.05})
    selection = select_parallel_groups([True] * 6, d, block_group=3)
    assert groups(selection.candidates)[:2] == [(3, 5), (0, 2)]
    first, second = selection.candidates[:2]
    assert first.max_dependency == second.max_dependency == 0.2
    assert first.sum_dependency == pytest.approx(0.3) and second.sum_dependency == pytest.approx(0.6)
    assert groups(selection.chosen) == [(3, 5), (0, 2)]
    assert selection.to_json()["chosen"][0] == {"group": [3, 5], "max": 0.2, "sum": pytest.approx(0.3)}


def test_overlapping_candidates_are_skipped() -> None:
    d = matrix(5, 0.9, {(0, 1): 0.3, (1, 2): 0.1, (2, 3): 0.2, (3, 4): 0.4})
    selection = select_parallel_groups([True] * 5, d, block_group=2)
    assert groups(selection.candidates) == [(1, 2), (2, 3), (0, 1), (3, 4)]
    assert groups(selection.chosen) == [(1, 2), (3, 4)]  # [2, 3] and [0, 1] overlap [1, 2]


def test_the_default_window_is_four_blocks_ranked_by_the_max_inside() -> None:
    d = matrix(8, 0.1, {(0, 3): 0.6, (5, 7): 0.3})
    selection = select_parallel_groups([True] * 8, d)
    assert selection.block_group == 4
    # Equal max and sum: by position. Every later window overlaps [1, 4].
    assert groups(selection.candidates) == [(1, 4), (2, 5), (3, 6), (4, 7), (0, 3)]
    assert [c.max_dependency for c in selection.candidates] == [0.1, 0.1, 0.1, 0.3, 0.6]
    assert groups(selection.chosen) == [(1, 4)]


def test_non_full_blocks_and_ffn_groups_are_excluded() -> None:
    full = [True, True, False, True, True, True]
    d = matrix(6, 0.5, {(1, 2): 0.0, (2, 3): 0.0, (4, 5): 0.01})
    assert full_block_windows(full, 2) == [(0, 1), (3, 4), (4, 5)]
    assert groups(select_parallel_groups(full, d, 2).chosen) == [(4, 5), (0, 1)]
    selection = select_parallel_groups(full, d, 2, ffn_groups=[(5, 6)])
    assert groups(selection.candidates) == [(0, 1), (3, 4)]


def test_refusals_are_one_line() -> None:
    d = matrix(4, 0.5, {})
    with pytest.raises(UserError, match=r"--block-group 1: a parallel group holds at least 2 blocks"):
        select_parallel_groups([True] * 4, d, block_group=1)
    with pytest.raises(UserError, match=r"no 3 consecutive full blocks .* outside the FFN groups \[1, 2\]"):
        select_parallel_groups([True] * 4, d, block_group=3, ffn_groups=[(1, 2)])
    with pytest.raises(UserError, match="no 2 consecutive full blocks"):
        select_parallel_groups([True, False, True, False], d, block_group=2)
    with pytest.raises(UserError, match=r"4 blocks but a \(3, 3\) dependency matrix"):
        select_parallel_groups([True] * 4, d[:3, :3])


def test_heatmap_marks_parallel_groups_in_their_own_colour(tmp_path) -> None:
    d = matrix(8, 0.2, {})
    attention = [True] * 8
    plain = imread(plot_dependency(d, attention, [], tmp_path / "plain.png"))
    marked = imread(plot_dependency(d, attention, [], tmp_path / "marked.png", parallel=[(0, 3), (4, 7)]))

    def magenta(image: np.ndarray) -> int:  # the dashed outline, #ff00ff
        r, g, b = image[..., 0], image[..., 1], image[..., 2]
        return int(((r > 0.9) & (g < 0.2) & (b > 0.9)).sum())

    assert magenta(plain) == 0 and magenta(marked) > 500
