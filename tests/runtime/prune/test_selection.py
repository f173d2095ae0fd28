"""runtime/prune/selection.py: layer lists, the run-preferring choice, the KL budget, the checks."""

from __future__ import annotations

import pytest

from passes.errors import UserError
from runtime.prune.model import load_checkpoint
from runtime.prune.selection import check_layers, choose, format_layers, parse_layers, within_budget
from tests.runtime.prune.fixtures import write_tiny_nemotron

# cheap layers 5-7 and 25-27, and a cheaper single layer 14 that runs must not take
IMPORTANCE = {i: 1.0 for i in range(30)} | dict.fromkeys((5, 6, 7, 25, 26, 27), 0.05) | {14: 0.01}


def test_parse_and_format() -> None:
    assert parse_layers("5-7,25-27") == [5, 6, 7, 25, 26, 27]
    assert parse_layers(" 3 , 1-2") == [1, 2, 3]
    assert format_layers([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"
    for bad in ("5-", "a", "7-5", ""):
        with pytest.raises(UserError):
            parse_layers(bad)


def test_choose_prefers_runs() -> None:
    assert choose(IMPORTANCE, 6, 2) == [5, 6, 7, 25, 26, 27]
    assert choose(IMPORTANCE, 6) == [5, 6, 7, 25, 26, 27]  # default: runs of about three
    assert choose(IMPORTANCE, 1, 1) == [14]
    separate = choose(IMPORTANCE, 3, 3)  # three runs: 14 and two cheap layers not next to each other
    assert 14 in separate and sum(IMPORTANCE[k] for k in separate) == pytest.approx(0.11)
    assert all(b - a > 1 for a, b in zip(separate, separate[1:], strict=False))
    with pytest.raises(UserError, match="keep at least one"):
        choose(IMPORTANCE, 30, 1)


def test_budget() -> None:
    assert within_budget(IMPORTANCE, 0.31, 2) == [5, 6, 7, 25, 26, 27]
    with pytest.raises(UserError, match="raise the budget"):
        within_budget(IMPORTANCE, 0.001)


def test_checks(tmp_path) -> None:
    model = load_checkpoint(write_tiny_nemotron(tmp_path / "nas"))
    assert check_layers(model, [0, 1]) == [0, 1]
    with pytest.raises(UserError, match="out of range"):
        check_layers(model, [5])
    with pytest.raises(UserError, match="already has no attention"):
        check_layers(model, [2])
    with pytest.raises(UserError, match="every attention layer"):
        check_layers(model, [0, 1, 3, 4])
